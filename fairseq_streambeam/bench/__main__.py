"""Benchmark: decode one test set with several methods side by side in ONE process.

Methods run interleaved over repeats (A B C A B C ...) so machine noise hits all alike; each goes
through the same task API as fairseq-generate (batching, windows, build_generator). Prints a
Markdown table and writes JSON. Example (../shared models):

  python -m fairseq_streambeam.bench --data ../shared/models/deen-tiny/data-bin \
      --path ../shared/models/deen-tiny/checkpoint_best.pt -s de -t en --beam 5 --limit 500
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

METHODS = ("fairseq", "beam", "var-batch", "var-stream", "fixed-stream", "greedy")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_streambeam.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="fairseq data-bin directory")
    p.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    p.add_argument("--gen-subset", default="test")
    p.add_argument("--methods", default="fairseq,beam,var-batch,var-stream",
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--baseline", default="fairseq", help="method the time ratios are relative to")
    p.add_argument("--exact-ref", default="beam", help="method whose outputs define 'identical'")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--lenpen", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together (the paper's n)")
    p.add_argument("--stream-window", type=int, default=32)
    p.add_argument("--prune-abs-threshold", type=float, default=None)
    p.add_argument("--prune-max-cands", type=int, default=None)
    p.add_argument("--refill-eps", type=float, default=1 / 6)
    p.add_argument("--finalize", default="auto", choices=["auto", "fairseq", "sticky"],
                   help="finalization rule for our methods (auto: sticky for var-*)")
    p.add_argument("--limit", type=int, default=0, help="decode every k-th sentence so that about this many "
                                                       "remain (0 = all)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads (set explicitly: oversubscribed "
                                                         "threads made fairseq 60x slower here)")
    p.add_argument("--post-process", default="sentencepiece")
    p.add_argument("--json", default=None, help="write results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    import sacrebleu
    from fairseq import checkpoint_utils, utils
    from fairseq.data import LanguagePairDataset

    import fairseq_streambeam  # noqa: F401
    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.task import StreamBeamTranslationTask

    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            sys.exit(f"unknown method {m!r}; choose from {METHODS}")
    print(f"threads: torch={torch.get_num_threads()} OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} "
          f"| {platform.processor() or platform.machine()} | torch {torch.__version__}", flush=True)

    # the three fields fairseq fills from its dataset config by interpolation
    cfg = StreamBeamConfig(data=args.data, source_lang=args.source_lang, target_lang=args.target_lang,
                           train_subset="train", dataset_impl=None, required_seq_len_multiple=1)
    task = StreamBeamTranslationTask.setup_task(cfg)
    models, _ = checkpoint_utils.load_model_ensemble(utils.split_paths(args.path), task=task)
    for m in models:
        m.eval()
    task.load_dataset(args.gen_subset)
    dataset = task.dataset(args.gen_subset)
    if args.limit and args.limit < len(dataset):
        keep = list(range(0, len(dataset), len(dataset) // args.limit))[: args.limit]
        src = [dataset.src[i] for i in keep]
        tgt_items = [dataset.tgt[i] for i in keep]
        dataset = LanguagePairDataset(src, [len(x) for x in src], task.source_dictionary, tgt_items,
                                      [len(x) for x in tgt_items], task.target_dictionary)
    tgt = task.target_dictionary
    refs = {i: tgt.string(dataset[i]["target"], args.post_process) for i in range(len(dataset))}
    print(f"{len(dataset)} sentences from {args.data} ({args.gen_subset}), beam {args.beam}, "
          f"batch {args.batch_size}", flush=True)

    gen_args = argparse.Namespace(beam=args.beam, lenpen=args.lenpen, max_len_a=0, max_len_b=200, min_len=1,
                                  unkpen=0, temperature=1.0, nbest=1, unnormalized=False)
    results = {m: {"times": [], "hyps": None, "counters": None} for m in methods}
    for rep in range(args.repeats):
        for m in methods:
            task.cfg.decoding = "greedy" if m == "greedy" else m
            task.cfg.prune_abs_threshold = args.prune_abs_threshold if m.startswith("var-") else None
            task.cfg.prune_max_cands = args.prune_max_cands if m.startswith("var-") else None
            task.cfg.refill_eps = args.refill_eps
            task.cfg.finalize = args.finalize
            task.cfg.stream_window = args.stream_window
            g_args = argparse.Namespace(**vars(gen_args))
            itr = task.get_batch_iterator(dataset, max_sentences=args.batch_size,
                                          disable_iterator_cache=True).next_epoch_itr(shuffle=False)
            gen = task.build_generator(models, g_args)
            hyps = {}
            t0 = time.perf_counter()
            for sample in itr:
                out = task.inference_step(gen, models, sample)
                for i, sid in enumerate(sample["id"].tolist()):
                    hyps[sid] = out[i][0]["tokens"].tolist()
            dt = time.perf_counter() - t0
            results[m]["times"].append(dt)
            results[m]["hyps"] = hyps
            results[m]["counters"] = gen.counters.as_dict() if hasattr(gen, "counters") else None
            print(f"  repeat {rep + 1}/{args.repeats} {m:13s} {dt:8.2f}s", flush=True)

    base = statistics.median(results[args.baseline]["times"]) if args.baseline in results else None
    exact = results.get(args.exact_ref, {}).get("hyps")
    rows = []
    ids = sorted(refs)
    for m in methods:
        r = results[m]
        hyp_txt = [tgt.string(torch.tensor(r["hyps"][i]), args.post_process) for i in ids]
        bleu = sacrebleu.corpus_bleu(hyp_txt, [[refs[i] for i in ids]])
        chrf = sacrebleu.corpus_chrf(hyp_txt, [[refs[i] for i in ids]])
        med = statistics.median(r["times"])
        c = r["counters"] or {}
        rows.append({
            "method": m, "bleu": round(bleu.score, 2), "chrf": round(chrf.score, 2), "seconds_median": round(med, 3),
            "seconds_spread": round(max(r["times"]) - min(r["times"]), 3),
            "ratio_to_baseline": round(med / base, 3) if base else None,
            "decoder_steps": c.get("decoder_steps"), "expansions": c.get("expansions"),
            "expansions_per_step": c.get("expansions_per_step"),
            "model_seconds": round(c["model_seconds"], 3) if c else None,
            "sentences_per_second": round(len(ids) / med, 2),
            "identical_to_exact_ref": (round(sum(r["hyps"][i] == exact[i] for i in ids) / len(ids), 4)
                                       if exact else None),
        })
    head = ("| method | BLEU | chrF | time (s) | x baseline | steps | expansions | exp/step | model s | sent/s "
            "| identical |")
    print()
    print(head)
    print("|" + "---|" * 11)
    for r in rows:
        print("| {method} | {bleu} | {chrf} | {seconds_median} | {ratio_to_baseline} | {decoder_steps} | {expansions} "
              "| {expansions_per_step} | {model_seconds} | {sentences_per_second} | {identical_to_exact_ref} |"
              .format(**r))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sentences": len(ids),
                                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
