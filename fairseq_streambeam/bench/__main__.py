"""Benchmark: decode one test set with several methods side by side in ONE process.

Methods run interleaved over repeats (A B C A B C ...) so machine noise hits all alike; ours and
fairseq's go through the same task API as fairseq-generate (batching, windows, the generator).
Writes a Markdown table (paper Table 1 shape), JSON and PNG plots to --out (docs/benchmarks.md).
"""

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from fairseq import utils
from tqdm import tqdm

from .. import malloc
from ..frontend import fairseq_log_level
from ..spec import DECODINGS, DecodeSpec, OneLineParser, UsageError, check_files, model_files_problem
from ..textio import file_problem
from .data import CorpusOrder, Head, add_input_args, from_data_bin, from_raw
from .memory import PeakMemory
from .report import PLOTS, markdown_table, write_plots
from .variants import BUILTIN, Variant, load_config, parse_methods

DEFAULTS = dict(beam=5, batch_size=64, max_tokens=None, lenpen=1.0, max_len_b=200, refill_eps=1 / 6,
                stream_window=32, repeats=1, threads=1, limit=0, finalize="auto", finish_count=None,
                methods="fairseq,beam,var-batch,var-stream", baseline="fairseq", exact_ref="beam", drafter=None,
                draft_lookup=None, corpus_order=False, lmbr_lambda=None, lmbr_theta0=None, lmbr_p=0.85, lmbr_r=0.72,
                fp16=False)

PROG = "python -m fairseq_streambeam.bench"


def parse_args(argv=None):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="fairseq data-bin (or a directory with the dictionaries)")
    p.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    add_input_args(p, "test")
    p.add_argument("--config", help="JSON with settings and variants (see configs/)")
    p.add_argument("--methods", help=f"comma-separated built-ins: {','.join(BUILTIN)} (default {DEFAULTS['methods']})")
    p.add_argument("--baseline", help="method the time ratios are relative to (default fairseq)")
    p.add_argument("--exact-ref", help="method whose outputs define 'identical' (default beam)")
    p.add_argument("--beam", type=int)
    p.add_argument("--lenpen", type=float)
    p.add_argument("--max-len-b", type=int)
    p.add_argument("--batch-size", type=int, help="sentences decoded together (the paper's n; default 64)")
    p.add_argument("--max-tokens", type=int, help="source-token budget instead of / besides --batch-size")
    p.add_argument("--stream-window", type=int)
    p.add_argument("--refill-eps", type=float)
    p.add_argument("--finalize", choices=["auto", "fairseq", "sticky"])
    p.add_argument("--finish-count", type=int,
                   help="sticky-rule methods: finished hypotheses that end a source (default: the beam size k, "
                        "as in Yang et al.'s runs); a variant's own finish_count wins")
    p.add_argument("--corpus-order", action="store_const", const=True,
                   help="batch sentences in corpus order (fairseq methods; default: fairseq's length-sorted batches)")
    p.add_argument("--limit", type=int, help="decode an evenly spaced subset of about this many sentences")
    p.add_argument("--repeats", type=int)
    p.add_argument("--threads", type=int, help="torch/OMP threads, set explicitly (default 1): oversubscribed "
                                               "threads can make fairseq many times slower")
    p.add_argument("--lmbr-posteriors", help="posteriors by test-set sentence id, for the *+lmbr methods")
    p.add_argument("--lmbr-lambda", type=float, help="LMBR settings (also config keys, e.g. bench.tune's best.json)")
    p.add_argument("--lmbr-theta0", type=float)
    p.add_argument("--lmbr-p", type=float)
    p.add_argument("--lmbr-r", type=float)
    p.add_argument("--drafter", help="block_drafter checkpoint for the gad methods (scripts/train_drafter.sh)")
    p.add_argument("--draft-lookup", help="target-side text for the gad-lookup method's n-gram table (see "
                                          "--draft-lookup of fairseq-generate)")
    p.add_argument("--fp16", action="store_const", const=True,
                   help="half-precision models (model.half(), as fairseq-generate --fp16); ct2 computes in "
                        "float16 on CUDA")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where models and batches go (auto: CUDA when torch sees a GPU)")
    p.add_argument("--out", default="bench-out", help="directory for results.json, results.md and plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no list of the files written")
    return p.parse_args(argv)


