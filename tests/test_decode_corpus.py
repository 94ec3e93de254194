"""Sharded, resumable corpus decoding: merge order and count, resume after a killed worker, a
half-written shard is redone, torchrun 2-process run == 1-process run, manifest schema, bad input;
every decoding option of the task is an option here and reaches the generator."""

import argparse
import json
import math
import shutil
import typing
from typing import List, Optional

import pytest
from helpers import BIN, run_cli

from fairseq_streambeam.decode_corpus import (
    SHARD,
    ShardDecoder,
    checksum,
    merge,
    read_lines,
    shard_ranges,
    worker_gpu,
    worker_identity,
)
from fairseq_streambeam.decode_corpus import main as decode_main
from fairseq_streambeam.spec import UsageError

EXTRA = [b"w1 \xff\xfe w2", b"", b" ".join([b"w3"] * 1100)]  # invalid UTF-8, empty, over 1024 positions


@pytest.fixture(scope="module")
def corpus(tiny_run, tmp_path_factory):
    data, ckpt = tiny_run
    root = tmp_path_factory.mktemp("corpus")
    a = root / "a.txt"
    a.write_bytes((data.parent / "test.src").read_bytes())
    b = root / "b.txt"
    b.write_bytes(b"\n".join(EXTRA) + b"\n")
    n = len(read_lines([str(a), str(b)])[0])
    args = ["--input", str(a), str(b), "--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt",
            "--shard-lines", "10", "--decoding", "var-stream", "--beam", "3", "--batch-size", "4", "--cpu", "--quiet"]
    return args, n


def _clean_run(corpus, out, capsys=None):
    args, _ = corpus
    assert decode_main([*args, "--output-dir", str(out)]) == 0
    if capsys is not None:  # the bad-input counts are on screen too, not only in manifest.json
        said = capsys.readouterr().out
        want = ("bad input lines: 1 invalid UTF-8 (replaced by U+FFFD), 1 empty (decoded from EOS alone), 1 longer "
                "than the source limit (the model's positions, or --max-tokens; truncated)")
        assert want in said.splitlines()[-1], said
    return (out / "output.txt").read_text(encoding="utf-8")


