"""Pair sources with an AR model's outputs for drafter training (sequence-level distillation).

  python -m fairseq_streambeam.drafters.distill --src train.de --hyp distilled/output.txt \\
      --sentencepiece-model spm.model --out-prefix work/train -s de -t en

Writes `PREFIX.S` / `PREFIX.T` segmented with the model's sentencepiece model (or unchanged with
--bpe none), one pair per line, skipping pairs with an empty side; prints how many were kept.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..spec import OneLineParser
from ..textio import read_lines


def main(argv=None) -> int:
    p = OneLineParser(prog="python -m fairseq_streambeam.drafters.distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="raw source lines (the decoder's input)")
    p.add_argument("--hyp", required=True,
                   help="the AR model's outputs, one per source line (decode_corpus output.txt)")
    p.add_argument("--out-prefix", required=True)
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    p.add_argument("--bpe", choices=["sentencepiece", "none"], default="sentencepiece")
    p.add_argument("--sentencepiece-model")
    a = p.parse_args(argv)
    if a.source_lang == a.target_lang:
        p.error(f"-s and -t name the same file suffix ({a.source_lang}); the pairs need two")
    if a.bpe == "sentencepiece" and not a.sentencepiece_model:
        p.error("--bpe sentencepiece needs --sentencepiece-model")
    try:
        src, hyp = read_lines(a.src), read_lines(a.hyp)  # split at "\n" only, as decode_corpus writes them
    except OSError as e:
        p.error(f"cannot read {e.filename}: {e.strerror}")
    if len(src) != len(hyp):
        p.error(f"{a.src} has {len(src)} lines but {a.hyp} has {len(hyp)}")
    if a.bpe == "sentencepiece":
        import sentencepiece as spm

        if not Path(a.sentencepiece_model).is_file():
            p.error(f"no sentencepiece model at {a.sentencepiece_model}")
        sp = spm.SentencePieceProcessor(model_file=a.sentencepiece_model)

        def seg(x: str) -> str:
            return " ".join(sp.encode(x, out_type=str))
    else:
        def seg(x: str) -> str:
            return x.strip()
    out = Path(a.out_prefix)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fs = open(f"{out}.{a.source_lang}", "w", encoding="utf-8")
        ft = open(f"{out}.{a.target_lang}", "w", encoding="utf-8")
    except OSError as e:
        p.error(f"cannot write {e.filename}: {e.strerror}")
    kept = 0
    with fs, ft:
        for x, y in zip(src, hyp):
            xs, ys = seg(x), seg(y)
            if xs and ys:
                fs.write(xs + "\n")
                ft.write(ys + "\n")
                kept += 1
    print(f"{kept} of {len(src)} pairs written to {out}.{{{a.source_lang},{a.target_lang}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
