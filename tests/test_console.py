"""The console commands work from any directory: streambeam-generate and streambeam-interactive are
fairseq's commands with the plugin's --user-dir and task filled in (options the user gives are kept),
streambeam-decode-corpus is decode_corpus. Each runs on deen-tiny from a temporary directory outside
the checkout, where a relative `--user-dir fairseq_streambeam` would not resolve."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest
import torch
from helpers import BIN, REPO, run_cli, shared_path

from fairseq_streambeam.cli import PLUGIN_DIR, TASK, _end_batch_prefetch, with_plugin

SOURCES = ["Zwei Kinder spielen im Wasser.", "Ein Hund läuft durch den Schnee.", "Eine Frau liest ein Buch."]


def test_with_plugin_fills_in_only_what_is_missing():
    assert with_plugin(["prog", "data", "--beam", "5"]) == [
        "prog", "--user-dir", PLUGIN_DIR, "--task", TASK, "data", "--beam", "5"]
    assert with_plugin(["prog", "--task", "translation", "data"]) == [
        "prog", "--user-dir", PLUGIN_DIR, "--task", "translation", "data"]
    assert with_plugin(["prog", "--user-dir=/x", "--task=t"]) == ["prog", "--user-dir=/x", "--task=t"]
    assert Path(PLUGIN_DIR).is_absolute() and (Path(PLUGIN_DIR) / "task.py").is_file()


def command(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: setup.py's console_scripts are installed by pip install -e '.[test]'")
    return str(path)


def deen_tiny() -> List[str]:
    m = shared_path("models", "deen-tiny")
    return [str(m), "--path", str(m / "checkpoint_best.pt"), "-s", "de", "-t", "en", "--bpe", "sentencepiece",
            "--sentencepiece-model", str(m / "spm8k.model")]


def test_cwd_is_outside_the_checkout(tmp_path):
    assert not tmp_path.resolve().is_relative_to(REPO)
    assert not (tmp_path / "fairseq_streambeam").exists()


def test_streambeam_interactive(tmp_path):
    r = run_cli([command("streambeam-interactive"), *deen_tiny(), "--beam", "5", "--decoding", "var-stream"],
                input="\n".join(SOURCES) + "\n", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(int(i) for i in re.findall(r"^H-(\d+)\t", r.stdout, re.M)) == [0, 1, 2], r.stdout
    assert "streambeam var-stream: 3 sentences" in r.stderr  # the counters logged at exit reach the terminal


def test_streambeam_generate(tmp_path):
    """A raw-text split beside deen-tiny's dictionaries, addressed by relative paths."""
    import sentencepiece as spm

    m = shared_path("models", "deen-tiny")
    data = tmp_path / "data"
    data.mkdir()
    pieces = spm.SentencePieceProcessor(model_file=str(m / "spm8k.model")).encode(SOURCES, out_type=str)
    for lang in ("de", "en"):  # the target side is only read, not decoded
        (data / f"dict.{lang}.txt").symlink_to(m / f"dict.{lang}.txt")
        (data / f"test.de-en.{lang}").write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")
    r = run_cli([command("streambeam-generate"), "data", "--dataset-impl", "raw", "--path",
                 str(m / "checkpoint_best.pt"), "-s", "de", "-t", "en", "--beam", "5", "--decoding", "var-stream",
                 "--post-process", "sentencepiece"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    hyps = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", r.stdout, re.M))
    assert sorted(hyps) == ["0", "1", "2"], r.stdout
    assert hyps["0"] == "Two children are playing in the water.", hyps
    assert "streambeam var-stream: 3 sentences" in r.stderr
    # importing fairseq leaves the root logger at DEBUG (frontend.fairseq_log_level): no library's debug lines
    assert "DEBUG:" not in r.stderr, r.stderr[-3000:]
    # fairseq-generate starts its DataLoader in a thread (BufferedIterator): the warning is filtered there too
    assert "pin_memory" not in r.stderr or torch.accelerator.is_available(), r.stderr[-3000:]


def test_streambeam_generate_help_lists_the_plugin_options(tmp_path):
    r = run_cli([command("streambeam-generate"), "--help"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--decoding" in r.stdout and "--draft-lookup" in r.stdout
    assert "tensorboardX" not in r.stderr  # fairseq's import-time notice, irrelevant to decoding


def test_streambeam_decode_corpus(tmp_path):
    (tmp_path / "in.de").write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    r = run_cli([command("streambeam-decode-corpus"), "--input", "in.de", "--output-dir", "out",
                 "--data", *deen_tiny(), "--decoding", "greedy", "--quiet"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = (tmp_path / "out" / "output.txt").read_text(encoding="utf-8").splitlines()
    assert len(out) == 3 and out[0] == "Two children are playing in the water.", out
    assert "DEBUG:" not in r.stderr, r.stderr[-3000:]
    # fairseq's batch iterator asks for pinned memory on every device; torch's warning about it is
    # filtered where no accelerator exists (task._quiet_pin_memory_warning)
    assert "pin_memory" not in r.stderr or torch.accelerator.is_available(), r.stderr[-3000:]


def test_an_error_lets_fairseqs_batch_prefetch_thread_end():
    """An error that ends fairseq-generate early first lets fairseq's batch-prefetching daemon thread
    end (cli._end_batch_prefetch): the interpreter finalizing while that thread is inside torch
    aborts the process (SIGABRT) instead of exiting with status 2."""
    from fairseq.data.iterators import BufferedIterator

    itr = BufferedIterator(2, list(range(1000)))
    assert next(itr) == 0
    consumer = itr._consumer
    assert consumer.is_alive()  # blocked on its full queue, with 997 items left to read
    _end_batch_prefetch()
    assert not consumer.is_alive()


def test_fairseq_option_mistakes_are_one_line(tmp_path):
    """fairseq's own checks (data directory, split, checkpoint, --path, a mandatory BPE option), and
    the plugin's checks of a source, end in a traceback in fairseq-generate; the plugin's command
    prints one line, status 2, without Hydra's deprecation warnings before it, and removes the empty
    --results-path file (and directory) that fairseq-generate made before it loaded anything."""
    m = shared_path("models", "deen-tiny")
    data, ckpt = str(m / "data-bin"), str(m / "checkpoint_best.pt")
    base = ["-s", "de", "-t", "en", "--cpu", "--batch-size", "1", "--results-path", "res/out"]
    cases = [
        (["/nonexistent", "--path", ckpt], "/nonexistent: no such directory"),
        ([data, "--path", str(tmp_path / "missing.pt")], "missing.pt: no such checkpoint"),
        ([data, "--path", ckpt, "--gen-subset", "nosuch"], "Dataset not found: nosuch"),
        ([data], "--path is required"),
        ([data, "--path", ckpt, "--bpe", "sentencepiece"], "--sentencepiece-model"),
        # the plugin's own, found when a source is decoded: a 5-token source's limit below --min-len
        ([data, "--path", ckpt, "--max-len-a", "2", "--max-len-b", "0", "--min-len", "11"],
         "--min-len 11 exceeds the maximum length 10"),
    ]
    for args, text in cases:
        r = run_cli([command("streambeam-generate"), *args, *[a for a in base if a not in args]], cwd=tmp_path)
        errors = [x for x in r.stderr.splitlines() if "error:" in x]
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
        assert len(errors) == 1 and text in errors[0], (args, r.stderr[-2000:])
        assert "hydra.cc" not in r.stderr and not (tmp_path / "res").exists(), (args, r.stderr[-2000:])
    (tmp_path / "res" / "out").mkdir(parents=True)  # a directory of the user's stays; the run's empty file does not
    r = run_cli([command("streambeam-generate"), *cases[2][0], *base], cwd=tmp_path)
    assert r.returncode == 2 and list((tmp_path / "res" / "out").iterdir()) == [], r.stderr[-2000:]


def test_a_usage_error_is_the_only_line(tmp_path):
    """Nothing stands before an option error: fairseq's "--user-dir ... has already been imported"
    notice (the commands import the plugin themselves) is dropped (cli._AlreadyImported)."""
    m = shared_path("models", "deen-tiny")
    r = run_cli([command("streambeam-generate"), str(m / "data-bin"), "--path", str(m / "checkpoint_best.pt"),
                 "-s", "de", "-t", "en", "--beam", "0"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "streambeam-generate: error: --beam must be >= 1, got 0"], r.stderr[-2000:]


def test_an_error_found_while_decoding_is_one_line_with_a_data_loader_worker(tmp_path):
    """fairseq-generate's data-loader worker (--num-workers 1, its default) printed a
    ConnectionResetError traceback after the one-line error in most runs: the process ended
    under it. A source's --min-len limit can only be found while decoding."""
    m = shared_path("models", "deen-tiny")
    args = [str(BIN / "fairseq-generate"), str(m / "data-bin"), "--path", str(m / "checkpoint_best.pt"),
            "--user-dir", PLUGIN_DIR, "--task", TASK, "-s", "de", "-t", "en", "--cpu", "--batch-size", "8",
            "--num-workers", "1", "--match-source-len", "--min-len", "12"]
    for _ in range(3):
        r = run_cli(args, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert [x for x in r.stderr.splitlines() if "error:" in x][0].endswith("allowed by --match-source-len")
