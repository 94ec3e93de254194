"""Benchmark harness on the tiny trained checkpoint: every method runs, the JSON/Markdown/plots are
written, identical-output shares are computed, configs and sweeps expand, and the WMT'19
reproduction script runs offline. No timing assertions."""

import importlib.util
import json

import pytest
from helpers import BIN, REPO, run_cli

from fairseq_streambeam.bench.__main__ import DEFAULTS, variant_spec
from fairseq_streambeam.bench.__main__ import main as bench_main
from fairseq_streambeam.bench.report import PLOTS
from fairseq_streambeam.bench.variants import expand_sweep, load_config, parse_methods
from fairseq_streambeam.spec import UsageError

ALL = "fairseq,fairseq-greedy,beam,greedy,var-batch,var-stream,fifo,fixed-stream"


def _bench(tiny_run, tmp_path, *extra):
    data, ckpt = tiny_run
    return bench_main(["--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt", "--post-process", "none",
                       "--out", str(tmp_path), "--quiet", "--limit", "20", *extra])


def test_every_method_runs_and_reports(tiny_run, tmp_path):
    rows = _bench(tiny_run, tmp_path, "--methods", ALL, "--repeats", "2", "--beam", "4", "--batch-size", "6")
    by = {r["method"]: r for r in rows}
    assert list(by) == ALL.split(",")
    # exactness shows up in the report: beam and fixed-stream print fairseq's output
    assert by["beam"]["identical_to_exact_ref"] == 1.0
    assert by["fixed-stream"]["identical_to_exact_ref"] == 1.0
    assert by["fairseq"]["identical_to_exact_ref"] == 1.0
    assert by["greedy"]["bleu"] == by["fairseq-greedy"]["bleu"]
    assert by["var-stream"]["bleu"] == by["var-batch"]["bleu"] == by["fifo"]["bleu"]
    for r in rows:
        assert r["seconds_median"] > 0 and r["ratio_to_baseline"] > 0 and r["peak_mb"] > 0
        assert r["warmup_seconds"] > 0  # each method's first batch, decoded before the timed repeats
    assert by["var-stream"]["expansions"] == by["var-batch"]["expansions"]
    assert 0 <= by["var-stream"]["padding_share"] < 1
    assert by["fairseq"]["decoder_steps"] is None  # fairseq's generator has no counters

    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["sentences"] == 20 and doc["threads"] == 1 and len(doc["rows"]) == len(rows)
    assert set(doc["step_traces"]) >= {"beam", "var-stream"}
    md = (tmp_path / "results.md").read_text().split("\n\n")  # the setting, the machine, the table
    assert md[0].startswith("20 sentences of ") and ", k = 4, batches of 6 sentences, " in md[0]
    assert "fairseq-streambeam 0." in md[0]
    assert md[1].startswith("threads: torch=1 ") and md[2].startswith("| method | BLEU |")
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "step_time_vs_length.png").stat().st_size > 0
        assert (tmp_path / "time_vs_bleu.png").stat().st_size > 0


def test_ctranslate2_runs_and_matches_fairseq_on_a_real_model(tiny_run, tmp_path):
    """ct2 runs through the harness; on deen-tiny (real weights, few near-ties) its beam output is
    fairseq's. The 30-update tiny model has near-ties, where different kernels may flip a choice."""
    pytest.importorskip("ctranslate2")
    from helpers import shared_path

    rows = _bench(tiny_run, tmp_path / "tiny", "--methods", "fairseq,ct2", "--exact-ref", "fairseq", "--no-plots")
    assert rows[1]["method"] == "ct2" and rows[1]["identical_to_exact_ref"] > 0.5
    root = shared_path("models", "deen-tiny")
    rows = bench_main(["--data", str(root / "data-bin"), "--path", str(root / "checkpoint_best.pt"), "-s", "de",
                       "-t", "en", "--out", str(tmp_path / "deen"), "--quiet", "--limit", "40", "--methods",
                       "fairseq,ct2", "--exact-ref", "fairseq", "--no-plots"])
    assert rows[1]["identical_to_exact_ref"] >= 0.95


