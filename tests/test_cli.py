"""Invariant 4 end to end: through `fairseq-generate --user-dir`, every input id answers exactly
once, whatever the decoding, batch size and window; `--decoding beam` prints what fairseq prints."""

import json
import re

import pytest
from helpers import BIN, N_TEST, REPO
from helpers import run_cli as _run


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
    ("var-stream", ["--max-tokens", "40", "--refill-eps", "0.5", "--stream-order", "min-length"]),
    ("fixed-stream", ["--batch-size", "4", "--stream-window", "100", "--max-wait-steps", "3"]),
    ("var-stream", ["--batch-size", "5", "--stream-order", "continuous", "--stream-admit", "longest-first"]),
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
        return sorted((x.split("\t") for x in out.splitlines() if re.match(r"^[HPD]-\d+\t", x)),
                      key=lambda fields: fields[0])  # by line kind and id; a sentence's hypotheses in printed order

    # the same lines, with the same tokens; scores to float32 rounding (our decoder step multiplies
    # in other shapes than fairseq's, so the last bits of a score may differ)
    got, want = lines(ours.stdout), lines(ref.stdout)
    assert len(got) == len(want) and len(want) > 0
    for a, b in zip(got, want):
        assert a[0] == b[0] and a[2:] == b[2:], (a, b)
        scores = (a[1].split(), b[1].split())
        assert len(scores[0]) == len(scores[1]), (a, b)
        assert all(abs(float(x) - float(y)) <= 1e-5 for x, y in zip(*scores)), (a, b)


def test_contradictory_flags_are_rejected(tiny_run):
    """One line on stderr, exit status 2, no traceback (the checks run when fairseq parses)."""
    for flags, text in ((["--decoding", "var-stream", "--sampling", "--beam", "1"], "does not support --sampling"),
                        (["--decoding", "beam", "--prune-abs-threshold", "1.0"], "applies to var-batch")):
        r = generate(tiny_run, *flags, "--batch-size", "4")
        errors = [x for x in r.stderr.splitlines() if "error:" in x]
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert len(errors) == 1 and text in errors[0], r.stderr[-2000:]


@pytest.mark.parametrize("decoding", ["beam", "var-stream", "iad", "fairseq"])
def test_max_tokens_below_a_sentence_is_one_line(tiny_run, decoding):
    """fairseq's batching asserts in Cython (a traceback), and streaming windows scaled the limit past
    the sentence and decoded it: every decoding now stops in one line naming the sentence."""
    r = generate(tiny_run, "--decoding", decoding, "--beam", "1" if decoding == "iad" else "3", "--max-tokens", "3")
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and "--max-tokens 3 is below the" in errors[0], r.stderr[-2000:]