def test_merged_totals_keep_the_records_decimals(tmp_path):
    """Shard records hold counters rounded to 3 decimals; their sums are too (0.1 + 0.2 is
    0.30000000000000004 in floating point)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for sid, seconds in enumerate((0.1, 0.2)):
        (shards / (SHARD.format(sid) + ".out")).write_text(f"line {sid}\n", encoding="utf-8")
        (shards / (SHARD.format(sid) + ".json")).write_text(json.dumps({
            "status": "done", "start": sid, "end": sid + 1, "key": "k", "checksum": checksum(f"line {sid}\n"),
            "counters": {"model_seconds": seconds, "sentences": 1}, "bad": {"empty": 0}}))
    totals = merge(tmp_path, [(0, 1), (1, 2)], [], {}, ["k", "k"])
    assert totals == {"model_seconds": 0.3, "sentences": 2, "bad_empty": 0}
    assert json.loads((tmp_path / "manifest.json").read_text())["totals"]["model_seconds"] == 0.3


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return _clean_run(corpus, tmp_path_factory.mktemp("ref"))


def test_single_process_merge_and_manifest(corpus, reference, tmp_path, capsys):
    args, n = corpus
    out = tmp_path / "run"
    assert _clean_run(corpus, out, capsys) == reference
    assert reference.count("\n") == n  # one output line per input line, in order
    man = json.loads((out / "manifest.json").read_text())
    assert man["lines"] == n and len(man["shards"]) == len(shard_ranges(n, 10))
    assert [(s["start"], s["end"]) for s in man["shards"]] == shard_ranges(n, 10)
    assert {"path", "lines", "sha256"} <= set(man["inputs"][0])
    assert man["totals"]["bad_invalid_utf8"] == 1 and man["totals"]["bad_empty"] == 1
    assert man["totals"]["bad_too_long"] == 1 and man["totals"]["sentences"] == n
    assert sum(s["counters"]["sentences"] for s in man["shards"]) == n  # per-shard counts, not running totals
    assert man["totals"]["expansions_per_step"] > 0
    assert all(s["status"] == "done" and len(s["checksum"]) == 64 for s in man["shards"])


def test_resume_after_a_killed_worker(corpus, reference, tmp_path):
    args, n = corpus
    out = tmp_path / "run"
    r = run_cli([str(BIN / "python"), "-m", "fairseq_streambeam.decode_corpus", *args, "--output-dir", str(out)],
                env_extra={"STREAMBEAM_CRASH_AFTER_SHARD": "2"})
    assert r.returncode == 3, r.stderr[-2000:]  # killed hard after shard 2
    assert not (out / "output.txt").exists()
    done = sorted(p.name for p in (out / "shards").glob("*.json"))
    assert done == ["shard-00000.json", "shard-00001.json", "shard-00002.json"]
    # a shard that was being written when the worker died: output present, no record -> redone
    (out / "shards" / "shard-00003.out").write_text("half\n")
    r = run_cli([str(BIN / "python"), "-m", "fairseq_streambeam.decode_corpus", *args, "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 already done" in r.stdout
    assert (out / "output.txt").read_text(encoding="utf-8") == reference


def test_torchrun_two_workers_equal_one(corpus, reference, tmp_path):
    args, _ = corpus
    if not (BIN / "torchrun").exists():
        pytest.skip("torchrun not installed")
    out = tmp_path / "run"
    r = run_cli([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m",
                 "fairseq_streambeam.decode_corpus", *args, "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "output.txt").read_text(encoding="utf-8") == reference
    workers = {json.loads(p.read_text())["worker"] for p in (out / "shards").glob("*.json")}
    assert workers == {0, 1}


def test_changed_shard_size_is_not_mixed_up(corpus, tmp_path):
    """Records carry their line range: a run with another --shard-lines redoes every shard."""
    args, n = corpus
    out = tmp_path / "run"
    _clean_run(corpus, out)
    args2 = [a if a != "10" else "25" for a in args]
    assert decode_main([*args2, "--output-dir", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert [(s["start"], s["end"]) for s in man["shards"]] == shard_ranges(n, 25)
    shutil.rmtree(out)


def test_bad_shard_size():
    with pytest.raises(ValueError, match="shard-lines"):
        shard_ranges(10, 0)


def test_gad_corpus_equals_greedy(corpus, tiny_drafter, tmp_path):
    """--decoding gad with a drafter, or with lookup drafts, writes greedy's outputs (bad lines included)
    and counts passes."""
    args, n = corpus
    i = args.index("--decoding")
    base = args[:i] + args[i + 4:]  # without "--decoding var-stream --beam 3"
    drafter, _ = tiny_drafter
    assert decode_main([*base, "--decoding", "greedy", "--output-dir", str(tmp_path / "greedy")]) == 0
    assert decode_main([*base, "--decoding", "gad", "--drafter", str(drafter),
                        "--output-dir", str(tmp_path / "gad")]) == 0
    assert decode_main([*base, "--decoding", "gad", "--drafter", str(drafter), "--block-size", "1",
                        "--output-dir", str(tmp_path / "gad-always")]) == 0
    greedy = (tmp_path / "greedy" / "output.txt").read_text(encoding="utf-8")
    # greedy's own output (words: the tiny model has no BPE) as the n-gram table of lookup drafts
    assert decode_main([*base, "--decoding", "gad", "--draft-lookup", str(tmp_path / "greedy" / "output.txt"),
                        "--output-dir", str(tmp_path / "lookup")]) == 0
    assert (tmp_path / "lookup" / "output.txt").read_text(encoding="utf-8") == greedy
    assert (tmp_path / "gad" / "output.txt").read_text(encoding="utf-8") == greedy
    assert (tmp_path / "gad-always" / "output.txt").read_text(encoding="utf-8") == greedy
    assert greedy.count("\n") == n
    totals = json.loads((tmp_path / "gad" / "manifest.json").read_text())["totals"]
    assert totals["verified_rows"] >= n and totals["accepted_tokens"] >= n


def _tiny_args(tiny_run, tmp_path, *extra: str) -> List[str]:
    data, ckpt = tiny_run
    return ["--input", str(data.parent / "test.src"), "--data", str(data), "--path", str(ckpt), "-s", "src",
            "-t", "tgt", "--shard-lines", "100", "--beam", "4", "--batch-size", "8", "--cpu", "--quiet",
            "--output-dir", str(tmp_path), *extra]


def _non_default(f) -> Optional[object]:
    """A value different from the field's default, of its type (None where no generic one fits)."""
    kinds = [a for a in typing.get_args(f.type) if a is not type(None)] or [f.type]
    kind = kinds[0]
    if kind is bool:
        return not f.default
    if kind is int:
        return 2 if f.default in (None, 0, 1) else f.default + 1
    if kind is float:
        return 0.25 if f.default in (None, math.inf) else f.default * 0.5
    if kind is str:
        return "some-path"
    return None