def resolve(args):
    """Settings: command line over config file over DEFAULTS; variants likewise."""
    try:
        config, variants = load_config(args.config) if args.config else ({}, [])
    except OSError as e:
        raise UsageError(f"--config {args.config}: {e.strerror}") from None
    except ValueError as e:  # not JSON, or a variant that does not exist
        raise UsageError(f"--config {args.config}: {e}") from None
    settings = {}
    for key, default in DEFAULTS.items():
        cli = getattr(args, key, None)
        settings[key] = cli if cli is not None else config.get(key, default)
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise UsageError(f"{args.config}: unknown settings {sorted(unknown)}")
    if args.methods or not variants:
        try:
            variants = parse_methods(settings["methods"])
        except ValueError as e:
            raise UsageError(f"--methods: {e}") from None
    names = [v.name for v in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a method's name keys its generator and its row
        raise UsageError(f"methods named more than once: {', '.join(twice)} (give each variant its own name)")
    for key in ("baseline", "exact_ref"):  # given, not the default: a method this run has, or its column is empty
        given = getattr(args, key, None) if getattr(args, key, None) is not None else config.get(key)
        if given is not None and given not in names:
            raise UsageError(f"--{key.replace('_', '-')} {given}: not one of the methods run ({', '.join(names)})")
    return settings, variants


def _usage_problem(args, settings: dict, variants) -> Optional[str]:
    """The first mistake in the options that can be found before anything loads (None: none)."""
    for name, least in (("threads", 1), ("repeats", 1), ("limit", 0)):
        if settings[name] < least:
            return f"--{name} must be >= {least}, got {settings[name]}"
    if any(v.decoding == "gad" and not v.lookup for v in variants) and not settings["drafter"]:
        return "the gad methods need --drafter (a block_drafter checkpoint; scripts/train_drafter.sh)"
    if any(v.lookup for v in variants) and not settings["draft_lookup"]:
        return "the gad-lookup methods need --draft-lookup (target-side text for the n-gram table)"
    if any(v.lmbr for v in variants) and not args.lmbr_posteriors:
        return "the *+lmbr methods need --lmbr-posteriors"
    if settings["corpus_order"] and any(v.decoding == "ct2" and not (v.batch_size or settings["batch_size"])
                                        for v in variants):
        return "--corpus-order with ct2 needs --batch-size"
    if args.src and not args.ref:
        return "--src needs --ref"
    for flag_, path in (("--lmbr-posteriors", args.lmbr_posteriors), ("--src", args.src), ("--ref", args.ref)):
        problem = file_problem(flag_, path) if path else None
        if problem:
            return problem
    for v in variants:  # each variant's spec: the ranges, combinations and files every front end checks
        if v.decoding != "ct2":
            try:
                check_files(variant_spec(v, settings, args.lmbr_posteriors if v.lmbr else None))
            except UsageError as e:
                return f"{e} (method {v.name})"
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out}: not a directory"
    return model_files_problem(args.data, (args.source_lang, args.target_lang), args.path)