def test_fp16_decodes_half_models_and_is_recorded(tiny_run, tmp_path, monkeypatch):
    """--fp16 halves the models every method decodes (fairseq's generator too), as
    fairseq-generate --fp16 does; results.json records it, and beam still prints fairseq's output.
    ct2 runs too (it refused float16 on a CPU, after the models had loaded)."""
    from helpers import spy_loaded_dtypes

    dtypes = spy_loaded_dtypes(monkeypatch)
    ct2 = ",ct2" if importlib.util.find_spec("ctranslate2") else ""  # float32 on a CPU (it has no float16 there)
    rows = _bench(tiny_run, tmp_path, "--methods", "fairseq,beam" + ct2, "--exact-ref", "fairseq", "--fp16",
                  "--no-plots")
    assert dtypes == ["torch.float16"]
    assert rows[1]["identical_to_exact_ref"] == 1.0 and len(rows) == 2 + bool(ct2)
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["fp16"] is True


def test_aggressive_methods_in_the_harness(tiny_run, tiny_drafter, tmp_path):
    """iad, gad and the GAD++ sweep of configs/gad_sweep.json run through the harness and report
    accepted tokens per pass and block padding."""
    drafter, _ = tiny_drafter
    rows = _bench(tiny_run, tmp_path, "--config", str(REPO / "configs" / "gad_sweep.json"), "--drafter", str(drafter),
                  "--no-plots")
    rows += _bench(tiny_run, tmp_path / "iad", "--methods", "fairseq-greedy,iad,gad-oracle,no-draft", "--beam", "1",
                   "--batch-size", "4", "--baseline", "fairseq-greedy", "--exact-ref", "fairseq-greedy", "--no-plots")
    by = {r["method"]: r for r in rows}
    assert {"gad", "gad[block_size=4]", "gad[gad_beta=3,gad_tau=1.0]", "iad", "gad-oracle"} <= set(by)
    for name in ("gad", "gad[block_size=4]", "iad", "gad-oracle"):  # = greedy; float32 near-ties could flip one
        assert by[name]["identical_to_exact_ref"] >= 0.95, name
        assert by[name]["accepted_per_pass"] >= 1 and 0 <= by[name]["padding_share"] < 1
    # the oracle drafts greedy's output: whole outputs (at most 8 drafts + 1) are accepted per pass
    assert by["gad-oracle"]["accepted_per_pass"] > by["iad"]["accepted_per_pass"]
    # without drafts the generator decodes greedily, one token per row and pass
    assert by["no-draft"]["identical_to_exact_ref"] >= 0.95 and by["no-draft"]["accepted_per_pass"] == 1.0
    with pytest.raises(UsageError, match="the gad methods need --drafter"):
        _bench(tiny_run, tmp_path / "x", "--methods", "gad", "--beam", "1")  # no --drafter


def test_lookup_drafter_in_the_harness(tiny_run, tmp_path):
    """configs/gad_lookup.json: gad-lookup drafts from an n-gram table of target-side text."""
    data, _ = tiny_run
    rows = _bench(tiny_run, tmp_path, "--config", str(REPO / "configs" / "gad_lookup.json"), "--no-plots",
                  "--draft-lookup", str(data.parent / "train.tgt"))
    by = {r["method"]: r for r in rows}
    assert {"gad-lookup", "gad-lookup[draft_switch=false]", "no-draft"} <= set(by)
    for name in ("gad-lookup", "gad-lookup[draft_switch=false]"):
        assert by[name]["identical_to_exact_ref"] >= 0.95 and by[name]["accepted_per_pass"] >= 1, name
    with pytest.raises(UsageError, match="the gad-lookup methods need --draft-lookup"):
        _bench(tiny_run, tmp_path / "x", "--methods", "gad-lookup", "--beam", "1")  # no --draft-lookup


