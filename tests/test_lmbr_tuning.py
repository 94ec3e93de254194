"""LMBR evidence from any system: each evidence format against posteriors computed by hand, raw
text segmented with the model's sentencepiece model, system combination, one-line errors for bad
files; a tuned config in the bench, and scripts/tune_lmbr.sh from evidence to tuned weights."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from helpers import BIN, N_TEST, make_dict, run_cli

from fairseq_streambeam.scorers.build_posteriors import main as build_main
from fairseq_streambeam.scorers.lmbr import load_posteriors

D = make_dict(8)  # symbols w0..w7
W = {f"w{i}": D.index(f"w{i}") for i in range(8)}
EOS = D.eos()


def _build(tmp_path: Path, *args: str) -> dict:
    d = tmp_path / "dict.txt"
    D.save(str(d))
    out = tmp_path / "post.jsonl"
    assert build_main([*args, "--dict", str(d), "--out", str(out)]) == 0
    return load_posteriors(str(out))


def _g(*words: str) -> tuple:
    return tuple(EOS if w == "</s>" else W[w] for w in words)


def test_fairseq_nbest_scores_are_log2(tmp_path):
    # log2 scores -1 and -2 with alpha 1: p = e^(-ln2) / (e^(-ln2) + e^(-2 ln2)) = 2/3 and 1/3
    f = tmp_path / "gen.out"
    f.write_text("S-4\tsrc\nH-4\t-1\tw1 w2\nD-4\t-1\tw1 w2\nP-4\t-0.5 -0.5\nH-4\t-2\tw1 w3\n")
    post = _build(tmp_path, "--nbest", str(f))[4]
    assert post[_g("w1")] == pytest.approx(1.0)
    assert post[_g("w2")] == pytest.approx(2 / 3) and post[_g("w3")] == pytest.approx(1 / 3)
    assert post[_g("w1", "w2", "</s>")] == pytest.approx(2 / 3) and post[_g("</s>")] == pytest.approx(1.0)
    # alpha 0: uniform whatever the scores
    post = _build(tmp_path, "--nbest", str(f), "--alpha", "0")[4]
    assert post[_g("w2")] == pytest.approx(0.5)


def test_a_source_whose_scores_are_all_minus_inf_gets_uniform_weights(tmp_path):
    """The plugin prints -inf for a source that ended with no finite hypothesis: exp(x - max) was
    NaN there, the file held NaN posteriors, and that sentence decoded to an empty -inf hypothesis."""
    f = tmp_path / "gen.out"
    f.write_text("S-4\tsrc\nH-4\t-inf\tw1 w2\nP-4\t-inf -inf\nH-4\t-inf\tw1 w3\n")
    post = _build(tmp_path, "--nbest", str(f))[4]
    assert post[_g("w1")] == pytest.approx(1.0) and post[_g("w2")] == pytest.approx(0.5)


def test_moses_nbest(tmp_path):
    f = tmp_path / "moses.nbest"
    f.write_text("0 ||| w1 w2 ||| lm: -3 tm: -1 ||| -1.0\n"
                 "0 ||| w1 w3 w3 ||| lm: -4 tm: -2 ||| -2.0 ||| 0-0 1-1\n"
                 "2 ||| w5 ||| x ||| 7\n")
    post = _build(tmp_path, "--nbest", str(f), "--alpha", "2")
    assert sorted(post) == [0, 2]
    p = 1 / (1 + math.exp(-2))  # exp(2 * -1) / (exp(2 * -1) + exp(2 * -2))
    assert post[0][_g("w2")] == pytest.approx(p)
    assert post[0][_g("w3")] == pytest.approx(1 - p)  # counted once though it occurs twice
    assert post[0][_g("w3", "w3")] == pytest.approx(1 - p)
    assert post[0][_g("w1", "w3", "w3", "</s>")] == pytest.approx(1 - p)
    assert post[0][_g("w1")] == pytest.approx(1.0)
    assert post[2] == pytest.approx({_g("w5"): 1.0, _g("</s>"): 1.0, _g("w5", "</s>"): 1.0})


def test_plain_text_with_n_per_source_is_uniform(tmp_path):
    f = tmp_path / "hyps.txt"
    f.write_text("w1 w2\nw1 w3\nw4 w1\nw2\nw2\nw2 w5\n")  # --n 3: sources 0 and 1
    post = _build(tmp_path, "--nbest", str(f), "--n", "3", "--format", "text")
    assert post[0][_g("w1")] == pytest.approx(1.0)
    assert post[0][_g("w2")] == pytest.approx(1 / 3) and post[0][_g("w4", "w1")] == pytest.approx(1 / 3)
    assert post[0][_g("w1", "</s>")] == pytest.approx(1 / 3)  # only in "w4 w1"
    assert post[1][_g("w2")] == pytest.approx(1.0) and post[1][_g("w2", "</s>")] == pytest.approx(2 / 3)
    assert post[1][_g("w5")] == pytest.approx(1 / 3)


def test_system_combination_mixes_posteriors_by_weight(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.nbest"
    a.write_text("w1\nw2\n")  # --n 1: sources 0 and 1
    b.write_text("0 ||| w3 ||| f ||| 0\n0 ||| w1 ||| f ||| 0\n")  # source 0 only, uniform (equal scores)
    post = _build(tmp_path, "--nbest", str(a), str(b), "--n", "1", "--weights", "3,1")
    # source 0: 3/4 * P_a + 1/4 * P_b with P_a(w1) = 1, P_b(w1) = P_b(w3) = 1/2
    assert post[0][_g("w1")] == pytest.approx(3 / 4 + 1 / 8)
    assert post[0][_g("w3")] == pytest.approx(1 / 8)
    assert post[0][_g("</s>")] == pytest.approx(1.0)
    assert post[1] == pytest.approx({_g("w2"): 1.0, _g("</s>"): 1.0, _g("w2", "</s>"): 1.0})  # system a alone


def test_raw_text_is_segmented_with_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the house is small", "the house is old", "a small old house"] * 30) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=16,
                                   model_type="unigram", bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    d = make_dict(0)
    for piece in (sp.id_to_piece(i) for i in range(1, sp.get_piece_size())):
        d.add_symbol(piece)
    d.save(str(tmp_path / "dict.txt"))
    f = tmp_path / "raw.txt"
    f.write_text("the house is small\nthe house is old\n")
    out = tmp_path / "post.jsonl"
    assert build_main(["--nbest", str(f), "--n", "2", "--bpe", "sentencepiece", "--sentencepiece-model",
                       str(tmp_path / "sp.model"), "--dict", str(tmp_path / "dict.txt"), "--out", str(out)]) == 0
    post = load_posteriors(str(out))[0]
    p1, p2 = ([d.index(p) for p in sp.encode(x, out_type=str)] for x in ("the house is small", "the house is old"))
    assert d.unk() not in p1 + p2 and p1[-1] != p2[-1]
    c = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)  # the pieces of the shared prefix
    assert c >= 2 and post[tuple(p1[:min(c, 4)])] == pytest.approx(1.0)
    assert post[(p1[-1], d.eos())] == pytest.approx(0.5)  # the pieces as the decoder would emit them


@pytest.mark.parametrize("content,args,message", [
    ("0 ||| w1 w2 ||| f\n", ["--format", "moses"], "moses.bad:1: not a Moses n-best line"),
    ("0 ||| w1 ||| f ||| -1\nx ||| w1 ||| f ||| -1\n", [], "moses.bad:2: the id 'x' or score '-1' is not a number"),
    ("w1\nw2\nw3\n", ["--n", "2"], "3 lines is not a multiple of --n 2"),
    ("w1\nw2\n", [], "plain-text evidence needs --n N"),
    ("H-0\tnan?\tw1\n", [], "moses.bad:1: score 'nan?' is not a number"),
    ("w1\n", ["--n", "1", "--bpe", "sentencepiece"], "--bpe sentencepiece needs --sentencepiece-model"),
    ("w1\n", ["--n", "1", "--weights", "1,2"], "2 weights for 1 evidence files"),
    ("w1\n", ["--n", "1", "--alpha", "-1"], "--alpha must be >= 0, got -1.0"),
    ("w1\n", ["--n", "1", "--out", "{tmp}/no/p.jsonl"], "p.jsonl: no such directory"),
    ("w1\n", ["--n", "1", "--write-vocab-masks", "{tmp}"], ": a directory, not a file"),
])
def test_bad_evidence_is_a_one_line_error(tmp_path, content, args, message):
    f = tmp_path / "moses.bad"
    f.write_text(content)
    D.save(str(tmp_path / "dict.txt"))
    args = [a.format(tmp=tmp_path) for a in args]
    r = run_cli([str(BIN / "python"), "-m", "fairseq_streambeam.scorers.build_posteriors", "--nbest", str(f),
                 "--dict", str(tmp_path / "dict.txt"), "--out", str(tmp_path / "p.jsonl"), *args])
    assert r.returncode == 2
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert "Traceback" not in r.stderr and len(errors) == 1 and message in errors[0], r.stderr[-2000:]
    assert not (tmp_path / "p.jsonl").exists()


# ---- tuning (fairseq_streambeam.calibrate; its own tests: test_calibrate.py) -----------------------


def test_bench_accepts_the_tuned_config(tiny_run, tmp_path):
    """best.json's LMBR settings reach the bench's *+lmbr variants (lambda 100: the model's own output)."""
    from fairseq_streambeam.bench.__main__ import main as bench_main
    from fairseq_streambeam.bench.__main__ import parse_args, resolve

    cfg = tmp_path / "best.json"
    cfg.write_text(json.dumps({"_lmbr_alpha": 1.0, "beam": 4, "lmbr_lambda": 0.25, "lmbr_theta0": -0.5,
                               "lmbr_p": 0.8, "lmbr_r": 0.7, "baseline": "beam", "exact_ref": "beam",
                               "variants": [{"name": "beam", "decoding": "beam"},
                                            {"name": "beam+lmbr", "decoding": "beam", "lmbr": True}]}))
    settings, variants = resolve(parse_args(["--data", "x", "--path", "y", "-s", "a", "-t", "b", "--config",
                                             str(cfg), "--lmbr-r", "0.6"]))
    assert (settings["lmbr_lambda"], settings["lmbr_theta0"], settings["lmbr_p"]) == (0.25, -0.5, 0.8)
    assert settings["lmbr_r"] == 0.6  # the command line over the config
    assert [v.name for v in variants] == ["beam", "beam+lmbr"] and variants[1].lmbr
    data, ckpt = tiny_run
    from fairseq_streambeam.scorers.lmbr import write_posteriors

    write_posteriors(tmp_path / "p.jsonl", {i: {(D.eos(),): 1.0} for i in range(N_TEST)})
    # lambda 1e-6 leaves EOS's posterior in charge: every output is empty, so the setting was applied
    cfg.write_text(json.dumps({"beam": 4, "lmbr_lambda": 1e-6, "lmbr_theta0": 0.0, "variants": ["beam", "beam+lmbr"]}))
    rows = bench_main(["--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt", "--post-process", "none",
                       "--out", str(tmp_path), "--quiet", "--no-plots", "--limit", "12", "--config", str(cfg),
                       "--lmbr-posteriors", str(tmp_path / "p.jsonl")])
    assert rows[0]["bleu"] > 0 and rows[1]["bleu"] == 0 and rows[1]["identical_to_exact_ref"] < 0.5


def test_tune_script_makes_evidence_and_tunes(tiny_run, tmp_path):
    data, ckpt = tiny_run
    out = tmp_path / "tune"
    other = tmp_path / "other" / ckpt.name  # a second system whose file has the same name
    other.parent.mkdir()
    shutil.copy(ckpt, other)
    r = run_cli(["bash", str(Path(__file__).parents[1] / "scripts" / "tune_lmbr.sh"), "--data", str(data), "--path",
                 str(ckpt), "-s", "src", "-t", "tgt", "--dev", "test", "--nbest-size", "3", "--post-process", "none",
                 "--evidence", f"{ckpt},{other}", "--out", str(out), "--", "--lambdas", "0.5", "1", "--theta0s", "0",
                 "--lmbr-search", "grid", "--quiet", "--cpu", "--tolerance", "100"],
                env_extra={"PYTHON": str(BIN / "python")})
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted((out / "evidence").glob("checkpoint_last-*.test.nbest3"))
    assert len(files) == 2  # one per system: the same file name no longer makes them one
    for nbest in files:
        assert len(re.findall(r"^H-\d+\t", nbest.read_text(), re.M)) == 3 * N_TEST
    res = json.loads((out / "calibrate.json").read_text())
    assert len(res["results"]) == 1 + 2 and sorted(res["args"]["nbest"]) == [str(f) for f in files]
    assert json.loads((out / "best.json").read_text())["lmbr_lambda"] in (0.5, 1.0)
