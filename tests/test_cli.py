"""Invariant 4 end to end: through `fairseq-generate --user-dir`, every input id answers exactly
once, whatever the decoding, batch size and window; `--decoding beam` prints what fairseq prints."""

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

N_TEST = 61  # not a multiple of the batch sizes used, nor of fairseq's default multiple 8
BIN = Path(sys.executable).parent


def _run(args, **kw):
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": str(BIN) + ":/usr/bin:/bin"}
    return subprocess.run(args, capture_output=True, text=True, env=env, **kw)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A real fairseq data-bin and a checkpoint trained for a few updates (no ../shared needed)."""
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
    r = _run([str(BIN / "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
              "--trainpref", str(root / "train"), "--testpref", str(root / "test"),
              "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([str(BIN / "fairseq-train"), str(root / "bin"), "--arch", "transformer", "--encoder-layers", "1",
              "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
              "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
              "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "0.003", "--max-tokens", "2000",
              "--max-update", "30", "--save-dir", str(root / "ckpt"), "--no-epoch-checkpoints",
              "--cpu", "--seed", "1", "--no-progress-bar", "--disable-validation"])
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "bin", root / "ckpt" / "checkpoint_last.pt"


def generate(tiny_run, *extra):
    data, ckpt = tiny_run
    r = _run([str(BIN / "fairseq-generate"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"),
              "--task", "streambeam_translation", "--path", str(ckpt), "--gen-subset", "test",
              "--source-lang", "src", "--target-lang", "tgt", "--cpu", *extra])
    return r


def hypos(out: str):
    """id -> (score, text) of H- lines; also checks every id has exactly one S- and one H- line."""
    s_ids = [int(m) for m in re.findall(r"^S-(\d+)\t", out, re.M)]
    h = re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", out, re.M)
    assert sorted(s_ids) == list(range(N_TEST)), "every input id must answer exactly once"
    assert sorted(int(i) for i, _, _ in h) == list(range(N_TEST))
    return {int(i): (float(s), t) for i, s, t in h}


@pytest.mark.parametrize("decoding,extra", [
    ("beam", ["--batch-size", "7"]),
    ("greedy", ["--max-tokens", "50"]),
    ("var-batch", ["--batch-size", "5"]),
    ("var-stream", ["--batch-size", "6", "--stream-window", "3"]),
    ("var-stream", ["--max-tokens", "40", "--refill-eps", "0.5", "--stream-order", "fifo"]),
    ("fixed-stream", ["--batch-size", "4", "--stream-window", "100", "--max-wait-steps", "3"]),
])
def test_every_id_answers_once(tiny_run, decoding, extra):
    r = generate(tiny_run, "--beam", "4", "--decoding", decoding, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    hypos(r.stdout)
    assert "streambeam" in r.stdout + r.stderr  # the counters line at exit
    assert "decoder steps" in r.stdout + r.stderr


def test_beam_prints_what_fairseq_prints(tiny_run):
    ours = generate(tiny_run, "--beam", "5", "--batch-size", "8", "--nbest", "2", "--lenpen", "0.7")
    ref = generate(tiny_run, "--beam", "5", "--batch-size", "8", "--nbest", "2", "--lenpen", "0.7",
                   "--decoding", "fairseq", "--required-batch-size-multiple", "1")
    assert ours.returncode == 0 and ref.returncode == 0, ours.stderr[-2000:] + ref.stderr[-2000:]

    def lines(out):
        return sorted(x for x in out.splitlines() if re.match(r"^[HPD]-\d+\t", x))

    assert lines(ours.stdout) == lines(ref.stdout)


def test_contradictory_flags_are_rejected(tiny_run):
    r = generate(tiny_run, "--decoding", "var-stream", "--sampling", "--beam", "1", "--batch-size", "4")
    assert r.returncode != 0
    assert "does not support --sampling" in r.stderr
    r = generate(tiny_run, "--decoding", "beam", "--prune-abs-threshold", "1.0", "--batch-size", "4")
    assert r.returncode != 0
    assert "only apply to var-batch and var-stream" in r.stderr


def test_fairseq_interactive(tiny_run):
    data, ckpt = tiny_run
    r = _run([str(BIN / "fairseq-interactive"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"),
              "--task", "streambeam_translation", "--path", str(ckpt), "-s", "src", "-t", "tgt", "--cpu",
              "--beam", "4", "--decoding", "var-stream", "--batch-size", "2", "--buffer-size", "3"],
             input="w1 w2 w3\nw4\n\nw5 w6\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(int(i) for i in re.findall(r"^H-(\d+)\t", r.stdout, re.M)) == [0, 1, 2, 3]


def test_hub_interface(tiny_run):
    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import attach_to_hub

    data, ckpt = tiny_run
    hub = TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                           source_lang="src", target_lang="tgt")
    sents = ["w1 w2 w3", "w4", "w5 w6 w7 w8", "w9 w1"]
    ref = hub.translate(sents, beam=4)
    attach_to_hub(hub, decoding="beam")
    assert type(hub.task).__name__ == "StreamBeamTranslationTask"
    assert hub.translate(sents, beam=4) == ref
    attach_to_hub(hub, decoding="var-stream")
    out = hub.translate(sents, beam=4)
    assert len(out) == 4 and all(isinstance(x, str) for x in out)
