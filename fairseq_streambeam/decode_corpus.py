"""Sharded, resumable decoding of large corpora (back-translation, distillation).

The input files are read as one stream of lines, cut into shards of `--shard-lines` and decoded
with the plugin's task (streaming by default). Each shard's output and record (line range,
checksum, counters, bad-input counts) are written atomically; a re-run skips finished shards and
redoes one decoded from other input lines, options or checkpoints. When every shard is done,
`output.txt` (one line per input line, in order) and `manifest.json` are merged.

Under torchrun (or a Slurm array) worker r of N decodes shards r, r+N, ...; torchrun's workers
meet at a gloo barrier and rank 0 merges, otherwise whichever worker finds all shards done merges.

  python -m fairseq_streambeam.decode_corpus --input corpus.de --output-dir out \\
      --data DICT_DIR --path model.pt -s de -t en --bpe sentencepiece --sentencepiece-model spm.model
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from . import malloc
from .frontend import (
    DefaultsHelp,
    add_generation_options,
    add_model_options,
    add_task_options,
    check_model_options,
    fairseq_log_level,
    load_model,
)
from .runtime.counters import Counters
from .spec import OneLineParser, UsageError, checkpoint_files
from .textio import file_problem, missing_paths, remove_empty

SHARD = "shard-{:05d}"
# run counters that add up across shards (rates such as expansions per step are derived in the merge)
_ADDITIVE = {f.name for f in fields(Counters)} - {"trace"}


def check_args(args) -> None:
    """frontend.check_model_options, this command's own counts, that the inputs exist, the
    worker's rank (worker_identity, worker_gpu), and that the output folder can be made (it is made)."""
    check_model_options(args, ("shard_lines", "batch_size", "max_tokens", "threads"))
    for path in args.input:
        problem = "--input -: standard input is not read (shards need a file to resume)" if path == "-" else (
            file_problem("--input", path))
        if problem:
            raise UsageError(problem)
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"--output-dir {args.output_dir}: not a directory")
    worker_identity()
    worker_gpu(1)  # LOCAL_RANK's form, before anything loads
    shards = os.path.join(args.output_dir, "shards")
    missing = missing_paths(shards)  # the folders this command makes
    try:  # the last check: a folder is made only for a command that passed the others
        os.makedirs(shards, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output-dir {args.output_dir}: cannot create it ({e.strerror})") from None
    args._made = missing  # removed again, if still empty, when a usage mistake is found later (main)


def parse_args(argv=None):
    """The command line, checked before anything loads or is written: a usage mistake is one line
    `prog: error: ...` and exit status 2."""
    p = OneLineParser(prog="streambeam-decode-corpus", description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsHelp)
    p.add_argument("--input", nargs="+", required=True, help="raw text file(s), read as one stream of lines")
    p.add_argument("--output-dir", required=True, help="shards, their records, output.txt and manifest.json")
    add_model_options(p)
    p.add_argument("--shard-lines", type=int, default=100_000, help="input lines per shard (the unit of resuming)")
    p.add_argument("--cpu", action="store_true", help="do not use CUDA even when present")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_generation_options(p.add_argument_group("fairseq-generate's generation options (--nbest N writes the N "
                                                "best of a line on that line, tab-separated)"))
    add_task_options(p.add_argument_group("decoding options of --task streambeam_translation"))
    args = p.parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        p.error(str(e))
    return args


# ---- input and bookkeeping (no model) ----------------------------------------------------------


def read_lines(paths: List[str]) -> Tuple[List[bytes], List[dict]]:
    """Every input line as raw bytes (no newline), and per-file facts for the manifest."""
    lines: List[bytes] = []
    files = []
    for path in paths:
        data = Path(path).read_bytes()
        file_lines = data.split(b"\n")
        if file_lines[-1] == b"":  # (split gives at least one item)
            file_lines.pop()
        lines += [x.removesuffix(b"\r") for x in file_lines]
        files.append({"path": str(path), "lines": len(file_lines), "sha256": hashlib.sha256(data).hexdigest()})
    return lines, files


def shard_ranges(n_lines: int, shard_lines: int) -> List[Tuple[int, int]]:
    if shard_lines < 1:
        raise ValueError(f"--shard-lines must be >= 1, got {shard_lines}")
    return [(a, min(a + shard_lines, n_lines)) for a in range(0, n_lines, shard_lines)]


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary name, fsync, rename: a crash leaves the old file or none, never half."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# options that change no output line: where outputs go, progress, threads, file names (their lines count)
_NOT_IN_KEY = ("output_dir", "quiet", "threads", "input", "shard_lines")


def run_key(args) -> str:
    """What every shard's output depends on beside its lines: the options, the checkpoints and the
    files keyed by line (path, size, modification time)."""
    options = {k: v for k, v in vars(args).items() if k not in _NOT_IN_KEY and not k.startswith("_")}
    files = [*checkpoint_files(args.path), *_id_keyed(args)]  # a URL is keyed by its name (in `options`)
    checkpoints = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in files]
    return json.dumps([options, checkpoints], sort_keys=True, default=str)