def test_limit_takes_sentences_spread_over_the_set():
    from fairseq_streambeam.bench.data import _every

    for n, limit in ((3004, 2000), (1000, 400), (3004, 300), (7, 7)):
        keep = _every(n, limit)
        assert len(keep) == limit == len(set(keep)) and keep[0] == 0 and keep[-1] >= n - n // limit - 1
    assert _every(100, 5, (50, 100)) == [50, 60, 70, 80, 90]


def test_each_method_batches_as_it_would_alone(tiny_run, tmp_path):
    """Every pass batches by its own method's options (streaming windows or fairseq's batches),
    whichever method's generator the shared task built last: decoder steps as in a run of its own."""
    args = ("--beam", "4", "--batch-size", "4", "--limit", "61")
    alone = {m: _bench(tiny_run, tmp_path, "--methods", m, *args)[0]["decoder_steps"]
             for m in ("beam", "var-batch", "var-stream")}
    assert alone["var-stream"] < alone["var-batch"]  # windows refill: the batching shows in the steps
    for methods in ("beam,var-stream", "fairseq,var-stream,beam,var-batch"):
        for row in _bench(tiny_run, tmp_path, "--methods", methods, *args):
            if row["method"] != "fairseq":
                assert row["decoder_steps"] == alone[row["method"]], (methods, row["method"])


def test_warm_up_is_one_batch_for_every_method(tiny_run):
    """The untimed first batch is one batch of sentences also for the streaming methods, whose
    generator would otherwise decode a whole window of batches."""
    from tqdm import tqdm

    from fairseq_streambeam.bench import data as bench_data
    from fairseq_streambeam.bench.__main__ import parse_args as bench_args
    from fairseq_streambeam.bench.__main__ import resolve, run_variant
    from fairseq_streambeam.loader import load_models, load_task

    data, ckpt = tiny_run
    settings, variants = resolve(bench_args(["--data", str(data), "--path", str(ckpt), "-s", "src", "-t", "tgt",
                                             "--methods", "beam,var-stream", "--batch-size", "6"]))
    task = load_task(str(data), "src", "tgt")
    models = load_models(task, str(ckpt))
    ts = bench_data.from_data_bin(task, "test", 20, "none")
    for v in variants:
        hyps, _ = run_variant(task, models, v, settings, ts, tqdm(disable=True), False, first_batch=True)
        assert len(hyps) == 6, v.name
        hyps, _ = run_variant(task, models, v, settings, ts, tqdm(disable=True), False)
        assert len(hyps) == 20, v.name


def test_configs_and_sweeps_expand():
    for path in sorted((REPO / "configs").glob("*.json")):
        settings, variants = load_config(str(path))
        assert variants and set(settings) <= set(DEFAULTS), path.name
        for v in variants:  # each variant's options are a valid spec (ct2 is CTranslate2's, not a spec)
            if v.decoding != "ct2":
                variant_spec(v, {**DEFAULTS, **settings}, lmbr_file="posteriors.jsonl" if v.lmbr else None)
    _, variants = load_config(str(REPO / "configs" / "table5_sweep.json"))
    assert len(variants) == 2 + 4 * 3
    pts = expand_sweep({"decoding": "var-stream", "delta": [1.0, 2.0], "refill_eps": [0.1, 0.5]})
    assert [(v.delta, v.refill_eps) for v in pts] == [(1.0, 0.1), (1.0, 0.5), (2.0, 0.1), (2.0, 0.5)]
    _, variants = load_config(str(REPO / "configs" / "gad_lookup_sweep.json"))  # a named sweep
    swept = [v for v in variants if v.gad_beta]
    assert [v.name for v in swept[:2]] == ["gad-lookup[gad_beta=3,gad_tau=1.0]", "gad-lookup[gad_beta=3,gad_tau=3.0]"]
    assert len(swept) == 4 and all(v.lookup and v.decoding == "gad" for v in swept)
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("beam,nope")


