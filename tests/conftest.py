import os
import random

import pytest
import torch
from helpers import BIN, N_TEST, REPO, run_cli

PLUGIN = str(REPO / "fairseq_streambeam")  # --user-dir, whatever the working directory

# Benchmarks and tests set threads explicitly: oversubscribed threads can make fairseq many times slower.
torch.set_num_threads(int(os.environ.get("STREAMBEAM_TEST_THREADS", "2")))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on a CUDA device (tests/test_cuda.py; `pytest -m cuda` on a GPU "
                                       "machine), skipped without one")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A real fairseq data-bin and a checkpoint trained for a few updates (no ../shared needed);
    the raw test.src/test.tgt stay beside it for raw-text runs."""
    root = tmp_path_factory.mktemp("tiny")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(24)]

    def write(name, n):
        src, tgt = [], []
        for _ in range(n):
            s = [rng.choice(words) for _ in range(rng.randint(1, 10))]
            src.append(" ".join(s))
            tgt.append(" ".join(reversed(s)))
        (root / f"{name}.src").write_text("\n".join(src) + "\n")
        (root / f"{name}.tgt").write_text("\n".join(tgt) + "\n")

    write("train", 300)
    write("test", N_TEST)
    r = run_cli([str(BIN / "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
              "--trainpref", str(root / "train"), "--testpref", str(root / "test"),
              "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli([str(BIN / "fairseq-train"), str(root / "bin"), "--arch", "transformer", "--encoder-layers", "1",
              "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
              "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
              "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "0.003", "--max-tokens", "2000",
              "--max-update", "30", "--save-dir", str(root / "ckpt"), "--no-epoch-checkpoints",
              "--cpu", "--seed", "1", "--no-progress-bar", "--disable-validation"])
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "bin", root / "ckpt" / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def tiny_drafter(tiny_run, tmp_path_factory):
    """A GAD block drafter for tiny_run's checkpoint, trained through fairseq-train --user-dir for a
    few updates (initialised from the AR checkpoint, with glancing and validation)."""
    data, ckpt = tiny_run
    save = tmp_path_factory.mktemp("drafter")
    r = run_cli([str(BIN / "fairseq-train"), str(data), "--user-dir", PLUGIN, "--arch", "block_drafter",
                 "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
                 "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                 "--encoder-attention-heads", "2", "--decoder-attention-heads", "2", "--draft-block-size", "3",
                 "--criterion", "block_drafting", "--optimizer", "adam", "--lr", "0.003", "--max-tokens", "2000",
                 "--max-update", "4", "--save-dir", str(save), "--no-epoch-checkpoints", "--cpu", "--seed", "1",
                 "--no-progress-bar", "--valid-subset", "test", "--init-from", str(ckpt)])
    assert r.returncode == 0, r.stderr[-3000:]
    return save / "checkpoint_last.pt", r.stdout + r.stderr