def main(argv=None):
    args = parse_args(argv)
    settings, variants = resolve(args)
    problem = _usage_problem(args, settings, variants)
    if problem:
        raise UsageError(problem)
    threads = settings["threads"]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    kept = malloc.retain_freed_memory()  # as the streambeam-* commands do, for every method alike
    fairseq_log_level()
    import sacrebleu

    from fairseq_streambeam.loader import load_models, load_task, wants_cuda

    use_cuda = wants_cuda(args.device)
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create it ({e.strerror})") from None
    blocked = [name for name in ("results.json", "results.md") if (out_dir / name).is_dir()]
    if blocked:  # found now, not after every method has run
        raise UsageError(f"--out {args.out}: {blocked[0]} there is a directory")
    machine = (f"threads: torch={torch.get_num_threads()} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} "
               f"(set explicitly) | malloc: {'freed memory kept' if kept else 'unchanged'} | "
               f"{platform.machine()} | torch {torch.__version__} | "
               f"{'cuda' if use_cuda else 'cpu'}{' | fp16' if settings['fp16'] else ''}")
    print(machine, flush=True)

    task = load_task(args.data, args.source_lang, args.target_lang)
    models = load_models(task, args.path, use_cuda, settings["fp16"])
    if args.src:
        ts = from_raw(task, args.src, args.ref, settings["limit"], args.tokenizer, args.bpe, args.bpe_codes,
                      args.sentencepiece_model)
    else:
        try:
            ts = from_data_bin(task, args.gen_subset, settings["limit"], args.post_process)
        except FileNotFoundError as e:  # fairseq: "Dataset not found: SPLIT (DIR)"
            raise UsageError(f"--gen-subset {args.gen_subset}: {e}") from None
    n = len(ts.dataset)
    order = "corpus order" if settings["corpus_order"] else "length-sorted"
    z = settings["finish_count"] or "k"
    batch = " and ".join(f"{settings[k]} {what}" for k, what in (("batch_size", "sentences"), ("max_tokens", "tokens"))
                         if settings[k]) or "no limit"
    print(f"{n} sentences, {len(models)} model(s), beam {settings['beam']}, batches of {batch} "
          f"({order}), sticky finish count {z}, {settings['repeats']} repeat(s): "
          f"{', '.join(v.name for v in variants)}", flush=True)

    lmbr_file = _subset_posteriors(args, variants, ts, out_dir)
    if lmbr_file:
        task.lmbr_posteriors(lmbr_file)  # parsed once, before the timed repeats (the task keeps them)
    ct2 = _ct2_translator(args, variants, threads, use_cuda, settings["fp16"])
    oracle = _greedy_truth(task, models, variants, settings, ts, use_cuda)

    gens: dict = {}  # one generator per method, for its warm-up and every repeat

    def decode(v: Variant, bar, first_batch: bool = False):  # one pass: hypotheses by sentence, counters
        if v.decoding == "ct2":
            return _run_ct2(ct2, v, settings, ts, task.target_dictionary, bar, first_batch)
        return run_variant(task, models, v, settings, ts, bar, use_cuda, oracle, lmbr_file, first_batch, gens)

    runs = {v.name: {"times": [], "hyps": None, "counters": None, "peak": 0.0, "warmup": 0.0} for v in variants}
    for v in variants:  # untimed: the first batch, where first calls, drafters' tables and compiling cost
        t0 = time.perf_counter()
        decode(v, tqdm(disable=True), first_batch=True)
        runs[v.name]["warmup"] = time.perf_counter() - t0
    for rep in range(settings["repeats"]):
        for v in variants:
            bar = tqdm(total=n, desc=f"{rep + 1}/{settings['repeats']} {v.name}", disable=args.quiet,
                       leave=False, file=sys.stderr)
            with PeakMemory(use_cuda) as mem:
                t0 = time.perf_counter()
                hyps, counters = decode(v, bar)
                dt = time.perf_counter() - t0
            bar.close()
            r = runs[v.name]
            r["times"].append(dt)
            r["hyps"], r["counters"] = hyps, counters
            r["peak"] = max(r["peak"], mem.peak_mb)
            print(f"  repeat {rep + 1}/{settings['repeats']} {v.name:24s} {dt:9.2f}s", flush=True)

    rows, traces = [], {}
    base = runs.get(settings["baseline"])
    base_t = statistics.median(base["times"]) if base else None
    exact = runs.get(settings["exact_ref"], {}).get("hyps")
    refs = [ts.refs]
    for v in variants:
        r = runs[v.name]
        hyp_txt = [ts.decode(r["hyps"][i]) for i in range(n)]
        c = r["counters"]
        median = statistics.median(r["times"])
        rows.append({
            "method": v.name, "variant": v.as_dict(),
            "bleu": round(sacrebleu.corpus_bleu(hyp_txt, refs).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(hyp_txt, refs).score, 2),
            "seconds_mean": round(statistics.mean(r["times"]), 3),
            "seconds_std": round(statistics.stdev(r["times"]), 3) if len(r["times"]) > 1 else None,
            "seconds_median": round(median, 3),
            "seconds": [round(t, 3) for t in r["times"]],  # each repeat
            "warmup_seconds": round(r["warmup"], 3),  # the untimed first batch (compiling, tables, first calls)
            "ratio_to_baseline": round(median / base_t, 3) if base_t else None,
            "decoder_steps": c.decoder_steps if c else None,
            "expansions": c.expansions if c else None,
            "expansions_per_step": round(c.expansions_per_step, 2) if c else None,
            "padding_share": (round(c.padding_share, 3)
                              if c and (c.padded_positions or c.verified_rows) else None),
            "accepted_per_pass": round(c.accepted_per_pass, 2) if c and c.accepted_tokens else None,
            # counters of the last repeat
            "model_seconds": round(c.model_seconds, 3) if c else None,
            "draft_seconds": round(c.draft_seconds, 3) if c and c.verified_rows else None,
            "peak_mb": r["peak"],
            "sentences_per_second": round(n / median, 2),
            "identical_to_exact_ref": round(sum(r["hyps"][i] == exact[i] for i in range(n)) / n, 4) if exact else None,
        })
        if c is not None and c.trace:
            traces[v.name] = c.trace
    table = markdown_table(rows)
    print("\n" + table)
    meta = {"settings": settings, "sentences": n, "threads": threads, "malloc_kept": kept,
            "device": "cuda" if use_cuda else "cpu", "torch": torch.__version__,
            "data": args.src or f"{args.data}:{args.gen_subset}", "path": args.path}
    (out_dir / "results.json").write_text(json.dumps({**meta, "rows": rows, "step_traces": traces}, indent=1))
    setting = (f"{n} sentences of {meta['data']}, model {args.path}, k = {settings['beam']}, batches of {batch}, "
               f"repeats: {settings['repeats']}, fairseq-streambeam {importlib.metadata.version('fairseq-streambeam')}")
    (out_dir / "results.md").write_text(f"{setting}\n\n{machine}\n\n{table}\n")  # the table's setting first
    if not args.no_plots:
        for p in write_plots(out_dir, rows, traces):
            if not args.quiet:
                print(f"wrote {p}")
    else:  # a reused --out keeps no plots of another run beside these results
        for name in PLOTS:
            (out_dir / name).unlink(missing_ok=True)
    if not args.quiet:
        print(f"wrote {out_dir / 'results.json'} and {out_dir / 'results.md'}")
    return rows


