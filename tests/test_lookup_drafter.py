"""GAD with the n-gram lookup drafter (--draft-lookup): the table keeps each context's most
frequent continuation with back-off; drafts continue repeats in the output and the table; the
output equals fairseq greedy's, in streamed batches, on random models, on deen-tiny and through
fairseq-generate."""

import re

import pytest
from helpers import (
    BIN,
    N_TEST,
    REPO,
    assert_same_hypos,
    fairseq_generate,
    load_checkpoints,
    make_dict,
    make_sample,
    random_sentences,
    random_transformer,
    run_cli,
    shared_path,
)

from fairseq_streambeam.drafters.ngram_lookup import LookupDrafter, NgramTable
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.runtime.scheduler import Budget

D = make_dict(30)
PLUGIN = str(REPO / "fairseq_streambeam")
BOS = EOS = 2


def test_table_keeps_the_most_frequent_continuation_of_the_longest_context():
    t = NgramTable.from_sequences([[5, 6, 7, 2], [5, 6, 8, 2], [5, 6, 8, 2], [9, 5, 6, 7, 2]], vocab=12, bos=BOS,
                                  order=3)
    assert t.next([BOS, 5, 6]) == 8  # 8 twice, 7 once after "BOS 5 6"
    assert t.next([9, 5, 6]) == 7  # the longer context decides
    assert t.next([4, 5, 6]) == 7  # unseen: back off to "5 6" (7 and 8 twice each: the smaller id)
    assert t.next([BOS]) == 5
    assert t.next([11]) is None
    assert t.next([11, 6]) == 7  # "6" alone: 7 twice, 8 twice


def test_drafts_repeat_the_output_then_follow_the_table():
    t = NgramTable.from_sequences([[5, 6, 8, 2]], vocab=12, bos=BOS)
    d = LookupDrafter(t, bos=BOS, eos=EOS, block_size=4)
    assert d.draft([], 4) == [5, 6, 8, 2]  # from BOS alone, stopping at EOS
    assert d.draft([3, 4, 9, 3, 4], 4) == [9, 3, 4]  # "3 4" was followed by "9 3 4" earlier
    assert d.draft([11, 5, 6], 4) == [8, 2]  # "5 6" -> 8, "6 8" -> EOS
    assert d.draft([11, 10, 5], 4) == [6, 8, 2]  # "10 5" unseen: "5" alone
    assert d.draft([11, 10], 4) == []  # nothing known after "10"
    assert d.draft([5, 6], 0) == []


def test_table_errors(tmp_path):
    with pytest.raises(ValueError, match="62 bits"):
        NgramTable.from_sequences([[3, 2]], vocab=2 ** 21, bos=BOS, order=3)
    # keys are context * vocab + next: order 4 of 8008 words (8008 ** 5 > 2 ** 62) overflowed int64 silently
    with pytest.raises(ValueError, match="62 bits: lower --draft-lookup-order"):
        NgramTable.from_sequences([[3, 2]], vocab=8008, bos=BOS, order=4)
    assert NgramTable.from_sequences([[3, 2]], vocab=8008, bos=BOS, order=3).order == 3
    with pytest.raises(ValueError, match="no such file"):
        NgramTable.from_file(str(tmp_path / "none.txt"), D)
    with pytest.raises(ValueError, match="block-size"):
        LookupDrafter(NgramTable.from_sequences([[3, 2]], 30, BOS), BOS, EOS, block_size=0)


def _table_of(models, sample, **kw):
    """The model's own greedy output as the table: most drafts are right."""
    ref = fairseq_generate(models, D, sample, beam_size=1, **kw)
    return NgramTable.from_sequences([h[0]["tokens"].tolist() for h in ref], len(D), D.eos()), ref


@pytest.mark.parametrize("n", [1, 3, 12])
@pytest.mark.parametrize("own", [True, False])
def test_lookup_gad_equals_greedy(n, own):
    m = random_transformer(D, 30).double()
    s = make_sample(D, random_sentences(D, 12, 31))
    kw = dict(max_len_b=12, min_len=2, unk_penalty=0.3, len_penalty=0.8)
    table, ref = _table_of([m], s, **kw)
    if not own:  # a table of unrelated text: drafts mostly wrong
        table = NgramTable.from_sequences(random_sentences(D, 40, 32), len(D), D.eos())
    gen = AggressiveGenerator([m], D, drafter=LookupDrafter(table, D.eos(), D.eos(), 3), budget=Budget(n), **kw)
    assert_same_hypos(ref, gen.generate([m], s))
    assert gen.counters.sentences == 12
    if own:
        assert gen.counters.accepted_per_pass > 1.5