class _TaskConfigSeen(Exception):
    pass


def test_decode_corpus_exposes_every_task_option(tiny_run, tmp_path, monkeypatch):
    """Every field the plugin adds to the task's dataclass is a decode_corpus option and reaches
    the task's config with a non-default value (fails when a field is added and not passed on).
    The values contradict each other (gad options with var-batch), so the command-line check is
    left out and the task is not built: the config it would be built from is caught."""
    from fairseq_streambeam import decode_corpus
    from fairseq_streambeam.decode_corpus import ShardDecoder, parse_args
    from fairseq_streambeam.options import plugin_fields
    from fairseq_streambeam.task import StreamBeamTranslationTask

    seen = {}

    def setup_task(cls, cfg, **kwargs):
        seen["cfg"] = cfg
        raise _TaskConfigSeen

    monkeypatch.setattr(StreamBeamTranslationTask, "setup_task", classmethod(setup_task))
    monkeypatch.setattr(decode_corpus, "check_args", lambda args: None)

    fields = plugin_fields()
    assert {"finish_count", "prune_abs_threshold", "prune_max_cands", "refill_eps", "stream_order",
            "lmbr_posteriors", "token_masks", "decoding"} <= {f.name for f in fields}
    chosen = {"decoding": "var-batch", "stream_order": "continuous", "finish_count": 3,
              "stream_admit": "longest-first"}
    argv = _tiny_args(tiny_run, tmp_path)
    for f in fields:
        value = chosen.get(f.name, _non_default(f))
        assert value is not None, f"no test value for the new option {f.name}: extend _non_default"
        chosen[f.name] = value
        flag = "--" + f.name.replace("_", "-")
        argv += [flag] if isinstance(value, bool) else [flag, str(value)]
    args = parse_args(argv)
    for name, value in chosen.items():
        assert getattr(args, name) == value, name
    with pytest.raises(_TaskConfigSeen):
        ShardDecoder(args)
    for name, value in chosen.items():
        assert str(getattr(seen["cfg"], name)) == str(value), name


def test_decode_corpus_options_reach_the_generator(tiny_run, tmp_path):
    """A decode with --finish-count and --prune-abs-threshold: the generator that decoded the shard
    has them, and the output equals the generator's own best hypotheses for those options."""
    from fairseq_streambeam.decode_corpus import ShardDecoder, main, parse_args

    extra = ("--decoding", "var-batch", "--finish-count", "1", "--prune-abs-threshold", "0.7")
    assert main(_tiny_args(tiny_run, tmp_path / "a", *extra)) == 0
    dec = ShardDecoder(parse_args(_tiny_args(tiny_run, tmp_path / "b", *extra)))
    lines = (tiny_run[0].parent / "test.src").read_bytes().split(b"\n")[:-1]

    class Bar:
        def update(self, n):
            pass

    hyps, counters, _ = dec.decode(lines, Bar())
    assert dec.gen.finalizer.target == 1 and dec.gen.pruning.delta == 0.7 and dec.gen.spec.decoding == "var-batch"
    assert counters["sentences"] == len(lines)
    assert (tmp_path / "a" / "output.txt").read_text(encoding="utf-8") == "".join(h + "\n" for h in hyps)
    default = ShardDecoder(parse_args(_tiny_args(tiny_run, tmp_path / "c", "--decoding", "var-batch")))
    default.decode(lines[:3], Bar())
    assert default.gen.finalizer.target == 4 and default.gen.pruning.delta == 1.5


