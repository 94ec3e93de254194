"""The GPU-machine tooling, checked on the CPU: scripts/gpu_check.sh as a dry run (--device cpu
--tiny), its helpers in scripts/gpu_check.py (wheel and checkpoint slimming, the wheel requirement
check, the summary), and the test device router of tests/test_cuda.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from device_router import generate_on, misplaced
from helpers import REPO, SHARED, make_dict, make_sample, random_sentences, random_transformer

from fairseq_streambeam import StreamBeamGenerator

SCRIPT = REPO / "scripts" / "gpu_check.sh"
HELPER = REPO / "scripts" / "gpu_check.py"


def _load_helper():
    """scripts/gpu_check.py as a module: a tool outside the package, so imported by its path."""
    spec = importlib.util.spec_from_file_location("gpu_check", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_helper()


def _script(*args, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_dry_run_of_tests_and_bench(tmp_path):
    """One of the CUDA tests (on the CPU) and the bench stage at tiny sizes: every command
    succeeds, the outputs a GPU run brings back are there (at most 8 files), and the exactness
    columns hold (beam = fairseq's beam, IAD = fairseq's greedy)."""
    data = REPO / "gpu-data" if (REPO / "gpu-data" / "models").is_dir() else SHARED
    if not (data / "models" / "deen-tiny").is_dir() or not (data / "models" / "gec-tiny").is_dir():
        pytest.skip(f"no deen-tiny/gec-tiny under {data}")
    out = tmp_path / "out"
    r = _script("--device", "cpu", "--tiny", "--step", "tests,bench", "--tests-k", "prefix_tokens", "--limit", "3",
                "--data", str(data), "--out", str(out),
                env_extra={"WORK": str(tmp_path / "work")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert {"results.json", "results.md", "gpu_check.png", "tests.log", "bench.log"} <= set(files)
    assert len(files) <= 8, files
    res = json.loads((out / "results.json").read_text())
    assert res["env"]["device"] == "cpu" and res["stages"] and all(s["rc"] == 0 for s in res["stages"])
    assert res["tests"]["tests"] >= 1 and res["tests"]["failures"] == res["tests"]["errors"] == 0
    deen = {row["method"]: row for row in res["bench"]["deen-k5"]["rows"]}
    assert {"fairseq", "beam", "var-batch", "var-stream", "continuous"} <= set(deen)  # continuous: has-method
    assert deen["beam"]["identical_to_exact_ref"] == 1.0 and deen["fairseq"]["bleu"] == deen["beam"]["bleu"]
    half = {row["method"]: row for row in res["bench"]["deen-k5-fp16"]["rows"]}  # model.half() on the CPU
    assert half["beam"]["identical_to_exact_ref"] == 1.0 and half["fairseq"]["bleu"] == half["beam"]["bleu"]
    gec = {row["method"]: row for row in res["bench"]["gec-iad-b1"]["rows"]}
    assert gec["iad"]["identical_to_exact_ref"] == 1.0 and gec["iad"]["accepted_per_pass"] > 1
    assert [c["rows"] for c in res["step_cost"]["step_cost_deen"]] == [1, 2, 4]
    assert [c["rows"] for c in res["lean_step"]["lean_step_deen"]] == [1, 4]  # eager only: no CUDA graphs
    assert all(c["eager_ms"] > 0 and "graph_ms" not in c for c in res["lean_step"]["lean_step_deen"])
    engine = {row["method"]: row for row in res["bench"]["engine-k5"]["rows"]}  # ct2 left out of a dry run
    assert set(engine) == {"var-batch", "var-stream", "continuous", "var-stream[C=320]", "continuous[C=320]",
                           "continuous[C=320,longest-first]"}
    assert all(row["identical_to_exact_ref"] == 1.0 for row in engine.values())  # var-batch's outputs
    assert "deen-k5" in r.stdout and "x base" in r.stdout  # the short table printed last


def test_dry_run_of_serve(tmp_path):
    """The serve stage at tiny sizes: the server and both baselines answer every line as offline
    decoding does, and the summary carries the serving table."""
    pytest.importorskip("aiohttp")
    if not (SHARED / "models" / "deen-tiny").is_dir():
        pytest.skip(f"no deen-tiny under {SHARED}")
    out = tmp_path / "out"
    r = _script("--device", "cpu", "--tiny", "--step", "serve", "--limit", "3", "--data", str(SHARED),
                "--out", str(out), env_extra={"WORK": str(tmp_path / "work")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["stages"] and all(s["rc"] == 0 for s in res["stages"]), res["stages"]
    rows = res["serve"]["rows"]
    assert {(row["mode"], row["clients"]) for row in rows} == {(m, c) for m in ("continuous", "static", "single")
                                                               for c in (1, 8)}
    assert all(row["ok"] and row["identical"] == row["lines"] == 3 for row in rows), rows
    assert "| continuous | 8 | 3 |" in (out / "results.md").read_text()
    assert "serve continuous" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--step", "tests,train"], "unknown step 'train'"),
    (["--device", "gpu"], "--device must be cuda or cpu"),
    (["--limit", "many"], "expected a whole number"),
    (["--big-minutes", "soon"], "expected a number of minutes"),
    (["--data", "/nonexistent"], "no data folder"),
])
def test_usage_errors_are_one_line(args, message):
    r = _script(*args, timeout=30)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("gpu_check.sh: ") and message in lines[0]


def test_the_helper_is_a_tool_outside_the_package():
    """scripts/gpu_check.py runs by its path (has-method reads the package's method list from the
    checkout), and no module of the package names it."""
    assert not list((REPO / "fairseq_streambeam").rglob("gpu_check*.py"))
    for path in (REPO / "fairseq_streambeam").rglob("*.py"):
        assert "gpu_check" not in path.read_text(encoding="utf-8"), f"{path} refers to the GPU-machine helper"
    env = {**os.environ, "PYTHONPATH": ""}
    r = subprocess.run([sys.executable, str(HELPER), "has-method", "continuous"], env=env, cwd="/", timeout=60)
    assert r.returncode == 0
    r = subprocess.run([sys.executable, str(HELPER), "has-method", "no-such-method"], env=env, cwd="/", timeout=60)
    assert r.returncode == 1


def _wheel(folder: Path, name: str, version: str, requires=(), members=("pkg/__init__.py",)) -> Path:
    """A minimal wheel with METADATA, RECORD and `members`."""
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        for m in members:
            z.writestr(m, "x = 1\n")
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/RECORD", "".join(f"{m},sha256=abc,6\n" for m in members) + f"{info}/METADATA,,\n"
                   f"{info}/RECORD,,\n")
    return path


def test_quarter_octave_rows_pad_wide_steps_by_under_a_quarter():
    """The profile's candidate padding: 64 sources x beam 5 stay 320 rows; buckets rise
    monotonically, powers of two up to 64, four per octave past it."""
    buckets = [gpu_check.quarter_octave_rows(n) for n in range(1, 5000)]
    for n, b in enumerate(buckets, 1):
        assert b >= max(n, 8) and (n <= 64 or b - n < n / 4), (n, b)
    assert buckets == sorted(buckets) and buckets[319] == 320 and buckets[3199] == 3584
    assert sorted({b for b in buckets if 256 < b <= 512}) == [320, 384, 448, 512]
    assert sorted({b for b in buckets if b <= 64}) == [8, 16, 32, 64]


def test_slim_wheel_drops_members_and_their_record_rows(tmp_path):
    w = _wheel(tmp_path, "ve-fairseq", "0.12.3", members=("fairseq/__init__.py", "fairseq/examples/a.py",
                                                            "fairseq/examples/b/c.py", "fairseq/libnat.so"))
    dropped, _, _ = gpu_check.slim_wheel(w, ["fairseq/examples/", "fairseq/libnat."])
    assert dropped == 3
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith("RECORD"))).decode()
    assert "fairseq/__init__.py" in names and not any("examples" in n or "libnat" in n for n in names)
    assert "examples" not in record and "libnat" not in record and "fairseq/__init__.py" in record


def test_check_wheels_flags_missing_mismatched_and_duplicate_packages(tmp_path):
    _wheel(tmp_path, "hydra-core", "1.3.8", ["omegaconf<2.4,>=2.2", "antlr4-python3-runtime==4.9.*", "packaging",
                                             'importlib-resources; python_version < "3.9"'])
    _wheel(tmp_path, "omegaconf", "2.3.1", ["PyYAML>=5.1.0", 'dataclasses; python_version == "3.6"'])
    _wheel(tmp_path, "antlr4-python3-runtime", "4.9.3")
    assert gpu_check.check_wheels(tmp_path) == []  # markers for other Pythons skipped, pyyaml on the image
    _wheel(tmp_path, "tool", "1.0", ["omegaconf>=3", "not-on-the-image", 'docs-only; extra == "docs"'])
    problems = gpu_check.check_wheels(tmp_path)
    assert len(problems) == 2
    assert any("omegaconf>=3" in p and "2.3.1 is carried" in p for p in problems)
    assert any("not-on-the-image" in p and "neither carried" in p for p in problems)
    (tmp_path / "omegaconf-2.2.0-py3-none-any.whl").write_bytes((tmp_path / "omegaconf-2.3.1-py3-none-any.whl")
                                                                 .read_bytes())
    assert any("carried twice" in p for p in gpu_check.check_wheels(tmp_path))


def test_slim_checkpoint_keeps_tied_weights_shared_and_drops_the_optimizer(tmp_path):
    emb = torch.randn(500, 64)
    state = {"model": {"encoder.embed_tokens.weight": emb, "decoder.embed_tokens.weight": emb,
                       "decoder.output_projection.weight": emb, "version": torch.tensor([3])},
             "last_optimizer_state": {"big": torch.randn(1000, 64)}, "optimizer_history": [{"num_updates": 1}]}
    torch.save(state, tmp_path / "full.pt")
    before, after = gpu_check.slim_checkpoint(tmp_path / "full.pt", tmp_path / "slim.pt")
    slim = torch.load(tmp_path / "slim.pt", weights_only=False)
    assert slim["last_optimizer_state"] is None and slim["optimizer_history"] == [{"num_updates": 1}]
    w = slim["model"]["decoder.output_projection.weight"]
    assert w.dtype == torch.float16 and torch.equal(w.float(), emb.half().float())
    assert slim["model"]["version"].dtype == torch.long
    assert w.untyped_storage().data_ptr() == slim["model"]["encoder.embed_tokens.weight"].untyped_storage().data_ptr()
    assert after < 500 * 64 * 2 * 1.5 < before  # one fp16 copy of the tied table


def test_bench_config_drops_variants_and_keeps_settings(tmp_path):
    for k, c in ((5, 320), (50, 3200)):
        src = REPO / "configs" / f"engine_k{k}.json"
        kept = gpu_check.bench_config(src, tmp_path / f"k{k}.json", ["ct2"])
        assert kept == ["var-batch", "var-stream", "continuous", f"var-stream[C={c}]", f"continuous[C={c}]",
                        f"continuous[C={c},longest-first]"]
        got, want = (json.loads(p.read_text()) for p in (tmp_path / f"k{k}.json", src))
        assert {key: v for key, v in got.items() if key != "variants"} == {
            key: v for key, v in want.items() if key != "variants"}
        assert gpu_check.bench_config(src, tmp_path / "all.json") == [*kept, "ct2"]
    (tmp_path / "mixed.json").write_text(json.dumps({"beam": 5, "variants": ["fairseq,ct2,beam", "ct2",
                                                                             {"name": "x", "decoding": "beam"}]}))
    assert gpu_check.bench_config(tmp_path / "mixed.json", tmp_path / "out.json", ["ct2", "x"]) == ["fairseq", "beam"]
    assert json.loads((tmp_path / "out.json").read_text())["variants"] == ["fairseq,beam"]


def test_summary_survives_a_run_cut_off_midway(tmp_path):
    work = tmp_path / "work"
    (work / "bench-deen-k5").mkdir(parents=True)
    (work / "env.json").write_text(json.dumps({"torch": "2.11.0+cu130", "device": "cuda"}))
    (work / "stages.tsv").write_text("tests\tpytest\t1\t80\nbench\tdeen-k5\t0\t40\nbench\tdeen-k50\t124\t300\n")
    (work / "tests.xml").write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                                    '<testcase classname="tests.test_cuda" name="test_a"><failure/></testcase>'
                                    "</testsuite></testsuites>")
    (work / "bench-deen-k5" / "results.json").write_text(json.dumps({
        "sentences": 500, "device": "cuda", "settings": {"beam": 5, "batch_size": 64, "repeats": 2},
        "rows": [{"method": "fairseq", "ratio_to_baseline": 1.0, "bleu": 6.7},
                 {"method": "var-stream", "ratio_to_baseline": 0.4, "bleu": 6.6, "identical_to_exact_ref": 0.9}]}))
    (work / "bench-deen-k50").mkdir()
    (work / "bench-deen-k50" / "results.json").write_text('{"rows": [')  # cut off while writing
    (work / "step_cost_deen.json").write_text(json.dumps([{"rows": 1, "ms_per_step": 1.5},
                                                          {"rows": 64, "ms_per_step": 1.9}]))
    (work / "lean_step_big_fp16.json").write_text(json.dumps([{"rows": 320, "eager_ms": 6.1, "graph_ms": 1.2}]))
    (work / "profile_big_fp16.json").write_text(json.dumps({
        "sources": 64, "beam": 5, "rows": 320, "fp16": True, "methods": {"beam": {
            "steps": 30, "wall_ms_per_step": 9.5, "device_ms_per_step": 3.1, "sync_wait_ms_per_step": 1.2,
            "syncs_per_step": 1.0, "copies_per_step": 6.0, "top_device": [["aten::mm", 1.4]],
            "top_host": [["aten::addmm", 2.2]]}}}))
    res = gpu_check.summarize(work, tmp_path / "out")
    assert set(res["bench"]) == {"deen-k5"} and res["tests"]["failed"] == ["tests.test_cuda::test_a"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| var-stream | 6.6 |" in md and "FAILED tests.test_cuda::test_a" in md and "| ms | 1.5 | 1.9 |" in md
    short = gpu_check.short_table(res)
    assert "FAILED tests pytest (exit 1)" in short and "FAILED bench deen-k50 (exit 124)" in short
    assert "| beam | 30 | 9.5 | 3.1 | 1.2 | 1.0 | 6.0 |" in md and "device aten::mm 1.4; host aten::addmm 2.2" in md
    assert "profile_big_fp16 beam: 30 steps, 9.5 ms a step, device busy 3.1 ms, syncs 1.0" in short
    assert "| eager | 6.1 |" in md and "| graph | 1.2 |" in md and "320 rows 6.1 ms (graph 1.2)" in short
    assert (tmp_path / "out" / "gpu_check.png").stat().st_size > 0


def test_router_flags_outputs_off_the_device_and_restores_generate():
    hypos = [[{"tokens": torch.tensor([5, 2]), "score": torch.tensor(-1.0), "positional_scores": torch.zeros(2)}]]
    assert misplaced(hypos, "cpu") == []
    assert misplaced(hypos, "cuda") == [(0, 0, key, "cpu") for key in ("tokens", "score", "positional_scores")]
    d = make_dict(20)
    m = random_transformer(d, 3)
    s = make_sample(d, random_sentences(d, 4, 4))
    plain = StreamBeamGenerator([m], d, beam_size=3, max_len_b=8).generate([m], s)
    original = StreamBeamGenerator.generate
    with generate_on("cpu"):
        assert StreamBeamGenerator.generate is not original
        routed = StreamBeamGenerator([m], d, beam_size=3, max_len_b=8).generate([m], s)
    assert StreamBeamGenerator.generate is original
    assert [h[0]["tokens"].tolist() for h in routed] == [h[0]["tokens"].tolist() for h in plain]
    assert next(m.parameters()).device.type == "cpu"