def test_a_config_naming_two_variants_alike_is_refused(tmp_path):
    """A method's name keys its generator: a second variant of that name would be decoded by the
    first one's generator, and its times merged into that row."""
    from fairseq_streambeam.bench.__main__ import parse_args, resolve

    cfg = tmp_path / "twice.json"
    cfg.write_text('{"variants": ["beam", {"name": "beam", "decoding": "greedy"}]}')
    with pytest.raises(UsageError, match="^methods named more than once: beam "):
        resolve(parse_args(["--data", "d", "--path", "p", "-s", "src", "-t", "tgt", "--config", str(cfg)]))


def test_sweep_config_runs(tiny_run, tmp_path):
    cfg = tmp_path / "sweep.json"
    cfg.write_text(json.dumps({"beam": 3, "batch_size": 4, "baseline": "var-batch", "exact_ref": "var-batch",
                               "variants": ["var-batch"],
                               "sweep": {"decoding": "var-stream", "refill_eps": [0.1, 0.9]}}))
    rows = _bench(tiny_run, tmp_path, "--config", str(cfg), "--no-plots")
    assert [r["method"] for r in rows] == ["var-batch", "var-stream[refill_eps=0.1]", "var-stream[refill_eps=0.9]"]
    assert all(r["identical_to_exact_ref"] == 1.0 for r in rows)  # eps changes speed, never output


def test_no_plots_leaves_no_other_runs_plots(tiny_run, tmp_path):
    """A reused --out: under --no-plots the results stand alone, not beside an earlier run's plots."""
    for name in PLOTS:
        (tmp_path / name).write_bytes(b"an earlier run's plot")
    _bench(tiny_run, tmp_path, "--methods", "beam", "--baseline", "beam", "--exact-ref", "beam", "--no-plots")
    assert (tmp_path / "results.md").exists() and not any((tmp_path / name).exists() for name in PLOTS)


def test_reproduce_script_offline(tiny_run, tmp_path):
    data, ckpt = tiny_run
    raw = data.parent
    r = run_cli(["bash", str(REPO / "scripts" / "reproduce_wmt19.sh"), "--pair", "src-tgt", "--model-dir", str(data),
                 "--checkpoints", str(ckpt), "--src", str(raw / "test.src"), "--ref", str(raw / "test.tgt"),
                 "--tokenizer", "none", "--bpe", "none", "--config", str(REPO / "configs" / "paper_k5.json"),
                 "--repeats", "2", "--out", str(tmp_path), "--", "--limit", "12", "--quiet", "--no-plots"],
                cwd=str(tmp_path), env_extra={"PYTHON": str(BIN / "python")})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [row["method"] for row in doc["rows"]] == ["greedy", "beam", "var-batch", "var-stream"]
    assert doc["settings"]["repeats"] == 2 and doc["settings"]["max_tokens"] == 1000
    assert all(row["seconds_std"] >= 0 for row in doc["rows"])


@pytest.mark.parametrize("pair,model", [("de-en", "deen-tiny"), ("ru-en", "ruen-tiny")])
def test_reproduce_script_offline_on_real_models(pair, model, tmp_path):
    """The offline reproduction for both pairs on the small real models and raw newstest2017 text
    (sentencepiece instead of Moses + fastBPE), a few sentences."""
    from helpers import shared_path

    root = shared_path("models", model)
    src, tgt = pair.split("-")
    data = shared_path("data", "wmt", pair)
    r = run_cli(["bash", str(REPO / "scripts" / "reproduce_wmt19.sh"), "--pair", pair, "--model-dir", str(root),
                 "--checkpoints", "checkpoint_best.pt", "--src", str(data / f"newstest2017.{src}"),
                 "--ref", str(data / f"newstest2017.{tgt}"), "--tokenizer", "none", "--bpe", "sentencepiece",
                 "--config", str(REPO / "configs" / "paper_k5.json"), "--repeats", "1", "--out", str(tmp_path),
                 "--", "--sentencepiece-model", str(root / "spm8k.model"), "--limit", "8", "--quiet", "--no-plots"],
                cwd=str(tmp_path), env_extra={"PYTHON": str(BIN / "python")})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    by = {row["method"]: row for row in doc["rows"]}
    assert list(by) == ["greedy", "beam", "var-batch", "var-stream"] and doc["sentences"] == 8
    assert by["beam"]["identical_to_exact_ref"] == 1.0
    assert by["var-stream"]["bleu"] == by["var-batch"]["bleu"]
    assert by["var-stream"]["expansions"] == by["var-batch"]["expansions"]
    assert by["var-batch"]["expansions"] < by["beam"]["expansions"]  # pruned beams
    assert all(row["chrf"] > 20 for row in doc["rows"])  # detokenized English, not pieces or unk