def test_deen_tiny_lookup_gad_equals_greedy(tmp_path):
    root = shared_path("models", "deen-tiny")
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root / "data-bin")
    d = task.target_dictionary
    task.load_dataset("test")
    ds = task.dataset("test")
    s = make_sample(d, [ds.src[i][:-1].tolist() for i in range(0, 3004, 300)])
    ref = fairseq_generate(models, d, s, beam_size=1)
    text = tmp_path / "table.en"  # greedy output of other sentences, as pieces
    other = make_sample(d, [ds.src[i][:-1].tolist() for i in range(7, 3004, 60)])
    text.write_text("\n".join(d.string(h[0]["tokens"]) for h in fairseq_generate(models, d, other, beam_size=1)))
    table = NgramTable.from_file(str(text), d)
    for n in (1, 4):
        gen = AggressiveGenerator(models, d, drafter=LookupDrafter(table, d.eos(), d.eos()), budget=Budget(n))
        assert_same_hypos(ref, gen.generate(models, s), msg=f"budget {n}")
        assert gen.counters.accepted_per_pass > 1


def test_lookup_gad_cli_equals_greedy(tiny_run, tmp_path):
    """fairseq-generate --decoding gad --draft-lookup prints what --decoding greedy prints."""
    data, ckpt = tiny_run

    def generate(*extra):
        r = run_cli([str(BIN / "fairseq-generate"), str(data), "--path", str(ckpt), "--user-dir", PLUGIN,
                     "--task", "streambeam_translation", "--gen-subset", "test", "--beam", "1", "--batch-size", "8",
                     "--cpu", *extra])
        assert r.returncode == 0, r.stderr[-3000:]
        hyps = {line.split("\t")[0]: line.split("\t", 1)[1] for line in r.stdout.splitlines()
                if line.startswith("H-")}
        return hyps, r.stderr

    greedy, _ = generate("--decoding", "greedy")
    assert len(greedy) == N_TEST
    table = tmp_path / "greedy.tgt"
    table.write_text("\n".join(h.split("\t")[1] for h in greedy.values()) + "\n")
    got, log = generate("--decoding", "gad", "--draft-lookup", str(table), "--block-size", "3")
    per_pass = re.search(r"([0-9.]+) tokens accepted per row and pass", log)
    assert per_pass and float(per_pass.group(1)) > 1.5, log[-2000:]  # the drafts were its own output
    assert got.keys() == greedy.keys()
    for key in got:  # float32: block verification sums in another order than one-token steps
        (s1, t1), (s2, t2) = got[key].split("\t"), greedy[key].split("\t")
        assert t1 == t2 and abs(float(s1) - float(s2)) < 1e-4, key


@pytest.mark.parametrize("content,extra,message", [
    ("w1 w2\n", ["--draft-lookup-order", "60"], "do not fit in 62 bits: lower --draft-lookup-order"),
    (b"w1 \xff\n", [], "'utf-8' codec can't decode"),
    ("\n\n", [], "no text to draft from (the file is empty)"),
])
def test_lookup_table_mistakes_are_one_line(tiny_run, tmp_path, content, extra, message):
    data, ckpt = tiny_run
    table = tmp_path / "t.txt"
    table.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = run_cli([str(BIN / "fairseq-generate"), str(data), "--path", str(ckpt), "--user-dir", PLUGIN, "--task",
                 "streambeam_translation", "--gen-subset", "test", "--beam", "1", "--cpu", "--decoding", "gad",
                 "--draft-lookup", str(table), *extra])
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and f"--draft-lookup {table}: " in errors[0] and message in errors[0], r.stderr[-2000:]


def test_a_lookup_order_too_high_is_refused_when_the_task_is_built(tmp_path):
    """The table is built with the task, before fairseq-generate loads a model: an order whose keys
    do not fit is one line then, not after minutes of loading an ensemble."""
    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.spec import UsageError
    from fairseq_streambeam.task import StreamBeamTranslationTask

    text = tmp_path / "t.txt"
    text.write_text("w1 w2\n")
    cfg = dict(train_subset="train", decoding="gad", draft_lookup=str(text))
    with pytest.raises(UsageError, match="62 bits: lower --draft-lookup-order"):
        StreamBeamTranslationTask(StreamBeamConfig(**cfg, draft_lookup_order=60), D, D)
    task = StreamBeamTranslationTask(StreamBeamConfig(**cfg, draft_lookup_order=2), D, D)
    assert len(task._drafters) == 1  # built, and kept for the generators


def test_a_rewritten_lookup_file_is_read_again(tmp_path):
    """The task reads a lookup table once per file version: a generator built after the file was
    rewritten drafts from the new text, not from the table the task read before."""
    import os

    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.spec import DecodeSpec
    from fairseq_streambeam.task import StreamBeamTranslationTask

    task = StreamBeamTranslationTask(StreamBeamConfig(train_subset="train"), D, D)
    text = tmp_path / "lookup.txt"
    text.write_text("w3 w4\n")
    spec = DecodeSpec(decoding="gad", draft_lookup=str(text))
    first = task.generator_for([random_transformer(D, 1)], spec, report_at_exit=False).drafter.table
    assert task.generator_for([random_transformer(D, 1)], spec, report_at_exit=False).drafter.table is first
    text.write_text("w3 w4\nw5 w6 w7\nw8 w9\n")
    os.utime(text, ns=(1, 1))  # another version even within the file system's time resolution
    second = task.generator_for([random_transformer(D, 1)], spec, report_at_exit=False).drafter.table
    assert second is not first and len(second.keys[0]) > len(first.keys[0])  # more one-token contexts