def _subset_posteriors(args, variants, ts, out_dir: Path):
    """Posteriors keyed by the benchmark's dataset index (a --limit subset renumbers sentences)."""
    if not any(v.lmbr for v in variants):
        return None
    from fairseq_streambeam.scorers.lmbr import load_posteriors, write_posteriors

    post = load_posteriors(args.lmbr_posteriors)
    missing = sum(orig not in post for orig in ts.orig_ids)
    if missing == len(ts.orig_ids):
        raise UsageError(f"--lmbr-posteriors {args.lmbr_posteriors}: no record for any of the benchmark's sentences")
    if missing:
        print(f"lmbr: {missing} of {len(ts.orig_ids)} sentences have no posteriors (scored with lambda, Theta0 only)")
    path = out_dir / "lmbr_posteriors.subset.jsonl"
    write_posteriors(path, {i: post[orig] for i, orig in enumerate(ts.orig_ids) if orig in post})
    return str(path)


def _greedy_truth(task, models, variants, settings: dict, ts, use_cuda: bool):
    """For gad-oracle: greedy outputs keyed by source tokens, decoded once before timing starts."""
    if not any(v.decoding == "gad-oracle" for v in variants):
        return None
    hyps, _ = run_variant(task, models, Variant("greedy", "greedy", beam=1), settings, ts, tqdm(disable=True), use_cuda)
    return {tuple(ts.dataset.src[i].tolist()): hyps[i] for i in range(len(ts.dataset))}