def test_corpus_order_batches_consecutive_sentences(tiny_run, tmp_path):
    """--corpus-order: each batch holds consecutive sentences (fairseq sorts by length first); the
    outputs do not depend on the batching."""
    import argparse

    import torch
    from fairseq.data import LanguagePairDataset
    from fairseq.tasks import FairseqTask
    from helpers import make_dict

    from fairseq_streambeam.bench.data import CorpusOrder

    d = make_dict(20)
    src = [torch.tensor([5] * n + [d.eos()]) for n in [7, 1, 5, 3, 9, 2, 4]]
    ds = LanguagePairDataset(src, [len(s) for s in src], d)
    task = FairseqTask(argparse.Namespace())

    def batches(dataset):
        itr = task.get_batch_iterator(dataset, max_sentences=3, disable_iterator_cache=True)
        return [set(b["id"].tolist()) for b in itr.next_epoch_itr(shuffle=False)]

    assert batches(CorpusOrder(ds)) == [{0, 1, 2}, {3, 4, 5}, {6}]
    assert batches(ds) != batches(CorpusOrder(ds))  # fairseq's length-sorted batches differ

    rows = _bench(tiny_run, tmp_path, "--methods", "fairseq-greedy,greedy,iad", "--beam", "1", "--batch-size", "4",
                  "--corpus-order", "--baseline", "fairseq-greedy", "--exact-ref", "fairseq-greedy", "--no-plots")
    assert rows[1]["identical_to_exact_ref"] == 1.0
    assert rows[2]["identical_to_exact_ref"] >= 0.95  # float32 near-ties could flip one (tiny model)
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["corpus_order"] is True


@pytest.mark.parametrize("decoding", ["var-stream", "iad"])
def test_task_batches_like_fairseq_when_split_across_workers_or_unlimited(decoding):
    """fairseq splits a set across workers by whole batches: streaming windows would give one
    worker whole windows and another nothing. A batch size of 0 is no limit, as in fairseq."""
    import torch
    from fairseq.data import LanguagePairDataset
    from fairseq.tasks.translation import TranslationConfig, TranslationTask
    from helpers import make_dict

    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.task import StreamBeamTranslationTask

    d = make_dict(20)
    src = [torch.tensor([5] * (1 + i % 9) + [d.eos()]) for i in range(40)]
    ds = LanguagePairDataset(src, [len(s) for s in src], d)
    ours = StreamBeamTranslationTask(StreamBeamConfig(train_subset="train", decoding=decoding), d, d)
    stock = TranslationTask(TranslationConfig(), d, d)

    def ids(task, **kw):
        itr = task.get_batch_iterator(ds, disable_iterator_cache=True, required_batch_size_multiple=1, **kw)
        return [sorted(b["id"].tolist()) for b in itr.next_epoch_itr(shuffle=False) if b]

    for rank in (0, 1):
        kw = dict(max_sentences=4, num_shards=2, shard_id=rank)
        assert ids(ours, **kw) == ids(stock, **kw) != []
    assert ids(ours, max_sentences=0) == ids(stock, max_sentences=0)
    assert ours.budget_for(ours.spec).max_sentences == 64  # the default live budget