@pytest.mark.parametrize("extra,message", [
    (["--decoding", "gad"], "--decoding gad needs --drafter PATH"),
    (["--decoding", "var-stream", "--prune-abs-threshold", "-1"], "--prune-abs-threshold must be > 0, got -1.0"),
    (["--decoding", "gad", "--drafter", "missing.pt"], "--drafter missing.pt: no such file"),
    (["--beam", "0"], "--beam must be >= 1, got 0"),
    (["--decoding", "beam", "--stream-order", "continuous"], "--stream-order applies to var-stream"),
    (["--min-len", "9", "--max-len-b", "3"], "--min-len 9 exceeds the maximum length 3"),
    (["--decoding", "iad", "--nbest", "2"], "--decoding iad returns one hypothesis per source"),
    (["--decoding", "greedy", "--nbest", "2"], "--decoding greedy returns one hypothesis per source"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--input", "missing.txt"], "--input missing.txt: no such file"),
    (["--input", "-"], "--input -: standard input is not read"),
    (["--bpe", "sentencepiece"], "--bpe sentencepiece needs --sentencepiece-model"),
    (["--bpe", "fastbpe"], "--bpe fastbpe needs --bpe-codes"),
    (["--bpe", "sentencepiece", "--sentencepiece-model", "README.md"], "README.md: not a sentencepiece model"),
    (["--bpe", "byte_bpe"], "argument --bpe: invalid choice: 'byte_bpe'"),  # its options are not passed on
])
def test_usage_mistakes_are_one_line_before_anything_is_written(tiny_run, tmp_path, capsys, extra, message):
    """A usage mistake: one line `prog: error: ...`, exit status 2, no traceback, and no output
    folder (the checks run before a model loads or a file is written)."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        decode_main([*_tiny_args(tiny_run, out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1 and err[0].startswith("streambeam-decode-corpus: error: ") and message in err[0], err
    assert not out.exists()


def test_mistakes_found_late_are_one_line_too(tiny_run, tmp_path, capsys):
    """An output folder that is a file is refused before anything loads; --min-len above a line's own
    length limit (--max-len-a) shows only once the line is encoded: one line and status 2 as well."""
    taken = tmp_path / "taken"
    taken.write_text("")
    with pytest.raises(SystemExit) as exit_:
        decode_main(_tiny_args(tiny_run, taken))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--output-dir" in err[0] and "not a directory" in err[0]
    short = ["--max-len-a", "1", "--max-len-b", "0", "--min-len", "4"]
    rc = decode_main([*_tiny_args(tiny_run, tmp_path / "new" / "out"), *short])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("streambeam-decode-corpus: error: --min-len 4 exceeds"), err[-3:]
    assert not (tmp_path / "new").exists()  # the folders it made, still empty, are removed
    (tmp_path / "kept").mkdir()
    assert decode_main([*_tiny_args(tiny_run, tmp_path / "kept"), *short]) == 2
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "shards").exists()  # the user's folder stays


@pytest.mark.parametrize("env,expected", [
    ({}, (0, 1)),
    ({"WORLD_SIZE": "4", "RANK": "3"}, (3, 4)),
    ({"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_MAX": "7"}, (5, 8)),
    ({"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_MAX": "14", "SLURM_ARRAY_TASK_STEP": "2"}, (3, 8)),  # --array=0-14:2
    ({"SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3",
      "SLURM_ARRAY_TASK_MAX": "5"}, "not one stepped range"),  # --array=3,5: shards 1, 3, 5... left to nobody
    ({"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_MAX": "5", "SLURM_ARRAY_TASK_STEP": "2"}, "not one stepped range"),  # --array=0-2:2,5
    ({"SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_MAX": "1"}, "not one stepped range"),  # task 7 of 0-1: "worker 7/2", decoded nothing
    ({"WORLD_SIZE": "1", "RANK": "1"}, "need 0 <= RANK < WORLD_SIZE"),  # decoded nothing
    ({"WORLD_SIZE": "0"}, "need 0 <= RANK < WORLD_SIZE"),  # ZeroDivisionError
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
])
def test_worker_identity_covers_every_shard_or_refuses(env, expected):
    """Every shard belongs to exactly one worker: ranks 0..world-1, or a one-line error."""
    if isinstance(expected, tuple):
        assert worker_identity(env) == expected
    else:
        with pytest.raises(UsageError, match=expected):
            worker_identity(env)


@pytest.mark.parametrize("env, gpus, expected", [
    ({}, 4, 0), ({"LOCAL_RANK": "3"}, 4, 3), ({"LOCAL_RANK": "5"}, 4, 1), ({"LOCAL_RANK": "2"}, 0, 0),
    ({"LOCAL_RANK": "x"}, 2, "LOCAL_RANK='x' is not a whole number"),
])
def test_each_torchrun_worker_takes_its_own_gpu(env, gpus, expected):
    if isinstance(expected, int):
        assert worker_gpu(gpus, env) == expected
    else:
        with pytest.raises(UsageError, match=expected):
            worker_gpu(gpus, env)


def test_the_worker_selects_its_gpu_before_the_model_loads(monkeypatch):
    """torchrun's worker 3 on a 2-GPU machine loads onto cuda:1, not cuda:0."""
    import torch

    import fairseq_streambeam.decode_corpus as dc

    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))

    def load(args, cuda):
        calls.append(("load", cuda))
        raise RuntimeError("stop")

    monkeypatch.setattr(dc, "load_model", load)
    with pytest.raises(RuntimeError, match="stop"):
        ShardDecoder(argparse.Namespace(cpu=False))
    assert calls == [("set_device", 1), ("load", True)]