# bench methods that run a task decoding with something replaced (the aggressive ones: the drafter)
TASK_DECODING = {"fairseq-greedy": "fairseq", "gad-oracle": "iad", "no-draft": "iad"}


def variant_spec(v: Variant, settings: dict, lmbr_file: Optional[str] = None) -> DecodeSpec:
    """The decoding spec of a bench variant: the variant's fields over the run's settings, only
    the options its decoding takes."""
    decoding = TASK_DECODING.get(v.decoding, v.decoding)
    kind = DECODINGS[decoding]
    if kind.family == "fairseq":
        return DecodeSpec(decoding=decoding)
    f: Dict[str, Any] = dict(decoding=decoding, beam_size=v.beam or settings["beam"], len_penalty=settings["lenpen"],
                             max_len_b=settings["max_len_b"], compile=v.compile)
    if kind.streaming:
        f.update(refill_eps=v.refill_eps if v.refill_eps is not None else settings["refill_eps"],
                 stream_window=settings["stream_window"], stream_candidates=v.candidates)
    if kind.family == "draft":
        f.update(block_size=v.block_size or 0, draft_min_reach=v.draft_min_reach)
        if decoding == "gad":
            f.update(gad_beta=v.gad_beta or 1, gad_tau=math.inf if v.gad_tau is None else v.gad_tau,
                     draft_switch=v.draft_switch is not False, drafter=None if v.lookup else settings["drafter"],
                     draft_lookup=settings["draft_lookup"] if v.lookup else None)
        return DecodeSpec(**f)
    if kind.variable:
        f.update(prune_abs_threshold=v.delta, prune_max_cands=v.max_cands)
    if kind.streaming:
        f.update(stream_order=v.stream_order or "min-length", stream_admit=v.stream_admit or "shortest-first")
    f["finalize"] = v.finalize or settings["finalize"]
    # None = k; a run-wide setting applies to the sticky-rule methods only (the fairseq rule finishes k)
    sticky = DecodeSpec(**f).rule == "sticky"
    f["finish_count"] = v.finish_count if v.finish_count is not None else (settings["finish_count"] if sticky else None)
    if v.lmbr:
        f.update(lmbr_posteriors=lmbr_file, **{k: settings[k] for k in ("lmbr_lambda", "lmbr_theta0", "lmbr_p",
                                                                        "lmbr_r")})
    return DecodeSpec(**f)