def test_fairseq_interactive(tiny_run):
    data, ckpt = tiny_run
    r = _run([str(BIN / "fairseq-interactive"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"),
              "--task", "streambeam_translation", "--path", str(ckpt), "-s", "src", "-t", "tgt", "--cpu",
              "--beam", "4", "--decoding", "var-stream", "--batch-size", "2", "--buffer-size", "3"],
             input="w1 w2 w3\nw4\n\nw5 w6\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(int(i) for i in re.findall(r"^H-(\d+)\t", r.stdout, re.M)) == [0, 1, 2, 3]


@pytest.mark.parametrize("flag", ["--lmbr-posteriors", "--token-masks"])
def test_fairseq_interactive_refuses_files_keyed_by_sentence_id(tiny_run, tmp_path, flag):
    """fairseq-interactive numbers its lines itself: id-keyed files would score the wrong sentences."""
    data, ckpt = tiny_run
    keyed = tmp_path / "keyed.jsonl"
    keyed.write_text("")
    r = _run([str(BIN / "fairseq-interactive"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"),
              "--task", "streambeam_translation", "--path", str(ckpt), "-s", "src", "-t", "tgt", "--cpu",
              "--beam", "4", "--decoding", "var-stream", flag, str(keyed)], input="w1 w2\n")
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and flag in errors[0] and "fairseq-generate" in errors[0], r.stderr[-2000:]


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


def test_hub_keys_token_masks_by_place_in_the_list_and_generators_take_its_batches(tiny_run, tmp_path):
    """The README's two claims about the hub: --token-masks (and posteriors) key a sentence by its
    place in the list given to translate(); a StreamBeamGenerator decodes a batch built as the hub
    builds one, with the hub's own output."""
    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import Budget, StreamBeamGenerator, attach_to_hub

    data, ckpt = tiny_run
    hub = TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                           source_lang="src", target_lang="tgt")
    sents = ["w1 w2 w3", "w4 w5"]
    attach_to_hub(hub, decoding="beam")
    plain = hub.translate(sents, beam=4)
    first = plain[0].split()[0]
    masks = tmp_path / "masks.jsonl"
    masks.write_text(json.dumps({"id": 0, "ban": [hub.tgt_dict.index(first)]}) + "\n")
    attach_to_hub(hub, decoding="beam", token_masks=str(masks))
    masked = hub.translate(sents, beam=4)
    assert masked[0].split()[0] != first and masked[1] == plain[1]  # id 0: the list's first sentence
    assert hub.translate(sents[::-1], beam=4)[1] == plain[0]  # second in the list: no record, no mask

    attach_to_hub(hub, decoding="var-stream")
    tokens = [hub.encode(x) for x in sents]
    ds = hub.task.build_dataset_for_inference(tokens, [len(t) for t in tokens])
    sample = ds.collater([ds[i] for i in range(len(ds))])
    gen = StreamBeamGenerator(hub.models, hub.tgt_dict, beam_size=4, decoding="var-stream", budget=Budget(64))
    got = {int(i): h[0]["tokens"].tolist() for i, h in zip(sample["id"], gen.generate(hub.models, sample))}
    ref = [h[0]["tokens"].tolist() for h in hub.generate(tokens, beam=4)]
    assert [got[i] for i in range(len(sents))] == ref


def test_hub_refuses_plugin_options_given_to_translate(tiny_run):
    """fairseq's hub passes translate()'s keywords as generation options; the plugin's options are
    the task's (attach_to_hub), so a different value there would be ignored: it is refused."""
    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import attach_to_hub
    from fairseq_streambeam.spec import UsageError

    data, ckpt = tiny_run
    hub = attach_to_hub(TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                                         source_lang="src", target_lang="tgt"), decoding="var-stream")
    with pytest.raises(UsageError, match=r"^decoding='greedy', finish_count=1: the plugin's options are the task's"):
        hub.translate(["w1 w2"], beam=4, decoding="greedy", finish_count=1)
    assert hub.translate(["w1 w2"], beam=4, decoding="var-stream") == hub.translate(["w1 w2"], beam=4)


def test_hub_translate_calls_share_one_counters_report(tiny_run, monkeypatch):
    """Each `translate` builds a generator: the task logs them at exit as one line per decoding,
    with the counts of generators already collected, and keeps none of them alive."""
    import atexit
    import gc

    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import attach_to_hub

    hooks = []
    monkeypatch.setattr(atexit, "register", lambda f, *a, **k: hooks.append(f))
    data, ckpt = tiny_run
    hub = attach_to_hub(TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                                         source_lang="src", target_lang="tgt"), decoding="var-stream")
    for _ in range(3):
        hub.translate(["w1 w2 w3", "w4"], beam=4)
    gc.collect()
    report = hub.task._run_report
    ours = [h for h in hooks if type(getattr(h, "__self__", None)).__name__ == "RunReport"]
    assert ours == [report.report] and len(report.live) <= 1  # one hook; spent generators are not kept
    totals = report.totals()
    assert list(totals) == ["var-stream"] and totals["var-stream"].sentences == 6


def test_hub_reattached_starts_from_the_plugin_defaults(tiny_run, tmp_path):
    """Each attach_to_hub is a new command line: an option of the previous decoding (gad's lookup
    table, var-stream's threshold) does not stay behind and get refused by the next."""
    from fairseq.models.transformer import TransformerModel

    from fairseq_streambeam import attach_to_hub

    data, ckpt = tiny_run
    hub = TransformerModel.from_pretrained(str(ckpt.parent), ckpt.name, data_name_or_path=str(data),
                                           source_lang="src", target_lang="tgt")
    sents = ["w1 w2 w3", "w4"]
    greedy = hub.translate(sents, beam=1)
    ref = hub.translate(sents, beam=4)
    lookup = tmp_path / "targets.txt"
    lookup.write_text("w1 w2 w3 w4\n")
    attach_to_hub(hub, decoding="gad", draft_lookup=str(lookup))
    assert hub.translate(sents, beam=1) == greedy
    attach_to_hub(hub, decoding="beam")
    assert hub.task.spec.draft_lookup is None and hub.translate(sents, beam=4) == ref
    attach_to_hub(hub, decoding="var-stream", prune_abs_threshold=1.0)
    attach_to_hub(hub, decoding="beam")
    assert hub.translate(sents, beam=4) == ref


def test_interactive_line_longer_than_the_models_positions_is_one_line():
    """fairseq raised a bare Exception from its size filter (a traceback) for every decoding."""
    from helpers import shared_path

    m = shared_path("models", "deen-tiny")
    r = _run([str(BIN / "streambeam-interactive"), str(m), "--path", str(m / "checkpoint_best.pt"), "-s", "de",
              "-t", "en", "--bpe", "sentencepiece", "--sentencepiece-model", str(m / "spm8k.model"), "--cpu",
              "--decoding", "var-stream"], input=" ".join(["Haus"] * 1500) + "\n")
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and "more than the model's positions" in errors[0], r.stderr[-2000:]
    assert 'sentence 0 ("\u2581Haus \u2581Haus' in errors[0]  # its first words find the line
