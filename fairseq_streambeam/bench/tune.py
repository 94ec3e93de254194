"""Tune LMBR's lambda, Theta0 and the evidence scale alpha on a dev set for BLEU (sacrebleu).

The model loads once; each setting decodes the dev set through the task API, as fairseq-generate
does. alpha changes the posteriors, so they are rebuilt in memory from the evidence per alpha (the
n-grams are indexed once). Search: the whole grid, or coordinate search (one parameter at a time
over its grid values, from a start point, until a round changes nothing). Prints a table and
writes to --out: `tune.md`, `tune.json` (every setting), `best.json` (a config for
`python -m fairseq_streambeam.bench --config`), `best.args` (fairseq-generate option lines) and
`best.hyp` (the dev outputs of the best setting).

  python -m fairseq_streambeam.bench.tune --data data-bin --path model.pt -s de -t en \\
      --gen-subset valid --nbest valid.nbest --decoding beam --beam 5 --out tune-out
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..scorers.build_posteriors import EvidenceError, add_evidence_args, load_evidence
from ..scorers.lmbr import write_posteriors

Setting = Tuple[float, float, float]  # (alpha, lambda, theta0)


@dataclass
class Result:
    alpha: Optional[float]  # None: no LMBR
    lam: Optional[float]
    theta0: Optional[float]
    bleu: float
    seconds: float
    steps: Optional[int]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fairseq_streambeam.bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="fairseq data-bin with the dev split")
    p.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    p.add_argument("--gen-subset", default="valid", help="the dev split (its ids key the evidence)")
    p.add_argument("--limit", type=int, default=0, help="tune on an evenly spaced subset of about this many sentences")
    p.add_argument("--post-process", default="sentencepiece", help="how tokens are detokenized for BLEU")
    add_evidence_args(p.add_argument_group("evidence (as build_posteriors)"))
    g = p.add_argument_group("decoding")
    g.add_argument("--decoding", default="beam", help="a beam decoding of the task: beam, var-stream, ...")
    g.add_argument("--beam", type=int, default=5)
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--lenpen", type=float, default=1.0)
    g.add_argument("--max-len-b", type=int, default=200)
    g = p.add_argument_group("search")
    g.add_argument("--alphas", type=float, nargs="+", default=[1.0], help="evidence score scales")
    g.add_argument("--lambdas", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0], help="NMT weights")
    g.add_argument("--theta0s", type=float, nargs="+", default=[-1.0, -0.5, -0.25, 0.0],
                   help="per-word constants Theta0")
    g.add_argument("--search", choices=["grid", "coordinate"], default="coordinate")
    g.add_argument("--start", type=float, nargs=3, metavar=("ALPHA", "LAMBDA", "THETA0"),
                   help="coordinate search: the start point (default: the middle of each grid)")
    g.add_argument("--rounds", type=int, default=3, help="coordinate search: at most this many rounds")
    g.add_argument("--lmbr-p", type=float, default=0.85)
    g.add_argument("--lmbr-r", type=float, default=0.72)
    g.add_argument("--no-baseline", action="store_true", help="skip the decoding without LMBR")
    p.add_argument("--threads", type=int, default=1, help="torch threads (set explicitly)")
    p.add_argument("--cpu", action="store_true", help="do not use CUDA even when present")
    p.add_argument("--out", default="tune-out", help="directory for the table, the best config and posteriors")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def search(evaluate: Callable[[Setting], float], grids: Sequence[List[float]], mode: str,
           start: Optional[Setting] = None, rounds: int = 3) -> Setting:
    """The best (alpha, lambda, theta0) on the grids by `evaluate` (higher is better; ties keep
    the earlier setting). `evaluate` is called at most once per setting by the caller's cache."""
    if mode == "grid":
        best, best_v = None, -float("inf")
        for a in grids[0]:  # alpha outermost: the posteriors change least often
            for lam in grids[1]:
                for t0 in grids[2]:
                    v = evaluate((a, lam, t0))
                    if v > best_v:
                        best, best_v = (a, lam, t0), v
        assert best is not None
        return best
    cur = list(start) if start else [g[(len(g) - 1) // 2] for g in grids]
    cur_v = evaluate(tuple(cur))  # type: ignore[arg-type]
    for _ in range(rounds):
        moved = False
        for k in (1, 2, 0):  # lambda, Theta0, then alpha (rebuilds the posteriors)
            for x in grids[k]:
                trial = list(cur)
                trial[k] = x
                v = evaluate(tuple(trial))  # type: ignore[arg-type]
                if v > cur_v:
                    cur, cur_v, moved = trial, v, True
        if not moved:
            break
    return tuple(cur)  # type: ignore[return-value]


class Tuner:
    """The loaded task, models and dev set; decodes the dev set with one LMBR setting at a time."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from ..loader import load_models, load_task
        from . import data as bench_data

        self.args = args
        self.out = Path(args.out)
        (self.out / "posteriors").mkdir(parents=True, exist_ok=True)
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.task = load_task(args.data, args.source_lang, args.target_lang)
        self.models = load_models(self.task, args.path, self.cuda)
        self.ts = bench_data.from_data_bin(self.task, args.gen_subset, args.limit, args.post_process)
        self.evidence, summary = load_evidence(args, self.task.target_dictionary)
        missing = sum(orig not in self.evidence.sources for orig in self.ts.orig_ids)
        print(f"dev: {len(self.ts.dataset)} sentences of {args.gen_subset}; evidence: {summary}"
              + (f"; {missing} dev sentences have none" if missing else ""), flush=True)
        self.cache: Dict[Tuple, Result] = {}
        self.outputs: Dict[Tuple, List[str]] = {}  # detokenized dev outputs per setting
        self._post_alpha: Optional[float] = None

    def _posteriors(self, alpha: float) -> str:
        """The dev set's posteriors for alpha, keyed by dev index, in a file the task reads."""
        path = self.out / "posteriors" / f"alpha={alpha:g}.jsonl"
        if self._post_alpha != alpha or not path.exists():
            post = self.evidence.posteriors(alpha)
            write_posteriors(path, {i: post[o] for i, o in enumerate(self.ts.orig_ids) if o in post})
            self._post_alpha = alpha
        return str(path)

    def decode(self, setting: Optional[Setting]) -> Result:
        """BLEU of the dev set decoded with `setting` (None: without LMBR); each setting once."""
        if setting in self.cache:
            return self.cache[setting]
        import sacrebleu
        from tqdm import tqdm

        from .__main__ import DEFAULTS, run_variant
        from .variants import Variant

        a = self.args
        lam, theta0 = (None, None) if setting is None else (setting[1], setting[2])
        settings = dict(DEFAULTS, beam=a.beam, batch_size=a.batch_size, max_tokens=a.max_tokens, lenpen=a.lenpen,
                        max_len_b=a.max_len_b, lmbr_lambda=lam, lmbr_theta0=theta0, lmbr_p=a.lmbr_p, lmbr_r=a.lmbr_r)
        posteriors = None if setting is None else self._posteriors(setting[0])
        label = "no LMBR" if setting is None else "alpha {:g} lambda {:g} theta0 {:g}".format(*setting)
        with tqdm(total=len(self.ts.dataset), desc=label, disable=a.quiet, leave=False, file=sys.stderr) as bar:
            t0 = time.perf_counter()
            v = Variant(a.decoding, a.decoding, lmbr=setting is not None)
            hyps, counters = run_variant(self.task, self.models, v, settings, self.ts, bar, self.cuda,
                                         lmbr_file=posteriors)
            dt = time.perf_counter() - t0
        text = [self.ts.decode(hyps[i]) for i in range(len(self.ts.dataset))]
        bleu = sacrebleu.corpus_bleu(text, [self.ts.refs]).score
        r = Result(*(setting or (None, None, None)), round(bleu, 2), round(dt, 2),
                   getattr(counters, "decoder_steps", None))
        self.cache[setting] = r
        self.outputs[setting] = text
        print(f"{label:40s} BLEU {r.bleu:6.2f}  {r.seconds:7.1f}s  {r.steps} steps", flush=True)
        return r


def markdown(results: List[Result], best: Optional[Result]) -> str:
    lines = ["| alpha | lambda | Theta0 | BLEU | seconds | decoder steps |", "|---|---|---|---|---|---|"]
    for r in results:
        cells = ["-" if v is None else f"{v:g}" for v in (r.alpha, r.lam, r.theta0)]
        mark = " (best)" if r is best else ""
        lines.append(f"| {' | '.join(cells)} | {r.bleu:.2f}{mark} | {r.seconds:.1f} | {r.steps} |")
    return "\n".join(lines)


def write_outputs(out: Path, args: argparse.Namespace, results: List[Result], best: Result) -> None:
    """tune.md, tune.json, and the best setting as a bench config and as fairseq-generate options."""
    table = markdown(results, best)
    (out / "tune.md").write_text(table + "\n")
    (out / "tune.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                               "results": [asdict(r) for r in results], "best": asdict(best)},
                                              indent=1, default=str) + "\n")
    ev = " ".join(args.nbest)
    d = args.decoding
    config = {
        "_comment": f"LMBR tuned for BLEU on {args.data}:{args.gen_subset} ({args.search} search, --decoding {d}, "
                    f"beam {args.beam}). Build the test set's posteriors with the same alpha: python -m "
                    f"fairseq_streambeam.scorers.build_posteriors --alpha {best.alpha:g} --nbest TEST-EVIDENCE "
                    "--dict DICT --out POSTERIORS, then pass --lmbr-posteriors POSTERIORS.",
        "_lmbr_alpha": best.alpha,
        "_dev_bleu": best.bleu,
        "_dev_evidence": ev,
        "beam": args.beam,
        "lmbr_lambda": best.lam,
        "lmbr_theta0": best.theta0,
        "lmbr_p": args.lmbr_p,
        "lmbr_r": args.lmbr_r,
        "baseline": d,
        "exact_ref": d,
        "variants": [{"name": d, "decoding": d}, {"name": f"{d}+lmbr", "decoding": d, "lmbr": True}],
    }
    (out / "best.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "best.args").write_text(f"--lmbr-lambda {best.lam:g}\n--lmbr-theta0 {best.theta0:g}\n"
                                   f"--lmbr-p {args.lmbr_p:g}\n--lmbr-r {args.lmbr_r:g}\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(x <= 0 for x in args.lambdas):
        print("error: --lambdas must be positive (lambda 0 turns -inf log-probs into NaN)", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    try:
        tuner = Tuner(args)
    except EvidenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_baseline:
        tuner.decode(None)
    grids = (args.alphas, args.lambdas, args.theta0s)
    best_setting = search(lambda s: tuner.decode(s).bleu, grids, args.search,
                          tuple(args.start) if args.start else None, args.rounds)
    results = list(tuner.cache.values())
    best = tuner.cache[best_setting]
    print()
    print(markdown(results, best))
    write_outputs(Path(args.out), args, results, best)
    (Path(args.out) / "best.hyp").write_text("".join(x + "\n" for x in tuner.outputs[best_setting]))
    print(f"\nbest: alpha {best.alpha:g}, lambda {best.lam:g}, theta0 {best.theta0:g}: BLEU {best.bleu:.2f}; wrote "
          f"{args.out}/best.json (bench --config) and {args.out}/best.args (fairseq-generate options)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
