"""streambeam-calibrate: the searches on synthetic grids with known optima, the whole tool on a
trained tiny model (the choice is the cheapest decode on target, its options file gives the same
output through fairseq-generate, a rerun resumes from the cache, a changed option is not served
from it), the LMBR stage finding the optimum of a case built to have one, and one-line errors."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from helpers import BIN, N_TEST, REPO, run_cli

from fairseq_streambeam import calibrate as cal_mod
from fairseq_streambeam.calibrate import best_weights, cheapest_pruning, pareto

DELTAS, MS, ZS = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0], [2, 3, 5], [1, 2, 5]


def _synthetic(need: float):
    """BLEU and cost grow with delta, M and z; the target is `need`. Returns evaluate and its calls."""
    calls = []

    def evaluate(p):
        calls.append(p)
        d, m, z = p
        quality = d + 0.8 * m + 0.3 * z
        return quality >= need, 10 * d + 7 * m + z

    return evaluate, calls


@pytest.mark.parametrize("need", [3.0, 5.5, 8.0, 11.0])
def test_cheapest_pruning_finds_the_brute_force_optimum_in_fewer_decodes(need):
    evaluate, calls = _synthetic(need)
    grid = list(itertools.product(DELTAS, MS, ZS))
    on_target = [p for p in grid if evaluate(p)[0]]
    calls.clear()
    want = min(on_target, key=lambda p: evaluate(p)[1])
    calls.clear()
    assert cheapest_pruning(evaluate, DELTAS, MS, ZS) == want
    assert len(set(calls)) < len(grid) / 4  # 72 settings


def test_a_start_on_target_prunes_the_search():
    """Narrow M misses at any delta and costs more the wider it gets (as at k = 50): a start on
    target lets the bisections stop at the first miss that costs more than it."""
    calls = []

    def evaluate(p):
        calls.append(p)
        d, m, z = p
        return m >= 5 and d >= 1.5, d * m + z / 10

    want = cheapest_pruning(evaluate, DELTAS, MS, ZS)
    n = len(set(calls))
    calls.clear()
    assert cheapest_pruning(evaluate, DELTAS, MS, ZS, start=(1.5, 5, 5)) == want == (1.5, 5, 1)
    assert len(set(calls)) < n
    calls.clear()
    assert cheapest_pruning(evaluate, DELTAS, MS, ZS, start=(1.7, 5, 5)) == want  # off the grid: not used
    assert (1.7, 5, 5) not in calls


def test_cheapest_pruning_returns_none_when_nothing_is_on_target():
    evaluate, calls = _synthetic(100.0)
    assert cheapest_pruning(evaluate, DELTAS, MS, ZS) is None
    assert len(set(calls)) == 3 * 3  # per M, a bisection of 8 deltas: 3 probes, all missing


def test_best_weights_grid_and_coordinate():
    calls = []

    def bleu(w):  # one peak at alpha 0.5, lambda 0.25, theta0 -1, separable
        calls.append(w)
        return -(w[0] - 0.5) ** 2 - (w[1] - 0.25) ** 2 - (w[2] + 1) ** 2

    grids = ([0.25, 0.5, 1.0], [0.1, 0.25, 0.5, 1.0], [-2.0, -1.0, 0.0])
    assert best_weights(bleu, grids, "grid") == (0.5, 0.25, -1.0) and len(calls) == 3 * 4 * 3
    assert best_weights(bleu, grids, "coordinate", start=(1.0, 1.0, 0.0)) == (0.5, 0.25, -1.0)


def test_pareto_front():
    pts = [(10, 5.0), (8, 5.5), (12, 6.0), (8, 4.0), (20, 5.9), (15, 6.0)]
    assert sorted(pareto(pts)) == [1, 2]


def test_gap_noise_is_zero_for_equal_outputs_and_grows_with_disagreement():
    refs = [f"the cat {i} sat on the mat" for i in range(40)]
    base = [f"the cat {i} sat on a mat" for i in range(40)]
    assert cal_mod.gap_noise(base, base, refs, samples=200) == 0.0
    mixed = [r if i % 2 else b for i, (r, b) in enumerate(zip(refs, base))]  # half the sentences fixed
    assert 0.5 < cal_mod.gap_noise(mixed, base, refs, samples=200) < 20


def _argv(data, ckpt, out, *extra):
    return ["--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt", "--gen-subset", "test",
            "--post-process", "none", "--beam", "4", "--max-len-b", "30", "--out", str(out), "--quiet", "--cpu",
            "--deltas", "0.5", "2", "100", "--max-cands", "2", "4", "--finish-counts", "1", "4", *extra]


def test_calibrate_on_a_trained_model_resumes_and_round_trips(tiny_run, tmp_path, monkeypatch):
    data, ckpt = tiny_run
    out = tmp_path / "cal"
    assert cal_mod.main(_argv(data, ckpt, out, "--tolerance", "0.5", "--lenpen", "0.8")) == 0
    res = json.loads((out / "calibrate.json").read_text())
    rows = res["results"]
    beam = next(r for r in rows if r["setting"]["prune"] is None)
    chosen = next(r for r in rows if r["setting"] == res["chosen"])
    assert res["target"] == pytest.approx(beam["bleu"] - 0.5)
    on_target = [r for r in rows if r["setting"]["prune"] and r["bleu"] >= res["target"]]
    assert chosen["expansions"] == min(r["expansions"] for r in on_target)
    assert any(r["pareto"] for r in rows) and (out / "calibrate.md").read_text().count("**chosen**") == 1
    assert res["gap_sd"] >= 0 and "paired-bootstrap sd" in (out / "calibrate.md").read_text()

    # the options line alone, through fairseq-generate, prints the dev outputs calibrate scored
    args = (out / "best.args").read_text().split()
    assert args[:2] == ["--decoding", "var-stream"] and "--prune-abs-threshold" in args
    r = run_cli([str(BIN / "fairseq-generate"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"), "--task",
                 "streambeam_translation", "--path", str(ckpt), "--gen-subset", "test", "-s", "src", "-t", "tgt",
                 "--cpu", *args])
    assert r.returncode == 0, r.stderr[-2000:]
    hyps = {int(i): h for i, h in re.findall(r"^H-(\d+)\t\S+\t(.*)$", r.stdout, re.M)}
    assert [hyps[i] for i in range(N_TEST)] == (out / "best.hyp").read_text().splitlines()
    bench = json.loads((out / "best.json").read_text())
    assert bench["variants"][1]["delta"] == float(args[args.index("--prune-abs-threshold") + 1])
    assert f": {N_TEST} lines), dev BLEU" in bench["_comment"]
    assert not (out / "posteriors").exists()  # written with --nbest evidence only

    # a rerun decodes nothing: every outcome comes from decodes.jsonl
    def no_decoding(*a, **k):
        raise AssertionError("decoded although cached")

    monkeypatch.setattr("fairseq_streambeam.bench.__main__.run_variant", no_decoding)
    lines = (out / "decodes.jsonl").read_text()
    assert cal_mod.main(_argv(data, ckpt, out, "--tolerance", "0.5", "--lenpen", "0.8")) == 0
    assert (out / "decodes.jsonl").read_text() == lines
    assert json.loads((out / "calibrate.json").read_text())["chosen"] == res["chosen"]
    # another length penalty, or another decoding, is another decode
    for other in (("--lenpen", "1.5"), ("--lenpen", "0.8", "--decoding", "var-batch")):
        with pytest.raises(AssertionError, match="decoded although cached"):
            cal_mod.main(_argv(data, ckpt, out, "--tolerance", "0.5", *other))


def _known_optimum_evidence(data_dir, path) -> None:
    """Per test sentence: the reference (score 0) and twice the same wrong sentence, its source
    (score -1 each). alpha 8 puts nearly all weight on the reference, alpha 0 gives the wrong one
    2/3; lambda 0.01 lets the evidence decide, lambda 100 leaves the model's own (poor) output;
    Theta0 -5 costs more per word than matching every n-gram earns (2.06, the Theta_n sum), so
    outputs end early. The optimum is (8, 0.01, 0)."""
    src = (data_dir.parent / "test.src").read_text().splitlines()
    ref = (data_dir.parent / "test.tgt").read_text().splitlines()
    with open(path, "w") as f:
        for i, (s, r) in enumerate(zip(src, ref)):
            f.write(f"{i} ||| {r} ||| f ||| 0\n{i} ||| {s} ||| f ||| -1\n{i} ||| {s} ||| f ||| -1\n")


@pytest.mark.parametrize("search", ["grid", "coordinate"])
def test_lmbr_stage_finds_the_known_optimum(tiny_run, tmp_path, search):
    data, ckpt = tiny_run
    _known_optimum_evidence(data, tmp_path / "ev.nbest")
    out = tmp_path / "out"
    # var-batch with k = 12, more than any reference's length, at one pruning setting (1.5, 5, 12):
    # the search keeps every possible first word, so the evidence alone can rebuild the reference
    argv = _argv(data, ckpt, out, "--decoding", "var-batch", "--nbest", str(tmp_path / "ev.nbest"),
                 "--alphas", "0", "8", "--lambdas", "0.01", "100", "--theta0s", "-5", "0", "--lmbr-search", search,
                 "--deltas", "1.5", "--max-cands", "5", "--finish-counts", "12")
    argv[argv.index("--beam") + 1] = "12"
    if search == "coordinate":
        argv += ["--lmbr-start", "0", "0.01", "0"]
    assert cal_mod.main(argv) == 0
    res = json.loads((out / "calibrate.json").read_text())
    assert res["chosen"] == {"prune": [1.5, 5, 12], "weights": [8.0, 0.01, 0.0]}
    lmbr = [r for r in res["results"] if r["setting"]["weights"]]
    best = next(r for r in lmbr if r["setting"] == res["chosen"])
    assert best["bleu"] > 50 and all(r["bleu"] < best["bleu"] / 2 for r in lmbr if r is not best)
    # each setting once: fixed beam, the LMBR settings, the start pruning without LMBR
    assert len(res["results"]) == 1 + 1 + (2 * 2 * 2 if search == "grid" else 1 + 3 + 2)
    assert (out / "best.args").read_text().split()[-8:] == ["--lmbr-lambda", "0.01", "--lmbr-theta0", "0",
                                                            "--lmbr-p", "0.85", "--lmbr-r", "0.72"]
    assert json.loads((out / "best.json").read_text())["_lmbr_alpha"] == 8.0
    # chosen at the grids' ends: alpha 8 (largest), lambda 0.01 (smallest), Theta0 0 (largest)
    assert [n.split(":")[0] for n in res["notes"]] == ["--alphas", "--lambdas", "--theta0s"]
    assert "--lambdas: the chosen 0.01 is the grid's smallest" in res["notes"][1]


def test_lmbr_that_lowers_bleu_is_dropped_with_a_note(tiny_run, tmp_path, monkeypatch, capsys):
    """Every LMBR weight scores below no LMBR at the paper's pruning: the pruning is chosen without
    LMBR, and the one note (printed, and in calibrate.json and .md) says why."""
    data, ckpt = tiny_run
    _known_optimum_evidence(data, tmp_path / "ev.nbest")
    real = cal_mod.Calibrator._run

    def lmbr_loses(self, s, ts, name, key):
        rec = real(self, s, ts, name, key)
        return rec if s.weights is None else dict(rec, bleu=-1.0)  # below any real BLEU

    monkeypatch.setattr(cal_mod.Calibrator, "_run", lmbr_loses)
    out = tmp_path / "cal"
    argv = _argv(data, ckpt, out, "--decoding", "var-batch", "--nbest", str(tmp_path / "ev.nbest"), "--lambdas",
                 "0.5", "1", "--theta0s", "0", "--limit", "20", "--tolerance", "100")
    assert cal_mod.main(argv) == 0
    res = json.loads((out / "calibrate.json").read_text())
    assert res["chosen"]["prune"] is not None and res["chosen"]["weights"] is None
    assert "--lmbr-lambda" not in (out / "best.args").read_text()
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert len(notes) == 1 and "LMBR lowers dev BLEU at every weight tried" in notes[0] and "without LMBR" in notes[0]
    assert res["notes"] == [notes[0][len("note: "):]] and "Note: LMBR lowers" in (out / "calibrate.md").read_text()


def test_no_setting_on_target_is_one_line_and_no_options_file(tiny_run, tmp_path, monkeypatch, capsys):
    data, ckpt = tiny_run
    real = cal_mod.Calibrator._run

    def pruned_lose(self, s, ts, name, key):  # every pruned decode 5 BLEU below fixed beam
        rec = real(self, s, ts, name, key)
        return rec if s.prune is None else dict(rec, bleu=rec["bleu"] - 5)

    monkeypatch.setattr(cal_mod.Calibrator, "_run", pruned_lose)
    out = tmp_path / "cal"
    assert cal_mod.main(_argv(data, ckpt, out, "--limit", "20")) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert len(err) == 1 and "no setting on the grids reaches fixed beam's dev BLEU" in err[0]
    assert re.search(r"\(the best, delta \S+ M \d+ z \d+: -?[\d.]+\)", err[0])
    assert (out / "calibrate.md").exists() and not (out / "best.args").exists()


def test_a_gap_of_exactly_the_tolerance_is_on_target(tiny_run, tmp_path, monkeypatch):
    """BLEU is kept to 2 decimals: 9.95 against fixed beam's 10.05 with --tolerance 0.1 is on target
    (10.05 - 0.1 is 9.950000000000001 in floating point)."""
    data, ckpt = tiny_run
    real = cal_mod.Calibrator._run

    def fixed_bleu(self, s, ts, name, key):
        return dict(real(self, s, ts, name, key), bleu=10.05 if s.prune is None else 9.95)

    monkeypatch.setattr(cal_mod.Calibrator, "_run", fixed_bleu)
    assert cal_mod.main(_argv(data, ckpt, tmp_path / "cal", "--limit", "20", "--tolerance", "0.1")) == 0
    assert (tmp_path / "cal" / "best.args").exists()


@pytest.mark.parametrize("extra,message", [
    (["--src", "{src}"], "--src needs --ref"),
    (["--decoding", "beam"], "--decoding beam has no pruning to calibrate: give --nbest evidence"),
    (["--nbest", "{tmp}/missing.nbest"], "--nbest {tmp}/missing.nbest: no such file"),
    (["--nbest", "{tmp}/bad.nbest", "--format", "moses"], "bad.nbest:1: not a Moses n-best line"),
    (["--range", "5:2"], "--range 5:2: needs 0 <= START < END"),
    (["--range", "0:1000"], "lines 0:1000 run past the end of the test set (61 sentences)"),
    (["--tolerance", "-1"], "--tolerance must be >= 0"),
    (["--range", "0:40", "--test-range", "30:61"], "--test-range 30:61 overlaps the dev lines (--range 0:40)"),
    (["--test-range", "30:61"], "--test-range 30:61 overlaps the dev lines (--range all)"),
    (["--deltas", "0", "1"], "--deltas: 0 is out of range (each must be > 0)"),
    (["--finish-counts", "9"], "--finish-counts: 9 is out of range (each must be from 1 to --beam 4)"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--lmbr-p", "0"], "--lmbr-p must be in (0, 1], got 0.0"),
    (["--theta0s", "0", "inf"], "--lmbr-theta0 must be a finite number, got inf"),
    (["--lmbr-start", "1", "-1", "0"], "--lmbr-lambda must be > 0, got -1.0"),
    (["--max-len-b", "-5"], "--max-len-b must be >= 0, got -5"),
    (["--lenpen", "nan"], "--lenpen must be a number, got nan"),
    (["--limit", "-5"], "--limit must be >= 0, got -5"),
    (["-s", "xx"], "no dict.xx.txt there"),
    (["--out", "{tmp}/bad.nbest"], "bad.nbest: not a directory"),
    (["--max-tokens", "3"], "--max-tokens 3 is below the"),
    (["--nbest", "{tmp}/far.nbest", "--format", "moses"], "the --nbest evidence has none of the dev set's 61 sentence"),
    (["--gen-subset", "valid"], "valid"),
    (["--path", "{tmp}"], "not a regular file"),
    (["--src", "{src}", "--ref", "{src}", "--bpe", "sentencepiece", "--sentencepiece-model", "{tmp}/no.model"],
     "--sentencepiece-model"),
])
def test_bad_input_is_one_line_with_status_2(tiny_run, tmp_path, extra, message):
    data, ckpt = tiny_run
    (tmp_path / "bad.nbest").write_text("0 ||| w1 w2 ||| f\n")
    first_ref = (data.parent / "test.tgt").read_text().splitlines()[0]
    (tmp_path / "far.nbest").write_text(f"1000 ||| {first_ref} ||| f ||| 0\n")  # ids of another split
    extra = [x.format(src=data.parent / "test.src", tmp=tmp_path) for x in extra]
    message = message.format(tmp=tmp_path)
    r = run_cli([str(BIN / "streambeam-calibrate"), *_argv(data, ckpt, tmp_path / "out", *extra)])
    assert r.returncode == 2
    errors = [x for x in r.stderr.splitlines() if "error" in x]
    assert "Traceback" not in r.stderr and len(errors) == 1 and message in errors[0], r.stderr[-2000:]
    assert not (tmp_path / "out" / "best.args").exists()
    if extra[0] in ("--lmbr-p", "--theta0s", "--lmbr-start", "--max-len-b", "--lenpen", "--max-tokens"):
        assert not (tmp_path / "out").exists()  # found before anything loads or is written