def run_variant(task, models, v: Variant, settings: dict, ts, bar, use_cuda: bool, oracle=None, lmbr_file=None,
                first_batch: bool = False, gens: Optional[dict] = None):
    """One pass of variant `v` over the test set (`first_batch`: its first batch only) through the
    task API, as fairseq-generate drives it (generator, batching, inference steps). Returns
    hypotheses by sentence and the pass's counters. `gens`: generators by method, kept across
    passes as fairseq-generate keeps one for its run (--compile's captured graphs live in it)."""
    from fairseq.tasks.translation import TranslationTask

    from fairseq_streambeam.drafters.oracle import OracleDrafter

    spec = variant_spec(v, settings, lmbr_file)
    gen = gens.get(v.name) if gens is not None else None
    # the task batches by its spec (streaming windows, the candidate budget): this variant's on
    # every pass, not that of the last generator built (generators are kept across passes)
    task.spec = spec
    if gen is None and spec.decoding == "fairseq":
        args = argparse.Namespace(beam=v.beam or settings["beam"], lenpen=settings["lenpen"], max_len_a=0,
                                  max_len_b=settings["max_len_b"], min_len=1, unkpen=0, temperature=1.0, nbest=1,
                                  unnormalized=False)
        gen = TranslationTask.build_generator(task, models, args)
    elif gen is None:
        drafter = None  # an oracle that knows no output drafts nothing (no-draft)
        if v.decoding in ("gad-oracle", "no-draft"):
            drafter = OracleDrafter(oracle if v.decoding == "gad-oracle" else defaultdict(list), v.block_size or 8)
        gen = task.generator_for(models, spec, drafter=drafter, report_at_exit=False)  # the table reports them
    if gens is not None:
        gens[v.name] = gen
    dataset = CorpusOrder(ts.dataset) if settings["corpus_order"] else ts.dataset
    batch_size = v.batch_size or settings["batch_size"]
    if first_batch:
        dataset = Head(dataset, batch_size or 64)
    itr = task.get_batch_iterator(dataset, max_sentences=batch_size,
                                  max_tokens=settings["max_tokens"],
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    counters = getattr(gen, "counters", None)
    if counters is not None:
        counters.trace = []
        before = dataclasses.replace(counters)
    hyps = {}
    for sample in itr:
        if use_cuda:
            sample = utils.move_to_cuda(sample)
        out = task.inference_step(gen, models, sample)
        for i, sid in enumerate(sample["id"].tolist()):
            hyps[sid] = out[i][0]["tokens"].tolist()
        bar.update(len(out))
    if use_cuda:
        torch.cuda.synchronize()
    if counters is not None:  # this pass's share of the generator's running totals
        names = [f.name for f in dataclasses.fields(counters) if f.init]
        trace, counters = counters.trace, dataclasses.replace(
            counters, **{k: getattr(counters, k) - getattr(before, k) for k in names})
        counters.trace = trace
    return hyps, counters


def _ct2_translator(args, variants, threads, use_cuda: bool, fp16: bool = False):
    """Convert the (first) checkpoint with CTranslate2's fairseq converter when ct2 is asked for."""
    if not any(v.decoding == "ct2" for v in variants):
        return None
    try:
        import ctranslate2
        from ctranslate2.converters import FairseqConverter
    except ImportError as e:
        raise UsageError("method ct2 needs `pip install ctranslate2`") from e
    paths = args.path.split(":")
    if len(paths) > 1:
        print("ct2: CTranslate2 converts one checkpoint; using the first of the ensemble", flush=True)
    out = Path(args.out) / "ct2-model"
    FairseqConverter(paths[0], args.data, source_lang=args.source_lang, target_lang=args.target_lang).convert(
        str(out), force=True)
    device = "cuda" if use_cuda else "cpu"
    half = fp16 and use_cuda  # CTranslate2 has no float16 on a CPU: it refuses the compute type there
    if fp16 and not half:
        print("ct2: float32 (CTranslate2 computes float16 on CUDA only)", flush=True)
    return ctranslate2.Translator(str(out), device=device, inter_threads=1, intra_threads=threads,
                                  compute_type="float16" if half else "default")


def _run_ct2(translator, v: Variant, settings: dict, ts, tgt_dict, bar, first_batch: bool = False):
    """Same beam, threads and fp32; min_decoding_length=1 as fairseq's --min-len 1 (no empty
    output). In corpus order each call gets one batch of consecutive sentences (CTranslate2 may sort
    within it); `first_batch`: one batch's worth of sentences only."""
    bs = v.batch_size or settings["batch_size"]
    budget = dict(max_batch_size=bs, batch_type="examples") if bs else dict(
        max_batch_size=settings["max_tokens"], batch_type="tokens")
    src = ts.src_symbols[:bs or 16] if first_batch else ts.src_symbols
    step = bs if settings["corpus_order"] else max(1, len(src))
    res = []
    for a in range(0, len(src), step):
        res += translator.translate_batch(src[a:a + step], beam_size=v.beam or settings["beam"], **budget,
                                          length_penalty=settings["lenpen"], max_decoding_length=settings["max_len_b"],
                                          min_decoding_length=1)
    hyps = {i: [tgt_dict.index(tok) for tok in r.hypotheses[0]] + [tgt_dict.eos()] for i, r in enumerate(res)}
    bar.update(len(hyps))
    return hyps, None


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:  # a mistake in the options (most found before any model loads)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
