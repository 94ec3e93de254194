"""Every hypothesis of a plugin decoding against fairseq's own SequenceGenerator (docs/benchmarks.md,
"What the engine's parts save"): a data-bin's test split (or `--limit` evenly spaced sentences of
it), batches as fairseq-generate makes them, float32 models. Prints how many sentences have the same
best hypothesis, the same n-best list in the same order, the largest score difference where the
lists agree, and the first sentence ids where they do not.

    python scripts/fairseq_agreement.py --data ../shared/models/deen-tiny/data-bin \\
        --path ../shared/models/deen-tiny/checkpoint_best.pt -s de -t en --beam 5
"""

from __future__ import annotations

import torch

from fairseq_streambeam.bench.data import from_data_bin
from fairseq_streambeam.loader import load_models, load_task
from fairseq_streambeam.spec import DecodeSpec, OneLineParser


def main() -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--path", required=True, help="checkpoints, ':' between the members of an ensemble")
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    p.add_argument("--decoding", default="beam", choices=["beam", "greedy", "fixed-stream", "iad"],
                   help="a decoding whose output is fairseq's (greedy and iad: with --beam 1)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=0, help="evenly spaced sentences (0: all)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.decoding in ("greedy", "iad") and args.beam != 1:
        p.error(f"--decoding {args.decoding} outputs fairseq's --beam 1: give --beam 1")
    torch.set_num_threads(args.threads)
    from fairseq.sequence_generator import SequenceGenerator

    task = load_task(args.data, args.source_lang, args.target_lang)
    models = load_models(task, args.path)
    ts = from_data_bin(task, "test", args.limit, None)
    spec = DecodeSpec(decoding=args.decoding, beam_size=args.beam)
    task.spec = spec  # the task batches by the generator's spec
    ours = task.generator_for(models, spec, report_at_exit=False)
    ref = SequenceGenerator(models, task.target_dictionary, beam_size=args.beam)
    itr = task.get_batch_iterator(ts.dataset, max_sentences=args.batch_size, disable_iterator_cache=True)
    n = same_top = same_all = 0
    worst, differ = 0.0, []
    for sample in itr.next_epoch_itr(shuffle=False):
        for sid, a, b in zip(sample["id"].tolist(), ours.generate(models, sample), ref.generate(models, sample)):
            toks_a, toks_b = [h["tokens"].tolist() for h in a], [h["tokens"].tolist() for h in b]
            n, same_top = n + 1, same_top + (toks_a[0] == toks_b[0])
            if toks_a == toks_b:
                same_all += 1
                worst = max([worst] + [abs(float(x["score"]) - float(y["score"])) for x, y in zip(a, b)])
            else:
                differ.append(sid)
    diff = f"{worst:.2e}" if same_all else "- (no list agrees)"
    print(f"{args.decoding}, k = {args.beam}, {n} sentences, threads {torch.get_num_threads()}: best hypothesis "
          f"{same_top}/{n}, every hypothesis in order {same_all}/{n}, largest score difference where they do "
          f"{diff}; differing sentence ids {differ[:10]}")


if __name__ == "__main__":
    main()
