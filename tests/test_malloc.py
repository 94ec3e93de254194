"""The plugin's commands keep the memory a decoding frees (fairseq_streambeam.malloc): with glibc's
defaults, megabyte buffers freed and allocated again are faulted in again page by page; with the
thresholds the commands set, they are not. The environment's own malloc settings win."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from fairseq_streambeam import malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# three 16 MB buffers made, touched and freed: four times to settle, then four times counted
FAULTS = """
import resource, torch
from fairseq_streambeam.malloc import retain_freed_memory
print(retain_freed_memory())
def buffers():
    held = [torch.empty(4 << 20).fill_(1.0) for _ in range(3)]
    del held
for _ in range(4):
    buffers()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    buffers()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(**env: str) -> list:
    """Whether the setting was made, and the page faults counted, in a process with `env`."""
    environ = {k: v for k, v in os.environ.items() if k not in (*malloc.ENVIRONMENT, "GLIBC_TUNABLES")}
    r = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, env={**environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


PAGES = 4096  # a 16 MB buffer's


@glibc
def test_freed_buffers_are_not_faulted_in_again():
    set_, faults = _run()
    assert set_ == "True"
    assert int(faults) < PAGES


@glibc
def test_the_environment_wins():
    """glibc's first threshold (128 KiB), set by the environment: each buffer is mapped apart and
    given back when freed, so every round faults all of its pages in again."""
    set_, faults = _run(MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    assert set_ == "False"
    assert int(faults) > 0.9 * 4 * 3 * PAGES
    assert _run(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")[0] == "False"
    assert _run(GLIBC_TUNABLES="glibc.cpu.x86_rep_movsb_threshold=4096")[0] == "True"


class Called(Exception):
    pass


def _stop(*_):
    raise Called


def test_every_command_keeps_freed_memory(tiny_run, tmp_path, monkeypatch):
    """Each front end calls it once its options parse: decode_corpus, calibrate, serve, the bench,
    and streambeam-generate / -interactive (before fairseq's own main). Where a command would go on
    for long, a mistake found after the call ends it, should the call be missing."""
    from fairseq_streambeam import calibrate, cli, decode_corpus, serve
    from fairseq_streambeam.bench.__main__ import main as bench_main

    data, ckpt = tiny_run
    model = ["--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt"]
    monkeypatch.setattr(malloc, "retain_freed_memory", _stop)
    runs = {
        "decode_corpus": lambda: decode_corpus.main(["--input", str(data.parent / "test.src"), *model,
                                                     "--output-dir", str(tmp_path / "dc"), "--cpu"]),
        "calibrate": lambda: calibrate.main([*model, "--out", str(tmp_path / "cal"), "--tolerance", "-1"]),
        "serve": lambda: serve.main([*model, "--host", "no-such-host.invalid"]),
        "bench": lambda: bench_main([*model, "--out", str(tmp_path / "bench"), "--gen-subset", "no-such-split"]),
    }
    for name, run in runs.items():
        try:
            run()
        except Called:
            continue
        pytest.fail(f"{name} does not keep freed memory")
    for program in ("streambeam-generate", "streambeam-interactive"):
        monkeypatch.setattr(sys, "argv", [program, str(data), "--path", str(ckpt), "--gen-subset", "none"])
        with pytest.raises(Called):
            cli._fairseq_command(interactive=program.endswith("interactive"))
