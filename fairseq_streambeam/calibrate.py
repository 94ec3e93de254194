"""Calibrate a decoding on a dev set: variable-width pruning (delta, M, finish count) and LMBR weights.

Fixed beam is decoded once; its dev BLEU minus `--tolerance` is the target. The search then looks
for a cheap setting that reaches it, with few decodes: for each M (ascending), a bisection over the delta grid
at the largest finish count, then smaller finish counts, then one-step-narrower neighbours until
none is cheaper and still on target. Cost is expansions (device-independent) or, with
`--objective time`, seconds. With evidence (`--nbest`, as build_posteriors), LMBR's alpha, lambda
and Theta0 are tuned first for BLEU (grid or coordinate search) at the start pruning; pruning is
then searched with them. Every decode is appended to OUT/decodes.jsonl, so a rerun resumes.
Writes calibrate.md and .json (every decode, the Pareto front), pareto.png, best.args (one line
of options for streambeam-generate and streambeam-decode-corpus), best.json (a bench config) and
best.hyp. `--test-range` decodes held-out lines with fixed beam, the paper's settings and the
chosen ones (heldout.md).

  streambeam-calibrate --data data-bin --path model.pt -s de -t en --gen-subset valid --beam 5 --out calib
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import malloc
from .frontend import fairseq_log_level
from .spec import DECODINGS, PAPER_DELTA, PAPER_M, DecodeSpec, UsageError, checkpoint_files, count_problem

Prune = Tuple[float, int, int]  # (delta, M, finish count)
# evidence options beside the files that change its posteriors (n-gram order, how raw text is segmented)
EVIDENCE_KEYS = ("max_order", "tokenizer", "bpe", "bpe_codes", "sentencepiece_model")
Weights = Tuple[float, float, float]  # LMBR (alpha, lambda, Theta0)


class CalibrationError(Exception):
    """A usage or input mistake, reported in one line with exit status 2."""


@dataclass(frozen=True)
class Setting:
    """One decoding of the dev set: pruning (None: fixed beam) and LMBR weights (None: none)."""

    prune: Optional[Prune] = None
    weights: Optional[Weights] = None

    @property
    def label(self) -> str:
        p = "beam" if self.prune is None else "delta {:g} M {} z {}".format(*self.prune)
        return p if self.weights is None else p + ", LMBR alpha {:g} lambda {:g} theta0 {:g}".format(*self.weights)

    def options(self, a: argparse.Namespace) -> List[str]:
        """fairseq-generate options that reproduce this setting's decode with calibration options `a`
        (the LMBR posteriors file is the user's, built at alpha)."""
        decoding = a.decoding
        out = ["--beam", str(a.beam), "--lenpen", repr(a.lenpen), "--max-len-b", str(a.max_len_b)]
        if self.prune is not None:
            d, m, z = self.prune
            out = ["--decoding", decoding, *out, "--prune-abs-threshold", f"{d:g}", "--prune-max-cands", str(m),
                   "--finish-count", str(z)]
        else:
            out = ["--decoding", decoding if not DECODINGS[decoding].variable else "beam", *out]
        if self.weights is not None:
            out += ["--lmbr-lambda", f"{self.weights[1]:g}", "--lmbr-theta0", f"{self.weights[2]:g}",
                    "--lmbr-p", repr(a.lmbr_p), "--lmbr-r", repr(a.lmbr_r)]
        return out


@dataclass
class Outcome:
    bleu: float
    chrf: float
    expansions: int
    steps: int
    seconds: float


def cheapest_pruning(evaluate: Callable[[Prune], Tuple[bool, float]], deltas: Sequence[float], ms: Sequence[int],
                     zs: Sequence[int], start: Optional[Prune] = None) -> Optional[Prune]:
    """A cheap (delta, M, z) on the grids whose `evaluate` is (on target, cost), found with few
    decodes, assuming cost and quality grow with each value, as they do for beams that prune less:
    `start` first (when on the grids), then per M a bisection over delta (at the largest z), an M
    abandoned once a miss costs more than the best so far; then smaller z; then one-step-narrower
    neighbours until nothing cheaper is on target. It can miss a cheaper setting that trades a
    smaller z for a larger delta."""
    deltas, ms, zs = sorted(deltas), sorted(ms), sorted(zs)
    best: List = [None, math.inf]

    def consider(p: Prune) -> Tuple[bool, float]:
        ok, c = evaluate(p)
        if ok and c < best[1]:
            best[:] = [p, c]
        return ok, c

    if start is not None and start[0] in deltas and start[1] in ms and start[2] in zs:
        consider(start)

    for m in ms:
        lo, hi = 0, len(deltas)
        while lo < hi:
            mid = (lo + hi) // 2
            ok, c = consider((deltas[mid], m, zs[-1]))
            if ok:
                hi = mid
            elif c >= best[1]:
                break  # wider beams cost more still
            else:
                lo = mid + 1
    if best[0] is None:
        return None
    for z in zs:
        if z >= best[0][2] or consider((best[0][0], best[0][1], z))[0]:
            break
    moved = True
    while moved:
        centre = best[0]
        for grid, i in ((deltas, 0), (ms, 1), (zs, 2)):
            j = grid.index(centre[i])
            if j:
                trial = list(centre)
                trial[i] = grid[j - 1]
                consider(tuple(trial))  # type: ignore[arg-type]
        moved = best[0] != centre
    return best[0]


def best_weights(evaluate: Callable[[Weights], float], grids: Sequence[List[float]], mode: str,
                 start: Optional[Weights] = None, rounds: int = 3) -> Weights:
    """The LMBR (alpha, lambda, Theta0) on the grids with the highest `evaluate` (ties keep the
    earlier): the whole grid, or coordinate search from `start` (default: each grid's middle),
    one parameter at a time, until a round changes nothing."""
    if mode == "grid":
        trials = [(a, lam, t0) for a in grids[0] for lam in grids[1] for t0 in grids[2]]  # alpha outermost
        values = [evaluate(t) for t in trials]
        return trials[values.index(max(values))]
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


def pareto(points: List[Tuple[float, float]]) -> List[int]:
    """Indices of the (cost, BLEU) points that no cheaper-or-equal point matches in BLEU."""
    front, top = [], -math.inf
    for i in sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1])):
        if points[i][1] > top:
            front.append(i)
            top = points[i][1]
    return front