@pytest.mark.parametrize("extra,message", [
    (["--methods", "nosuch"], "--methods: unknown method 'nosuch'"),
    (["--config", "{tmp}/none.json"], "--config {tmp}/none.json: No such file or directory"),
    (["--config", "{tmp}/bad.json"], "--config {tmp}/bad.json: Expecting property name"),
    (["--path", "{tmp}/none.pt"], "--path {tmp}/none.pt: no such checkpoint"),
    (["--path", "{tmp}"], "--path {tmp}: not a regular file; name the checkpoint file in it"),
    (["-t", "fr"], "--data {data}: no dict.fr.txt there"),
    (["--methods", "gad"], "the gad methods need --drafter"),
    (["--gen-subset", "nosuch"], "--gen-subset nosuch: Dataset not found"),
    (["--methods", "beam,greedy,beam"], "methods named more than once: beam"),
    (["--baseline", "var-stream"], "--baseline var-stream: not one of the methods run (beam)"),
    (["--exact-ref", "nope"], "--exact-ref nope: not one of the methods run (beam)"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--methods", "var-stream", "--refill-eps", "2"], "--refill-eps must be in [0, 1], got 2.0 (method var-stream)"),
    (["--methods", "var-stream+lmbr", "--lmbr-posteriors", "{tmp}/none.jsonl"], "--lmbr-posteriors {tmp}/none.jsonl"),
    (["--out", "{tmp}/bad.json"], "--out {tmp}/bad.json: not a directory"),
])
def test_usage_mistakes_are_one_line(tiny_run, tmp_path, extra, message):
    """Each was a traceback (ValueError, FileNotFoundError, OSError from fairseq's loader)."""
    (tmp_path / "bad.json").write_text("{beam: 5}")
    extra = [x.format(tmp=tmp_path) for x in extra]
    with pytest.raises(UsageError) as e:
        _bench(tiny_run, tmp_path / "out", "--methods", "beam", *extra)
    assert str(e.value).startswith(message.format(tmp=tmp_path, data=tiny_run[0])) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() or "gen-subset" in extra[0]


def test_an_option_a_decoding_refuses_is_one_line_from_the_command(tiny_run, tmp_path):
    data, ckpt = tiny_run
    r = run_cli([str(BIN / "python"), "-m", "fairseq_streambeam.bench", "--data", str(data), "--path", str(ckpt),
                 "-s", "src", "-t", "tgt", "--out", str(tmp_path), "--quiet", "--limit", "2", "--methods", "beam",
                 "--beam", "0"], cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == ("python -m fairseq_streambeam.bench: error: --beam must be >= 1, "
                                                 "got 0 (method beam)")


def test_generators_sharing_a_task_keep_their_own_candidate_budget():
    """The task's batching gives the live sources and tokens; each generator keeps the candidate
    budget of its own spec, whichever spec the task batched by or built last."""
    import torch
    from fairseq.data import LanguagePairDataset
    from helpers import make_dict, random_transformer

    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.runtime.scheduler import Budget
    from fairseq_streambeam.spec import DecodeSpec
    from fairseq_streambeam.task import StreamBeamTranslationTask

    d = make_dict(20)
    src = [torch.tensor([5] * (1 + i % 9) + [d.eos()]) for i in range(12)]
    ds = LanguagePairDataset(src, [len(s) for s in src], d)
    task = StreamBeamTranslationTask(StreamBeamConfig(train_subset="train", decoding="var-stream"), d, d)
    models = [random_transformer(d, 1)]
    sample = next(iter(task.get_batch_iterator(ds, max_sentences=6, disable_iterator_cache=True)
                       .next_epoch_itr(shuffle=False)))
    budgeted = task.generator_for(models, DecodeSpec(decoding="var-stream", beam_size=3, stream_candidates=40),
                                  report_at_exit=False)
    plain = task.generator_for(models, DecodeSpec(decoding="var-stream", beam_size=3), report_at_exit=False)
    assert budgeted.scheduler.budget == Budget(6, None, 40)  # built after the batching
    for gen, c in ((budgeted, 40), (plain, None), (budgeted, 40)):
        task.inference_step(gen, models, sample)
        assert gen.scheduler.budget == Budget(6, None, c)
