"""The offline demo: synthetic task, a short fairseq training run, the side-by-side table."""

from fairseq_streambeam.demo import main as demo_main


def test_demo_runs_offline(tmp_path, capsys):
    rows = demo_main(["--workdir", str(tmp_path), "--train-pairs", "600", "--test-pairs", "40", "--max-update", "40",
                      "--beam", "4"])
    out = capsys.readouterr().out
    assert [r["method"] for r in rows] == ["fairseq-greedy", "fairseq", "beam", "var-batch", "var-stream"]
    assert "| method | BLEU |" in out and "Real numbers need real models" in out
    by = {r["method"]: r for r in rows}
    assert by["beam"]["identical_to_exact_ref"] == 1.0 and by["fairseq"]["identical_to_exact_ref"] == 1.0
    assert by["var-stream"]["bleu"] == by["var-batch"]["bleu"]
    assert f"are in {tmp_path}" in out and (tmp_path / "bench" / "results.md").exists()  # kept: --workdir