def gap_noise(hyps: List[str], base: List[str], refs: List[str], samples: int = 1000, seed: int = 0) -> float:
    """The paired-bootstrap standard deviation of corpus BLEU(hyps) - BLEU(base) over resampled
    sentences: the dev set's noise, against which a tolerance is meaningful."""
    import numpy as np
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    stats = [np.array([bleu._extract_corpus_statistics([h], [[r]])[0] for h, r in zip(x, refs)], dtype=np.int64)
             for x in (hyps, base)]
    idx = np.random.default_rng(seed).integers(0, len(refs), size=(samples, len(refs)))
    totals = [st[idx].sum(axis=1) for st in stats]
    gaps = [bleu._compute_score_from_stats(a.tolist()).score - bleu._compute_score_from_stats(b.tolist()).score
            for a, b in zip(*totals)]
    return float(np.std(gaps))


def _span(text: Optional[str], name: str) -> Optional[Tuple[int, int]]:
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise CalibrationError(f"{name} must be START:END (line numbers from 0, END excluded), got {text!r}") from None
    if not 0 <= a < b:
        raise CalibrationError(f"{name} {text}: needs 0 <= START < END")
    return a, b


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from .bench.data import add_input_args
    from .frontend import DefaultsHelp
    from .scorers.build_posteriors import add_evidence_args
    from .spec import OneLineParser

    p = OneLineParser(prog="streambeam-calibrate", description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsHelp)
    p.add_argument("--data", required=True, help="fairseq data-bin (or a directory with the dictionaries)")
    p.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    g = p.add_argument_group("dev set: a data-bin split, or raw source and reference")
    add_input_args(g, "valid")
    g.add_argument("--range", help="dev lines START:END of the split or files (default: all)")
    g.add_argument("--limit", type=int, default=0, help="an evenly spaced subset of about this many dev lines")
    g.add_argument("--test-range", help="held-out lines START:END: decode them with beam, the paper's and the "
                                        "chosen settings and report (heldout.md)")
    g.add_argument("--test-limit", type=int, default=0, help="an evenly spaced subset of the held-out lines")
    g = p.add_argument_group("decoding")
    g.add_argument("--decoding", default="var-stream", choices=["var-stream", "var-batch", "beam", "fixed-stream"],
                   help="var-*: calibrate pruning (and LMBR with --nbest); beam, fixed-stream: LMBR only")
    g.add_argument("--beam", type=int, default=5, help="k: the widest beam")
    g.add_argument("--batch-size", type=int, default=64, help="sources decoded together")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--lenpen", type=float, default=1.0)
    g.add_argument("--max-len-b", type=int, default=200)
    g = p.add_argument_group("objective and pruning grids")
    g.add_argument("--tolerance", type=float, default=0.1, help="BLEU below fixed beam's that is still on target")
    g.add_argument("--objective", choices=["expansions", "time"], default="expansions", help="the cost minimised")
    g.add_argument("--deltas", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0],
                   help="--prune-abs-threshold values")
    g.add_argument("--max-cands", type=int, nargs="+",
                   help="--prune-max-cands values (default: 2, 3, 5, 10 below k, and k)")
    g.add_argument("--finish-counts", type=int, nargs="+", help="--finish-count values (default: 1, k/2 and k)")
    add_evidence_args(p.add_argument_group("LMBR evidence (as build_posteriors, segmented as --src); without it "
                                           "LMBR is not tuned"), required=False, segmentation=False)
    g = p.add_argument_group("LMBR grids")
    g.add_argument("--alphas", type=float, nargs="+", default=[1.0], help="evidence score scales")
    g.add_argument("--lambdas", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="NMT weights")
    g.add_argument("--theta0s", type=float, nargs="+", default=[-1.0, -0.5, 0.0], help="per-word constants Theta0")
    g.add_argument("--lmbr-search", choices=["grid", "coordinate"], default="coordinate",
                   help="every alpha x lambda x theta0, or one weight at a time from --lmbr-start")
    g.add_argument("--lmbr-start", type=float, nargs=3, metavar=("ALPHA", "LAMBDA", "THETA0"),
                   help="coordinate search's start (default: each grid's middle)")
    g.add_argument("--rounds", type=int, default=3, help="coordinate search: at most this many rounds")
    g.add_argument("--lmbr-p", type=float, default=0.85)
    g.add_argument("--lmbr-r", type=float, default=0.72)
    p.add_argument("--threads", type=int, default=1, help="torch threads (set explicitly)")
    p.add_argument("--cpu", action="store_true", help="do not use CUDA even when present")
    p.add_argument("--out", default="calibrate-out", help="directory for the cache, tables, plot and best.*")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    k = a.beam
    a.max_cands = sorted(set(a.max_cands or [m for m in (2, 3, 5, 10) if m < k] + [k]))
    a.finish_counts = sorted(set(a.finish_counts or [1, max(1, k // 2), k]))
    return a


def check_args(a: argparse.Namespace) -> None:
    """Mistakes found before any model loads."""
    from .spec import model_files_problem
    from .textio import bpe_problem, file_problem

    if a.beam < 1:
        raise CalibrationError(f"--beam must be >= 1, got {a.beam}")
    for name, xs, ok, allowed in (
            ("--deltas", a.deltas, lambda x: x > 0, "> 0"), ("--max-cands", a.max_cands, lambda x: 1 <= x, ">= 1"),
            ("--finish-counts", a.finish_counts, lambda x: 1 <= x <= a.beam, f"from 1 to --beam {a.beam}"),
            ("--lambdas", a.lambdas, lambda x: x > 0, "> 0"), ("--alphas", a.alphas, lambda x: x >= 0, ">= 0")):
        bad = [x for x in xs if not ok(x)]
        if bad:
            raise CalibrationError(f"{name}: {bad[0]:g} is out of range (each must be {allowed})")
    if a.tolerance < 0:
        raise CalibrationError(f"--tolerance must be >= 0, got {a.tolerance:g}")
    starts = {} if not a.lmbr_start else dict(zip(("alpha", "lmbr_lambda", "lmbr_theta0"), a.lmbr_start))
    for theta0 in [*a.theta0s, starts.get("lmbr_theta0", 0.0)]:  # the settings' ranges, as every front end's
        DecodeSpec(decoding=a.decoding, beam_size=a.beam, len_penalty=a.lenpen, max_len_b=a.max_len_b,
                   lmbr_p=a.lmbr_p, lmbr_r=a.lmbr_r, lmbr_theta0=theta0, lmbr_lambda=starts.get("lmbr_lambda", 1.0),
                   lmbr_posteriors="-")
    if starts.get("alpha", 0.0) < 0:
        raise CalibrationError(f"--lmbr-start: alpha must be >= 0, got {starts['alpha']:g}")
    problem = count_problem(a, ("threads", "batch_size", "max_tokens", "rounds")) or count_problem(
        a, ("limit", "test_limit"), least=0)
    if problem:
        raise CalibrationError(problem)
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise CalibrationError(f"--out {a.out}: not a directory")
    if a.src and not a.ref:
        raise CalibrationError("--src needs --ref: calibration scores BLEU against a reference")
    problem = model_files_problem(a.data, (a.source_lang, a.target_lang), a.path)
    for name, path in (("--src", a.src), ("--ref", a.ref), *(("--nbest", f) for f in a.nbest or ())):
        problem = problem or (path and file_problem(name, path))
    if problem:
        raise CalibrationError(problem)
    problem = bpe_problem(a.bpe, a.bpe_codes, a.sentencepiece_model) if a.src else None
    if problem:
        raise CalibrationError(problem)
    if not DECODINGS[a.decoding].variable and not a.nbest:
        raise CalibrationError(f"--decoding {a.decoding} has no pruning to calibrate: give --nbest evidence to tune "
                               "LMBR, or use --decoding var-stream")
    dev, test = _span(a.range, "--range"), _span(a.test_range, "--test-range")
    if test and (dev is None or (test[0] < dev[1] and dev[0] < test[1])):
        raise CalibrationError(f"--test-range {a.test_range} overlaps the dev lines (--range {a.range or 'all'}): "
                               "held-out lines must be apart from them")


class Calibrator:
    """The loaded task, models and dev set; decodes a Setting once (cached in decodes.jsonl)."""

    def __init__(self, a: argparse.Namespace):
        import torch

        from .loader import load_models, load_task
        from .scorers.build_posteriors import EvidenceError, load_evidence
        from .task import batching_problem

        self.a = a
        self.out = Path(a.out)
        self.cuda = torch.cuda.is_available() and not a.cpu
        self.task = load_task(a.data, a.source_lang, a.target_lang)
        self.evidence = None
        if a.nbest:
            try:
                self.evidence, summary = load_evidence(a, self.task.target_dictionary)
            except EvidenceError as e:
                raise CalibrationError(str(e)) from None
            print(f"evidence: {summary}", flush=True)
        self.dev = self.test_set(a.range, a.limit)
        self.test = self.test_set(a.test_range, a.test_limit) if a.test_range else None
        self.models = load_models(self.task, a.path, self.cuda)
        for ts in (self.dev, self.test):  # the batching's own mistakes, before a folder is made
            problem = ts and a.max_tokens and batching_problem(ts.dataset, a.max_tokens, None, False)
            if problem:
                raise CalibrationError(problem)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cache_file = self.out / "decodes.jsonl"
        self.cache: Dict[str, dict] = {}
        if self.cache_file.exists():
            for line in self.cache_file.read_text().splitlines():
                rec = json.loads(line)
                self.cache[rec["key"]] = rec
        self.decoded = 0  # decodes run (not read from the cache)
        self._lines: Dict[int, tuple] = {}  # id(test set) -> (test set, hash of its lines)

    def test_set(self, span: Optional[str], limit: int):
        from .bench import data as bench_data

        a, lines = self.a, _span(span, "--range")
        try:
            if a.src:
                return bench_data.from_raw(self.task, a.src, a.ref, limit, a.tokenizer, a.bpe, a.bpe_codes,
                                           a.sentencepiece_model, lines)
            ts = bench_data.from_data_bin(self.task, a.gen_subset, limit, a.post_process, lines)
        except (FileNotFoundError, ValueError) as e:
            raise CalibrationError(str(e).splitlines()[0]) from None
        return ts

    def _fingerprint(self, ts) -> dict:
        """What, besides the setting, decides a decode's outcome: a cached one is reused only if equal."""
        a = self.a
        files = [*checkpoint_files(a.path), *(a.nbest or [])]  # a URL is keyed by its name (`path`)
        if id(ts) not in self._lines:  # hashed once per test set (kept alive beside its hash)
            text = json.dumps([[t.tolist() for t in ts.dataset.src], ts.refs])
            self._lines[id(ts)] = (ts, hashlib.sha1(text.encode()).hexdigest())
        return dict(lines=self._lines[id(ts)][1], path=a.path,
                    files=[(f, os.path.getsize(f), os.path.getmtime(f)) for f in files],
                    decoding=a.decoding, threads=a.threads if a.objective == "time" else None, beam=a.beam,
                    lenpen=a.lenpen, max_len_b=a.max_len_b, batch=[a.batch_size, a.max_tokens],
                    lmbr=[a.lmbr_p, a.lmbr_r, a.weights, a.n, a.format] + [getattr(a, k, None) for k in EVIDENCE_KEYS],
                    device="cuda" if self.cuda else "cpu")

    def _posteriors(self, ts, alpha: float, name: str) -> str:
        from .scorers.lmbr import write_posteriors

        # keyed by the fingerprint too: another --range, --limit or evidence file gets its own file
        path = self.out / "posteriors" / f"{name}.alpha={alpha:g}.{self._key(Setting(), ts)[:12]}.jsonl"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            post = self.evidence.posteriors(alpha)
            covered = {i: post[o] for i, o in enumerate(ts.orig_ids) if o in post}
            if not covered:  # evidence of another split: LMBR would tune on nothing
                raise CalibrationError(f"the --nbest evidence has none of the {name} set's {len(ts.orig_ids)} "
                                       f"sentence ids (it has {len(post)} others): was it made on another split?")
            if len(covered) < len(ts.orig_ids):
                print(f"LMBR: {len(ts.orig_ids) - len(covered)} of {len(ts.orig_ids)} {name} sentences have no "
                      "evidence and decode unscored", flush=True)
            write_posteriors(path, covered)
        return str(path)

    def _key(self, s: Setting, ts) -> str:
        """The cache key of decoding test set `ts` with setting `s`."""
        return hashlib.sha1(json.dumps([self._fingerprint(ts), asdict(s)], default=str).encode()).hexdigest()

    def decode(self, s: Setting, ts=None, name: str = "dev") -> Outcome:
        ts = ts or self.dev
        key = self._key(s, ts)
        if key not in self.cache:
            self.cache[key] = self._run(s, ts, name, key)
            with open(self.cache_file, "a") as f:
                f.write(json.dumps(self.cache[key]) + "\n")
        rec = self.cache[key]
        return Outcome(**{k: rec[k] for k in ("bleu", "chrf", "expansions", "steps", "seconds")})

    def hyps(self, s: Setting, ts=None) -> List[str]:
        return self.cache[self._key(s, ts or self.dev)]["hyps"]

    def _run(self, s: Setting, ts, name: str, key: str) -> dict:
        import sacrebleu
        from tqdm import tqdm

        from .bench.__main__ import DEFAULTS, run_variant
        from .bench.variants import Variant

        a = self.a
        w = s.weights
        settings = dict(DEFAULTS, beam=a.beam, batch_size=a.batch_size, max_tokens=a.max_tokens, lenpen=a.lenpen,
                        max_len_b=a.max_len_b, lmbr_lambda=w and w[1], lmbr_theta0=w and w[2], lmbr_p=a.lmbr_p,
                        lmbr_r=a.lmbr_r)
        decoding = "beam" if s.prune is None and DECODINGS[a.decoding].variable else a.decoding
        d, m, z = s.prune or (None, None, None)
        v = Variant(s.label, decoding, delta=d, max_cands=m, finish_count=z, lmbr=w is not None)
        post = self._posteriors(ts, w[0], name) if w else None
        with tqdm(total=len(ts.dataset), desc=s.label, disable=a.quiet, leave=False, file=sys.stderr) as bar:
            t0 = time.perf_counter()
            hyps, c = run_variant(self.task, self.models, v, settings, ts, bar, self.cuda, lmbr_file=post)
            dt = time.perf_counter() - t0
        text = [ts.decode(hyps[i]) for i in range(len(ts.dataset))]
        rec = dict(key=key, set=name, setting=asdict(s), label=s.label,
                   bleu=round(sacrebleu.corpus_bleu(text, [ts.refs]).score, 2),
                   chrf=round(sacrebleu.corpus_chrf(text, [ts.refs]).score, 2), expansions=c.expansions,
                   steps=c.decoder_steps, seconds=round(dt, 2), hyps=text)
        self.decoded += 1
        print(f"{name} {s.label:52s} BLEU {rec['bleu']:6.2f}  expansions {rec['expansions']:9d}  "
              f"steps {rec['steps']:6d}  {rec['seconds']:7.1f}s", flush=True)
        return rec


def calibrate(cal: Calibrator) -> Tuple[Setting, Optional[Setting], Dict[Setting, Outcome], List[str]]:
    """(fixed beam, the chosen setting or None when nothing reaches the target, every dev outcome,
    notes for the user). LMBR weights that score below no LMBR at the same pruning are dropped: the
    search goes on without them, and a note says so."""
    a = cal.a
    seen: Dict[Setting, Outcome] = {}
    notes: List[str] = []

    def run(s: Setting) -> Outcome:
        seen[s] = cal.decode(s)
        return seen[s]

    def cost(o: Outcome) -> float:
        return o.seconds if a.objective == "time" else o.expansions

    base = Setting()
    base_bleu = run(base).bleu

    def on_target(o: Outcome) -> bool:  # at BLEU's 2 decimals, so a gap of exactly --tolerance is on target
        return round(o.bleu - base_bleu, 2) >= -a.tolerance
    variable = DECODINGS[a.decoding].variable
    start = Setting((PAPER_DELTA, min(PAPER_M, a.beam), a.beam)) if variable else Setting()
    weights = None
    if cal.evidence is not None:
        grids = (a.alphas, a.lambdas, a.theta0s)
        weights = best_weights(lambda w: run(replace(start, weights=w)).bleu, grids, a.lmbr_search,
                               tuple(a.lmbr_start) if a.lmbr_start else None, a.rounds)
        best = replace(start, weights=weights)
        with_lmbr, without = seen[best].bleu, run(start).bleu
        if with_lmbr < without:
            notes.append(f"LMBR lowers dev BLEU at every weight tried: the best, {best.label}, scores "
                         f"{with_lmbr:.2f} against {without:.2f} without LMBR, so the choice is made without it")
            weights = None
        else:
            notes += grid_edges(weights, grids)
    if not variable:
        chosen = Setting(weights=weights)
        return base, chosen if on_target(seen[chosen]) else None, seen, notes
    run(start)  # the paper's settings, for the table (and the search's first candidate)

    def evaluate(p: Prune) -> Tuple[bool, float]:
        o = run(Setting(p, weights))
        return on_target(o), cost(o)

    prune = cheapest_pruning(evaluate, a.deltas, a.max_cands, a.finish_counts, start.prune)
    return base, None if prune is None else Setting(prune, weights), seen, notes


def grid_edges(weights: Weights, grids: Sequence[List[float]]) -> List[str]:
    """Notes for LMBR weights chosen at the end of a grid of several values: a wider grid may find better."""
    notes = []
    for name, value, grid in zip(("--alphas", "--lambdas", "--theta0s"), weights, grids):
        if len(set(grid)) > 1 and value in (min(grid), max(grid)) and not (name == "--alphas" and value == 0):
            end = "largest" if value == max(grid) else "smallest"  # (alpha 0 is the least there is)
            notes.append(f"{name}: the chosen {value:g} is the grid's {end}; a grid reaching past it may score higher")
    return notes


def markdown(rows: List[Tuple[Setting, Outcome]], base: Outcome, marks: Dict[Setting, str]) -> str:
    lines = ["| setting | BLEU | chrF | BLEU - beam | expansions | x beam | decoder steps | seconds | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s, o in rows:
        lines.append(f"| {s.label} | {o.bleu:.2f} | {o.chrf:.2f} | {o.bleu - base.bleu:+.2f} | {o.expansions} | "
                     f"{o.expansions / base.expansions:.2f} | {o.steps} | {o.seconds:.1f} | {marks.get(s, '')} |")
    return "\n".join(lines)


def plot(path: Path, rows: List[Tuple[Setting, Outcome]], front: List[int], target: float, xlabel: str,
         cost: Callable[[Outcome], float]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([cost(o) for _, o in rows], [o.bleu for _, o in rows], s=12, color="grey")
    f = [rows[i][1] for i in front]
    ax.plot([cost(o) for o in f], [o.bleu for o in f], marker="o", label="Pareto front")
    ax.axhline(target, linestyle="--", color="red", label="fixed beam - tolerance")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("dev BLEU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(cal: Calibrator, base: Setting, chosen: Optional[Setting], seen: Dict[Setting, Outcome],
                  notes: Sequence[str] = ()) -> str:
    a, out = cal.a, cal.out
    b = seen[base]
    target = b.bleu - a.tolerance

    def cost(o: Outcome) -> float:
        return o.seconds if a.objective == "time" else o.expansions

    rows = sorted(seen.items(), key=lambda r: cost(r[1]))
    front = pareto([(cost(o), o.bleu) for _, o in rows])
    marks = {s: "Pareto" for i, (s, _) in enumerate(rows) if i in front}
    marks[base] = "fixed beam"
    if chosen is not None:
        marks[chosen] = "**chosen**"
    table = markdown(rows, b, marks)
    noise = ""
    sd = None
    if chosen is not None and chosen.prune is not None:
        sd = gap_noise(cal.hyps(chosen), cal.hyps(base), cal.dev.refs)
        noise = (f" The chosen setting's BLEU gap to fixed beam has a paired-bootstrap sd of {sd:.2f} over "
                 f"the dev sentences" + ("; the tolerance is below it, so more dev sentences would choose more "
                                        "reliably." if a.tolerance < sd else "."))
    (out / "calibrate.md").write_text(f"Target: dev BLEU >= {target:.2f} (fixed beam {b.bleu:.2f} - {a.tolerance:g}); "
                                      f"cost: {a.objective}.{noise}\n\n{table}\n"
                                      + "".join(f"\nNote: {n}.\n" for n in notes))
    if noise:
        print(noise.strip(), flush=True)
    (out / "calibrate.json").write_text(json.dumps({
        "args": vars(a), "target": target, "chosen": asdict(chosen) if chosen else None, "gap_sd": sd, "notes": notes,
        "results": [dict(setting=asdict(s), **asdict(o), pareto=i in front) for i, (s, o) in enumerate(rows)],
    }, indent=1, default=str) + "\n")
    plot(out / "pareto.png", rows, front, target, a.objective, cost)
    if chosen is not None:
        opts = chosen.options(a)
        (out / "best.args").write_text(" ".join(opts) + "\n")
        (out / "best.hyp").write_text("".join(x + "\n" for x in cal.hyps(chosen)))
        (out / "best.json").write_text(json.dumps(bench_config(a, chosen, seen[chosen], len(cal.dev.dataset)),
                                                    indent=1) + "\n")
    return table


def bench_config(a: argparse.Namespace, s: Setting, o: Outcome, n_dev: int) -> dict:
    """The chosen setting as a config for `python -m fairseq_streambeam.bench --config`; its comment
    names the `n_dev` dev lines it was chosen on."""
    v: dict = {"name": "calibrated", "decoding": a.decoding if s.prune else ("beam" if DECODINGS[a.decoding].variable
                                                                           else a.decoding)}
    if s.prune:
        v.update(delta=s.prune[0], max_cands=s.prune[1], finish_count=s.prune[2])
    config: dict = {"_comment": f"calibrated on {a.src or a.data + ':' + a.gen_subset} ({a.range or 'all lines'}: "
                                f"{n_dev} lines), dev BLEU {o.bleu:.2f}",
                    "beam": a.beam, "lenpen": a.lenpen, "max_len_b": a.max_len_b, "batch_size": a.batch_size,
                    "max_tokens": a.max_tokens, "baseline": "beam", "exact_ref": "beam", "variants": ["beam", v]}
    if s.weights:
        v["lmbr"] = True
        config.update(_lmbr_alpha=s.weights[0], lmbr_lambda=s.weights[1], lmbr_theta0=s.weights[2], lmbr_p=a.lmbr_p,
                      lmbr_r=a.lmbr_r)
    return config


def heldout(cal: Calibrator, chosen: Setting) -> str:
    """Fixed beam, the paper's settings and the chosen ones on the held-out lines."""
    a = cal.a
    rows = [Setting()]
    if DECODINGS[a.decoding].variable:
        rows.append(Setting((PAPER_DELTA, min(PAPER_M, a.beam), a.beam)))
    rows.append(chosen)
    res = [(s, cal.decode(s, cal.test, "test")) for s in dict.fromkeys(rows)]
    table = markdown(res, res[0][1], {chosen: "chosen"})
    (cal.out / "heldout.md").write_text(f"Held-out lines {a.test_range} ({len(cal.test.dataset)} sentences).\n\n"
                                        f"{table}\n")
    return table


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    malloc.retain_freed_memory()
    fairseq_log_level()
    t0 = time.perf_counter()
    for name in ("fairseq", "fairseq_streambeam"):  # one line per decode is printed instead
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        check_args(a)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
        import torch

        torch.set_num_threads(a.threads)
        print(f"threads: torch={torch.get_num_threads()} (set explicitly)", flush=True)
        cal = Calibrator(a)
        print(f"dev: {len(cal.dev.dataset)} sentences; decodes in the cache: {len(cal.cache)}", flush=True)
        base, chosen, seen, notes = calibrate(cal)
    except (CalibrationError, UsageError) as e:  # UsageError: the decoding's, e.g. --max-tokens below a line
        print(f"streambeam-calibrate: error: {e}", file=sys.stderr)
        return 2
    table = write_outputs(cal, base, chosen, seen, notes)
    print("\n" + table)
    minutes = (time.perf_counter() - t0) / 60
    for note in notes:
        print(f"note: {note}", flush=True)
    if chosen is None:
        best = max(seen, key=lambda s: (s != base, seen[s].bleu))  # the best but fixed beam (when there is one)
        print(f"streambeam-calibrate: error: no setting on the grids reaches fixed beam's dev BLEU "
              f"{seen[base].bleu:.2f} - {a.tolerance:g} (the best, {best.label}: {seen[best].bleu:.2f}); widen "
              f"--deltas/--max-cands{'/--lambdas' if cal.evidence is not None else ''} or raise --tolerance",
              file=sys.stderr)
        return 1
    print(f"\nchosen: {chosen.label} (dev BLEU {seen[chosen].bleu:.2f}, {seen[chosen].expansions} expansions against "
          f"fixed beam's {seen[base].expansions}); {cal.decoded} dev decodes, {minutes:.1f} min. Options: "
          f"{a.out}/best.args" + (f"; build the test posteriors with --alpha {chosen.weights[0]:g}"
                                  if chosen.weights else ""), flush=True)
    if cal.test is not None:
        print("\n" + heldout(cal, chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