def _id_keyed(args) -> List[str]:
    """--lmbr-posteriors and --token-masks files: they key sentences by corpus line, so a shard's
    output also depends on where it starts."""
    return [f for f in (args.lmbr_posteriors, args.token_masks) if f]


def shard_key(run: str, lines: List[bytes], first: Optional[int] = None) -> str:
    """A shard's key: its input lines under the run's options and checkpoints (and its first line
    number, given when files keyed by line are)."""
    h = hashlib.sha256(run.encode("utf-8") + (b"" if first is None else f"@{first}".encode()))
    for line in lines:
        h.update(line + b"\n")
    return h.hexdigest()


def _record(shard_dir: Path, sid: int) -> Optional[dict]:
    """A shard's record (None without a readable one)."""
    try:
        return json.loads((shard_dir / (SHARD.format(sid) + ".json")).read_text())
    except (OSError, ValueError):
        return None


def shard_done(shard_dir: Path, sid: int, rng: Tuple[int, int], key: Optional[str]) -> bool:
    """Done = its record exists, matches the range and the key (input lines, options, checkpoints),
    and the output matches the record's checksum."""
    rec, out_path = _record(shard_dir, sid), shard_dir / (SHARD.format(sid) + ".out")
    return (rec is not None and out_path.exists() and rec.get("status") == "done"
            and (rec.get("start"), rec.get("end")) == rng and rec.get("key") == key
            and rec.get("checksum") == checksum(out_path.read_text(encoding="utf-8")))


def worker_identity(env=os.environ) -> Tuple[int, int]:
    """(rank, world) from torchrun (RANK/WORLD_SIZE) or a Slurm array; (0, 1) otherwise. A Slurm
    array must be one evenly stepped range (0-7, 0-14:2): of a list such as 3,5 (failed tasks
    re-submitted) the tasks would split the shards among themselves and leave the others to nobody."""
    number = functools.partial(_env_number, env)
    if "WORLD_SIZE" in env:
        rank, world = number("RANK", "0"), number("WORLD_SIZE")
        if not 0 <= rank < world:
            raise UsageError(f"RANK={rank} and WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
        return rank, world
    if "SLURM_ARRAY_TASK_COUNT" in env:
        task, count = number("SLURM_ARRAY_TASK_ID"), number("SLURM_ARRAY_TASK_COUNT")
        first, last = number("SLURM_ARRAY_TASK_MIN", "0"), number("SLURM_ARRAY_TASK_MAX", str(task))
        step = number("SLURM_ARRAY_TASK_STEP", "1")
        if (step < 1 or (last - first) % step or (last - first) // step + 1 != count or (task - first) % step
                or not first <= task <= last):
            raise UsageError(f"Slurm array {first}-{last} (step {step}) has {count} tasks: not one stepped range, "
                             "so its tasks cannot share the shards; submit the whole array again (shards already "
                             "done are skipped) or set RANK and WORLD_SIZE")
        return (task - first) // step, count
    return 0, 1


def worker_gpu(n_gpus: int, env=os.environ) -> int:
    """The GPU of this worker among the `n_gpus` it sees: a torchrun worker's LOCAL_RANK, wrapped
    round them when workers outnumber GPUs; else the first (a Slurm task sees its own). Without
    this, every worker on a machine would load its model onto cuda:0."""
    return _env_number(env, "LOCAL_RANK", "0") % max(n_gpus, 1)


def _env_number(env, name: str, default: Optional[str] = None) -> int:
    try:
        return int(env.get(name, default))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UsageError(f"{name}={env.get(name)!r} is not a whole number") from None


def merge(out_dir: Path, ranges: List[Tuple[int, int]], files: List[dict], options: dict,
          keys: List[str]) -> Optional[dict]:
    """Write output.txt and manifest.json if every shard is done under its key; return the summed
    counters (None when shards are still pending)."""
    shard_dir = out_dir / "shards"
    if not all(shard_done(shard_dir, i, r, k) for i, (r, k) in enumerate(zip(ranges, keys))):
        return None
    records = [_record(shard_dir, i) for i in range(len(ranges))]
    text = "".join((shard_dir / (SHARD.format(i) + ".out")).read_text(encoding="utf-8") for i in range(len(ranges)))
    n_lines = ranges[-1][1] if ranges else 0
    assert text.count("\n") == n_lines, "merged output must have one line per input line"
    write_atomic(out_dir / "output.txt", text)
    totals: Dict[str, float] = {}
    for rec in records:
        for k, v in {**rec["counters"], **{f"bad_{k}": v for k, v in rec["bad"].items()}}.items():
            if isinstance(v, (int, float)):  # rounded as the shards' records are (sums of floats gain digits)
                totals[k] = round(totals.get(k, 0) + v, 3)
    if totals.get("decoder_steps"):
        totals["expansions_per_step"] = round(totals["expansions"] / totals["decoder_steps"], 2)
    if totals.get("total_seconds"):
        totals["sentences_per_second"] = round(totals["sentences"] / totals["total_seconds"], 2)
    manifest = {"inputs": files, "lines": n_lines, "options": options, "shards": records, "totals": totals,
                "output": {"path": "output.txt", "checksum": checksum(text)}}
    write_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=1))
    return totals