def test_an_output_folder_that_cannot_be_made_is_one_line(tiny_run, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_:
        decode_main(_tiny_args(tiny_run, tmp_path / "afile" / "sub"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--output-dir" in err[0] and "cannot create it" in err[0]


def test_the_run_key_names_a_url_checkpoint_and_stats_local_ones(tiny_run, tmp_path):
    """A URL --path (which fairseq reads) is keyed by its name; local checkpoints by size and time."""
    from fairseq_streambeam.decode_corpus import parse_args, run_key

    args = parse_args(_tiny_args(tiny_run, tmp_path))
    local = run_key(args)
    assert str(tiny_run[1]) in local and str(tiny_run[1].stat().st_size) in local
    args.path = "https://example.org/models/a.pt"
    a = run_key(args)
    args.path = "https://example.org/models/b.pt"
    assert "a.pt" in a and a != run_key(args)


def test_generation_options_reach_the_spec(tiny_run, tmp_path):
    """fairseq's generation options that decode_corpus takes end up in the generator's spec."""
    from fairseq_streambeam.decode_corpus import parse_args
    from fairseq_streambeam.spec import from_cli

    args = parse_args(_tiny_args(tiny_run, tmp_path, "--decoding", "var-stream", "--nbest", "2", "--min-len", "2",
                                 "--unkpen", "0.5", "--temperature", "0.9", "--unnormalized", "--lenpen", "0.7",
                                 "--no-repeat-ngram-size", "3"))
    spec = from_cli(args, args)
    assert (spec.nbest, spec.min_len, spec.unk_penalty, spec.temperature, spec.normalize_scores, spec.len_penalty,
            spec.no_repeat_ngram_size, spec.beam_size) == (2, 2, 0.5, 0.9, False, 0.7, 3, 4)


def test_nbest_puts_the_n_best_of_a_line_on_that_line(tiny_run, tmp_path):
    assert decode_main(_tiny_args(tiny_run, tmp_path / "top1", "--decoding", "beam")) == 0
    assert decode_main(_tiny_args(tiny_run, tmp_path / "two", "--decoding", "beam", "--nbest", "2")) == 0
    top1 = (tmp_path / "top1" / "output.txt").read_text(encoding="utf-8").splitlines()
    two = (tmp_path / "two" / "output.txt").read_text(encoding="utf-8").splitlines()
    assert len(two) == len(top1) and all(line.count("\t") == 1 for line in two)
    assert [line.split("\t")[0] for line in two] == top1


def test_other_input_or_options_are_decoded_again(corpus, tmp_path, capsys):
    """A shard counts as done only for the same input lines, options and checkpoints: a re-run
    with another decoding, or over edited input, decodes again instead of keeping stale output."""
    args, n = corpus
    out = tmp_path / "run"
    stream = _clean_run(corpus, out)
    i = args.index("--decoding")
    greedy = [*args[:i], "--decoding", "greedy", *args[i + 2:], "--output-dir", str(out)]
    capsys.readouterr()
    assert decode_main(greedy) == 0
    said = capsys.readouterr().out
    assert "0 already done" in said and "done before with other input lines, options or checkpoints" in said
    again = (out / "output.txt").read_text(encoding="utf-8")
    assert decode_main([*greedy[:i], "--decoding", "greedy", *args[i + 2:], "--output-dir", str(tmp_path / "g")]) == 0
    assert again == (tmp_path / "g" / "output.txt").read_text(encoding="utf-8") != stream
    edited = tmp_path / "a.txt"  # the first file with its first line changed: its shard alone is decoded again
    first = args[args.index("--input") + 1]
    lines = open(first, "rb").read().split(b"\n")
    edited.write_bytes(b"\n".join([b"w1 w2 w3"] + lines[1:]))
    j = greedy.index(first)
    capsys.readouterr()
    assert decode_main([*greedy[:j], str(edited), *greedy[j + 1:]]) == 0
    assert f"{-(-n // 10) - 1} already done, 1 to decode" in capsys.readouterr().out


def test_token_masks_key_corpus_lines_across_shards(tiny_run, tmp_path):
    """--token-masks (and --lmbr-posteriors) key sentences by their 0-based line in the corpus, in
    every shard: a mask allowing only EOS empties exactly that line."""
    masks = tmp_path / "masks.jsonl"
    masks.write_text('{"id": 3, "allow": [2]}\n', encoding="utf-8")
    args = [a if a != "100" else "2" for a in _tiny_args(tiny_run, tmp_path / "out", "--decoding", "greedy",
                                                          "--token-masks", str(masks))]
    assert decode_main(args) == 0
    lines = (tmp_path / "out" / "output.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert [i for i, line in enumerate(lines) if not line] == [3]
    masks.write_text('{"id": 0, "allow": [2]}\n', encoding="utf-8")  # other masks: the shards are decoded again
    assert decode_main(args) == 0
    lines = (tmp_path / "out" / "output.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert [i for i, line in enumerate(lines) if not line] == [0]


def test_fp16_halves_the_models_on_a_cpu_too(tiny_run, tmp_path, monkeypatch):
    """--fp16 did nothing without CUDA while the manifest said fp16; fairseq-generate --fp16 --cpu
    halves the models, and so does decode_corpus (serve loads through the same function)."""
    from helpers import spy_loaded_dtypes

    dtypes = spy_loaded_dtypes(monkeypatch)
    assert decode_main(_tiny_args(tiny_run, tmp_path / "out", "--fp16")) == 0
    assert dtypes == ["torch.float16"]


def test_lines_longer_than_max_tokens_are_cut_and_counted_in_every_shard(tiny_run, tmp_path):
    """fairseq batches no sentence longer than --max-tokens (an assertion, after earlier shards were
    written): such a line is cut to --max-tokens tokens, decoded and counted, as a line longer than
    the model's positions is, in whichever shard it falls."""
    out = tmp_path / "out"
    for decoding in ("beam", "var-stream"):
        rc = decode_main(_tiny_args(tiny_run, out / decoding, "--max-tokens", "4", "--shard-lines", "7",
                                    "--decoding", decoding))
        manifest = json.loads((out / decoding / "manifest.json").read_text())
        assert rc == 0 and manifest["totals"]["bad_too_long"] > 0, manifest["totals"]


def test_unsegmented_input_is_warned_about(tiny_run, tmp_path, capsys):
    """Text not segmented as the model's (a forgotten --bpe) was decoded to garbage with no sign of
    it: most of its tokens are unknown to the dictionary, which is said once."""
    raw = tmp_path / "raw.txt"
    raw.write_text("qq1 qq2 qq3\nqq4 qq5\n" * 3)
    assert decode_main([*_tiny_args(tiny_run, tmp_path / "out", "--input", str(raw)), "--shard-lines", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: 100% of the source tokens are not in the model's dictionary") == 1, err
    assert decode_main(_tiny_args(tiny_run, tmp_path / "out2")) == 0  # the tiny model's own test sources
    assert "warning" not in capsys.readouterr().err
