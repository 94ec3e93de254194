"""Top-1 agreement of the decodings in half precision (docs/gpu.md, "Half precision").

deen-tiny converted to float16 and bfloat16, every 15th newstest2017 sentence (201), beam 5 (greedy
for IAD), batches of 40 unless a row says 8: how many sentences' best hypotheses have the same
tokens in each pair of decodings.

    python scripts/half_agreement.py [--shared ../shared] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import fairseq_generate, load_checkpoints, make_sample, ours  # noqa: E402

from fairseq_streambeam import Budget  # noqa: E402
from fairseq_streambeam.generators.aggressive import AggressiveGenerator  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", default=os.environ.get("STREAMBEAM_SHARED", "../shared"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.shared) / "models" / "deen-tiny"
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root / "data-bin")
    task.load_dataset("test")
    d, ds = task.target_dictionary, task.dataset("test")
    sents = [ds.src[i][:-1].tolist() for i in range(0, len(ds), 15)]

    print(f"threads {torch.get_num_threads()}, {len(sents)} sentences")
    for dtype in (torch.float16, torch.bfloat16):
        r = decodings(models[0].to(dtype), d, sents)
        for a, b in PAIRS:
            same = sum(x == y for x, y in zip(r[a], r[b]))
            print(f"{str(dtype).split('.')[1]}: {a} vs {b}: {same}/{len(sents)}", flush=True)


PAIRS = [("beam", "fairseq"), ("fairseq", "fairseq/8"), ("var-stream", "var-batch"), ("continuous", "var-batch"),
         ("iad", "greedy"), ("iad/8 live", "greedy"), ("greedy", "greedy/8")]


def decodings(m, d, sents) -> dict:
    """Each decoding's best hypothesis tokens per sentence, in input order."""
    def decode(size, fn):
        out = [None] * len(sents)
        for j in range(0, len(sents), size):
            s = make_sample(d, sents[j:j + size])
            for i, h in zip(s["id"].tolist(), fn(s)):  # the collater sorts each batch by length
                out[j + i] = h[0]["tokens"].tolist()
        return out

    k5 = dict(beam_size=5)
    return {
        "fairseq": decode(40, lambda s: fairseq_generate([m], d, s, **k5)),
        "fairseq/8": decode(8, lambda s: fairseq_generate([m], d, s, **k5)),
        "beam": decode(40, lambda s: ours([m], d, s, **k5)[0]),
        "var-batch": decode(40, lambda s: ours([m], d, s, decoding="var-batch", **k5)[0]),
        "var-stream": decode(40, lambda s: ours([m], d, s, decoding="var-stream", budget=Budget(6), **k5)[0]),
        "continuous": decode(40, lambda s: ours([m], d, s, decoding="var-stream", refill_eps=0.9,
                                                stream_order="continuous", **k5)[0]),
        "greedy": decode(40, lambda s: fairseq_generate([m], d, s, beam_size=1)),
        "greedy/8": decode(8, lambda s: fairseq_generate([m], d, s, beam_size=1)),
        "iad": decode(40, lambda s: AggressiveGenerator([m], d).generate([m], s)),
        "iad/8 live": decode(40, lambda s: AggressiveGenerator([m], d, budget=Budget(8)).generate([m], s)),
    }


if __name__ == "__main__":
    main()