def bad_input_summary(bad: Dict[str, float]) -> str:
    """The bad-input counts in words, e.g. '2 invalid UTF-8 (replaced by U+FFFD), 1 empty'; '' if none."""
    words = {"invalid_utf8": "invalid UTF-8 (replaced by U+FFFD)", "empty": "empty (decoded from EOS alone)",
             "too_long": "longer than the source limit (the model's positions, or --max-tokens; truncated)"}
    return ", ".join(f"{int(bad[k])} {w}" for k, w in words.items() if bad.get(k))


# ---- decoding -----------------------------------------------------------------------------------


UNK_WARNING = 0.2  # share of unknown source tokens that makes a shard's segmentation suspect


class ShardDecoder:
    """Loads the model once per worker and decodes shards of raw lines to detokenized lines."""

    def __init__(self, args):
        import torch

        cuda = torch.cuda.is_available() and not args.cpu
        if cuda:
            torch.cuda.set_device(worker_gpu(torch.cuda.device_count()))
        m = load_model(args, cuda)
        self.task, self.codec, self.models, self.cuda = m.task, m.codec, m.models, m.cuda
        self.args = args
        # a line is cut to the model's positions, and to --max-tokens, which batches no longer sentence
        self.max_src = min([m.max_positions()[0] for m in self.models] + [args.max_tokens or math.inf])
        self.gen = None  # built once, at the first shard (batching sets the live budget first)
        self.warned = False  # about unknown source tokens (_check_segmentation)

    def decode(self, raw: List[bytes], progress, first: int = 0) -> Tuple[List[str], dict, dict]:
        """Detokenized best hypotheses of lines `raw` (the corpus's lines from `first` on, whose
        0-based corpus line numbers are the ids that --lmbr-posteriors and --token-masks key)."""
        from fairseq import utils
        from fairseq.data import LanguagePairDataset

        bad = {"invalid_utf8": 0, "empty": 0, "too_long": 0}
        src = []
        for line in raw:
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                text = line.decode("utf-8", errors="replace")
                bad["invalid_utf8"] += 1
            if not text.strip():
                bad["empty"] += 1
            ids = self.codec.encode(text)
            if len(ids) > self.max_src:  # keep the first max-1 tokens and EOS, decode, count it (too_long)
                ids = ids[: self.max_src]
                ids[-1] = self.codec.src_dict.eos()
                bad["too_long"] += 1
            src.append(ids)
        self._check_segmentation(src)
        ds = LanguagePairDataset(src, [len(x) for x in src], self.task.source_dictionary,
                                 tgt_dict=self.task.target_dictionary)
        itr = self.task.get_batch_iterator(ds, max_sentences=self.args.batch_size, max_tokens=self.args.max_tokens,
                                           disable_iterator_cache=True).next_epoch_itr(shuffle=False)
        if self.gen is None:
            self.gen = self.task.build_generator(self.models, self.args)  # generation options: the args
        before = self.gen.counters.as_dict()
        out: Dict[int, str] = {}
        for sample in itr:
            sample["id"] = sample["id"] + first  # corpus line numbers, not the shard's
            if self.cuda:
                sample = utils.move_to_cuda(sample)
            hypos = self.task.inference_step(self.gen, self.models, sample)
            for i, sid in enumerate((sample["id"] - first).tolist()):
                best = hypos[i][: self.args.nbest]
                out[sid] = "\t".join(self.codec.decode(h["tokens"].tolist()).replace("\n", " ") for h in best)
            progress.update(len(hypos))
        after = self.gen.counters.as_dict()
        counters = {k: round(after[k] - before[k], 3) for k in after if k in _ADDITIVE}
        return [out[i] for i in range(len(raw))], counters, bad

    def _check_segmentation(self, src: List) -> None:
        """Warn once when a shard's source tokens are mostly unknown to the dictionary: the text is
        not segmented as the model's (--tokenizer, --bpe, --sentencepiece-model), and the output
        would be garbage with nothing else to show it."""
        if self.warned:
            return
        d = self.codec.src_dict
        unk, total = sum(int(ids[:-1].eq(d.unk()).sum()) for ids in src), sum(len(ids) - 1 for ids in src)
        if total and unk > UNK_WARNING * total:
            self.warned = True
            print(f"warning: {unk / total:.0%} of the source tokens are not in the model's dictionary: is the input "
                  "segmented as the model's (--tokenizer, --bpe, --sentencepiece-model)?", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    malloc.retain_freed_memory()
    fairseq_log_level()
    try:
        return decode(args)
    except UsageError as e:  # found while decoding, e.g. --min-len above a line's length limit
        print(f"streambeam-decode-corpus: error: {e}", file=sys.stderr)
        remove_empty(getattr(args, "_made", []))  # the folders this command made, if still empty
        return 2


def decode(args) -> int:
    """Decode this worker's shards that are not done, then merge when every shard is."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out_dir = Path(args.output_dir)
    shard_dir = out_dir / "shards"  # made by check_args
    lines, files = read_lines(args.input)
    ranges = shard_ranges(len(lines), args.shard_lines)
    options = {k: v for k, v in vars(args).items() if k not in ("output_dir", "quiet") and not k.startswith("_")}
    rank, world = worker_identity()
    dist = _init_distributed(world)
    run = run_key(args)
    keys = [shard_key(run, lines[a:b], a if _id_keyed(args) else None) for a, b in ranges]
    mine = [i for i in range(len(ranges)) if i % world == rank]
    todo = [i for i in mine if not shard_done(shard_dir, i, ranges[i], keys[i])]
    stale = sum(shard_done(shard_dir, i, ranges[i], (_record(shard_dir, i) or {}).get("key")) for i in todo)
    print(f"worker {rank}/{world}: {len(ranges)} shards of {args.shard_lines} lines, {len(mine)} mine, "
          f"{len(mine) - len(todo)} already done, {len(todo)} to decode"
          + (f" ({stale} done before with other input lines, options or checkpoints)" if stale else ""), flush=True)
    if todo:
        from tqdm import tqdm

        dec = ShardDecoder(args)
        total = sum(ranges[i][1] - ranges[i][0] for i in todo)
        t0, done_lines = time.perf_counter(), 0
        for i in todo:
            a, b = ranges[i]
            with tqdm(total=b - a, desc=f"[{rank}] {SHARD.format(i)}", disable=args.quiet, leave=False,
                      file=sys.stderr) as bar:
                hyps, counters, bad = dec.decode(lines[a:b], bar, a)
            text = "".join(h + "\n" for h in hyps)
            write_atomic(shard_dir / (SHARD.format(i) + ".out"), text)
            record = {"id": i, "start": a, "end": b, "status": "done", "checksum": checksum(text), "key": keys[i],
                      "worker": rank, "counters": counters, "bad": bad}
            write_atomic(shard_dir / (SHARD.format(i) + ".json"), json.dumps(record))
            done_lines += b - a
            rate = done_lines / max(time.perf_counter() - t0, 1e-9)
            note = bad_input_summary(bad)
            print(f"[{rank}] {SHARD.format(i)} done: {done_lines}/{total} lines, {rate:.1f} sentences/s, "
                  f"ETA {(total - done_lines) / rate:.0f}s" + (f"; bad input lines: {note}" if note else ""),
                  flush=True)
            _test_crash_hook(i)
    if dist is not None:
        dist.barrier()
    if rank == 0 or dist is None:
        totals = merge(out_dir, ranges, files, options, keys)
        if totals is not None:
            note = bad_input_summary({k[4:]: v for k, v in totals.items() if k.startswith("bad_")})
            print(f"merged {len(lines)} lines into {out_dir / 'output.txt'}; bad input lines: {note or 'none'}",
                  flush=True)
        elif dist is None:
            print("not merged yet: other shards are still pending (re-run, or wait for the other workers)")
    if dist is not None:
        dist.destroy_process_group()
    return 0


def _init_distributed(world: int):
    """gloo process group under torchrun, for the barrier before the merge (None otherwise)."""
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    return dist


def _test_crash_hook(shard: int) -> None:
    """Tests simulate a killed worker: STREAMBEAM_CRASH_AFTER_SHARD=k exits hard after shard k."""
    if os.environ.get("STREAMBEAM_CRASH_AFTER_SHARD") == str(shard):
        os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
