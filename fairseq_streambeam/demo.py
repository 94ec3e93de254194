"""See it work, offline: train a tiny fairseq transformer on a small learnable synthetic task for
about a minute on CPU, then decode its test set with greedy, fixed beam, VAR-BATCH and VAR-STREAM
side by side and print the benchmark table. Needs no network and no ../shared.

  python -m fairseq_streambeam.demo            # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = 40


def make_task(root: Path, n_train: int, n_test: int, seed: int = 1) -> None:
    """Source: words a0..a39; target: each word mapped to b((7i) mod 40), the sequence reversed."""
    rng = random.Random(seed)

    def pair():
        src = [rng.randrange(WORDS) for _ in range(rng.randint(3, 14))]
        return " ".join(f"a{i}" for i in src), " ".join(f"b{(7 * i) % WORDS}" for i in reversed(src))

    for name, n in (("train", n_train), ("valid", 200), ("test", n_test)):
        pairs = [pair() for _ in range(n)]
        (root / f"{name}.src").write_text("\n".join(p[0] for p in pairs) + "\n")
        (root / f"{name}.tgt").write_text("\n".join(p[1] for p in pairs) + "\n")


def run(cmd) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"demo step failed: {' '.join(cmd[:3])} ...\n{r.stderr[-3000:]}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_streambeam.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", help="keep data and checkpoint here (default: a temporary directory)")
    p.add_argument("--train-pairs", type=int, default=6000)
    p.add_argument("--test-pairs", type=int, default=400)
    p.add_argument("--max-update", type=int, default=600, help="training updates (~1 minute at the default)")
    p.add_argument("--beam", type=int, default=8)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        print(f"1/3 synthetic task in {root}: map each word, reverse the sentence "
              f"({args.train_pairs} training pairs)", flush=True)
        make_task(root, args.train_pairs, args.test_pairs)
        py = sys.executable
        run([py, "-m", "fairseq_cli.preprocess", "--source-lang", "src", "--target-lang", "tgt",
             "--trainpref", str(root / "train"), "--validpref", str(root / "valid"), "--testpref", str(root / "test"),
             "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1"])
        print(f"2/3 training a tiny transformer for {args.max_update} updates on CPU", flush=True)
        run([py, "-m", "fairseq_cli.train", str(root / "bin"), "--arch", "transformer", "--encoder-layers", "2",
             "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
             "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
             "--decoder-attention-heads", "4", "--share-all-embeddings", "--optimizer", "adam", "--lr", "0.003",
             "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100", "--max-tokens", "3000",
             "--max-update", str(args.max_update), "--save-dir", str(root / "ckpt"), "--no-epoch-checkpoints",
             "--cpu", "--seed", "1", "--no-progress-bar", "--disable-validation", "--log-format", "simple"])
        print("3/3 decoding the test set with each method, side by side in one process", flush=True)
        from .bench.__main__ import main as bench_main

        rows = bench_main(["--data", str(root / "bin"), "--path", str(root / "ckpt" / "checkpoint_last.pt"),
                           "-s", "src", "-t", "tgt", "--post-process", "none", "--beam", str(args.beam),
                           "--batch-size", "32", "--methods", "fairseq-greedy,fairseq,beam,var-batch,var-stream",
                           "--out", str(root / "bench"), "--quiet", "--no-plots"])
    if args.workdir:  # otherwise everything was in a temporary directory, removed by now
        print(f"\ndata, checkpoint and results.json/results.md are in {args.workdir}")
    print("\nThese are toy numbers from a toy model on this machine. Real numbers need real models: "
          "python -m fairseq_streambeam.bench on your checkpoints, or scripts/reproduce_wmt19.sh "
          "--pair de-en on a GPU instance (WMT'19 ensembles, newstest2018).")
    return rows


if __name__ == "__main__":
    main()
