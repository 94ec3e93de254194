"""Build LMBR n-gram posteriors from an n-best list (Tromble et al. 2008; Iglesias et al. 2018).

Evidence is fairseq-generate output with `--nbest N` (H-<id>\\t<log2 score>\\t<tokens> lines) of
any system whose tokens are in the NMT target vocabulary. Per sentence, entry i gets
p_i = softmax(alpha * score_i) and an n-gram u (orders 1..4, EOS appended to each entry) gets
P(u) = sum of p_i over the entries that contain u. Output: JSON lines read by --lmbr-posteriors.

  python -m fairseq_streambeam.scorers.build_posteriors --nbest gen.out --dict dict.en.txt --out post.jsonl
"""

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

from .lmbr import MAX_ORDER, NGram, write_posteriors

H_LINE = re.compile(r"^H-(\d+)\t(\S+)\t(.*)$")


def read_nbest(path: str) -> Dict[int, List[Tuple[float, List[str]]]]:
    """sentence id -> [(natural-log score, tokens)] from fairseq-generate output."""
    out: Dict[int, List[Tuple[float, List[str]]]] = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = H_LINE.match(line.rstrip("\n"))
            if m:
                out[int(m.group(1))].append((float(m.group(2)) * math.log(2), m.group(3).split()))
    if not out:
        raise ValueError(f"{path}: no H- lines (expected fairseq-generate output with --nbest)")
    return out


def posteriors(entries: List[Tuple[float, List[int]]], alpha: float = 1.0,
               max_order: int = MAX_ORDER) -> Dict[NGram, float]:
    """P(u) = sum_i p_i [u in entry i], p_i = softmax(alpha * score_i)."""
    top = max(alpha * s for s, _ in entries)
    weights = [math.exp(alpha * s - top) for s, _ in entries]
    z = sum(weights)
    post: Dict[NGram, float] = defaultdict(float)
    for (_, toks), w in zip(entries, weights):
        grams = {tuple(toks[i:i + n]) for n in range(1, max_order + 1) for i in range(len(toks) - n + 1)}
        for g in grams:
            post[g] += w / z
    return dict(post)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fairseq_streambeam.scorers.build_posteriors",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nbest", required=True, help="fairseq-generate output with --nbest N")
    p.add_argument("--dict", required=True, help="the NMT model's target dictionary (dict.xx.txt)")
    p.add_argument("--out", required=True)
    p.add_argument("--alpha", type=float, default=1.0, help="scale of the evidence scores before normalising")
    p.add_argument("--max-order", type=int, default=MAX_ORDER)
    p.add_argument("--write-vocab-masks", help="also write --token-masks allowing only the evidence's tokens "
                                               "per sentence (a hard constraint, Iglesias et al. Alg. 1)")
    args = p.parse_args(argv)
    from fairseq.data import Dictionary

    d = Dictionary.load(args.dict)
    records = {}
    unknown = 0
    for sid, entries in read_nbest(args.nbest).items():
        mapped = []
        for score, toks in entries:
            ids = [d.index(t) for t in toks] + [d.eos()]
            unknown += sum(i == d.unk() for i in ids)
            mapped.append((score, ids))
        records[sid] = posteriors(mapped, args.alpha, args.max_order)
    write_posteriors(Path(args.out), records)
    if args.write_vocab_masks:
        with open(args.write_vocab_masks, "w", encoding="utf-8") as f:
            for sid in sorted(records):
                allow = sorted({g[0] for g in records[sid] if len(g) == 1})
                f.write(json.dumps({"id": sid, "allow": allow}) + "\n")
    print(f"wrote posteriors for {len(records)} sentences to {args.out} ({unknown} evidence tokens not in the "
          "NMT vocabulary, mapped to unk)")


if __name__ == "__main__":
    main()
