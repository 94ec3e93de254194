"""Online decoding (generators/online.py): sources added between steps get exactly the output offline
decoding gives them (float64 models, so batch composition cannot move a token;
scores are kept in float32), for every beam
decoding and for aggressive decoding; waiting sources can be dropped; bad sources are refused."""

import pytest
import torch
from helpers import assert_same_hypos, make_dict, make_sample, ours, random_sentences, random_transformer

from fairseq_streambeam import Budget
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.generators.online import OnlineDecoder
from fairseq_streambeam.generators.stream_beam import StreamBeamGenerator

D = make_dict(30)
MODELS = [random_transformer(D, 31).double(), random_transformer(D, 32, eos_bias=3.0).double()]
SENTS = random_sentences(D, 12, 33, min_len=1, max_len=14)
KW = dict(beam_size=5, max_len_b=14, len_penalty=0.8, nbest=5)


def _offline(generate):
    """Offline decoding of SENTS as one fairseq batch (length-sorted), answers in SENTS order."""
    sample = make_sample(D, SENTS)
    out = generate(sample)
    by_id = dict(zip(sample["id"].tolist(), out))
    return [by_id[i] for i in range(len(SENTS))]


def _online(gen, arrivals):
    """Decode SENTS online: `arrivals[i]` sources are added before step i (the rest at the end);
    returns the hypotheses in SENTS order and the largest number of sources live at once."""
    dec = OnlineDecoder(gen)
    rows, out, pending, step, peak = [], {}, list(SENTS), 0, 0
    while pending or dec.busy:
        n = arrivals[step] if step < len(arrivals) else len(pending)
        for s in pending[:n]:
            rows.append(dec.add(s + [D.eos()]))
        pending = pending[n:]
        out.update(dec.step())
        peak = max(peak, dec.live_sources)
        step += 1
    assert dec.waiting == 0 and not dec.busy and len(dec.srcs) == 0  # answered sources are forgotten
    return [out[r] for r in rows], peak


@pytest.mark.parametrize("decoding,extra", [
    ("beam", {}), ("var-batch", dict(prune_abs_threshold=1.2, prune_max_cands=3)),
    ("var-stream", dict(prune_abs_threshold=1.2, prune_max_cands=3)),
    ("var-stream", dict(prune_abs_threshold=1.2, stream_order="continuous")), ("greedy", {})])
def test_online_equals_offline(decoding, extra):
    kw = dict(KW, decoding=decoding, **extra)
    if decoding == "greedy":
        kw.update(beam_size=1, nbest=1)
    offline = _offline(lambda sample: ours(MODELS, D, sample, **kw)[0])
    # one source every step, then bursts: sources join cohorts at every stage of their decoding
    gen = StreamBeamGenerator(MODELS, D, budget=Budget(max_sentences=4), **kw)
    online, peak = _online(gen, [1, 0, 1, 3, 0, 0, 2, 1])
    assert peak > 1  # sources really were decoded together
    assert_same_hypos(online, offline, atol=1e-5, msg=decoding)


@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_online_alignment_equals_offline(kind):
    """Each source's alignment (over its own tokens) is the one offline decoding prints for it."""
    kw = dict(KW, decoding="var-stream", prune_abs_threshold=1.2, print_alignment=kind)
    offline = _offline(lambda sample: ours(MODELS, D, sample, **kw)[0])
    gen = StreamBeamGenerator(MODELS, D, budget=Budget(max_sentences=4), **kw)
    online, _ = _online(gen, [1, 0, 1, 3, 0, 0, 2, 1])
    assert_same_hypos(online, offline, atol=1e-5, msg=kind)
    for i, (got, ref) in enumerate(zip(online, offline)):
        for g, r in zip(got, ref):
            assert g["alignment"] == r["alignment"], (kind, i)
            n = len(SENTS[i]) + 1  # offline attention is in the left-padded batch's layout
            assert torch.allclose(g["attention"], r["attention"][-n:], atol=1e-6), (kind, i)
    assert any(len(h["alignment"]) for hypos in online for h in hypos)


def test_online_aggressive_equals_offline():
    models = [MODELS[0]]
    ref = AggressiveGenerator(models, D, decoding="iad", max_len_b=14)
    offline = _offline(lambda sample: ref.generate(models, sample))
    gen = AggressiveGenerator(models, D, decoding="iad", max_len_b=14, budget=Budget(max_sentences=3))
    online, _ = _online(gen, [2, 0, 1, 0, 4])
    assert_same_hypos(online, offline, atol=1e-5, msg="iad")


@pytest.mark.parametrize("decoding", ["beam", "var-stream", "iad"])
def test_online_reads_the_models_as_they_are_when_built(decoding):
    """A parameter replaced after an offline generate call is what a later online decoder decodes
    with (the generator reads the models afresh, as each generate call does), and the online
    decoder takes the same lean plain-attribute path, multiplying by copies of the weights made
    when it is built, however few its sources."""
    models = [random_transformer(D, 34).double()]
    sample = make_sample(D, SENTS)
    kw = dict(decoding=decoding, max_len_b=14)
    make = (lambda: AggressiveGenerator(models, D, **kw)) if decoding == "iad" else (
        lambda: StreamBeamGenerator(models, D, beam_size=3, **kw))
    gen = make()
    gen.generate(models, sample)
    fc1 = models[0].decoder.layers[0].fc1
    fc1.weight = torch.nn.Parameter(torch.randn_like(fc1.weight) * 3)  # a new object
    online, _ = _online(gen, [2, 0, 3])
    assert gen.blocks[0].call_math is not None
    assert gen.blocks[0].repacked._copies and gen.encoders.lins[0]._copies
    assert_same_hypos(online, _offline(lambda smp: make().generate(models, smp)), atol=1e-6, msg=decoding)


def test_drop_waiting_and_refuse_bad_sources():
    gen = StreamBeamGenerator(MODELS, D, budget=Budget(max_sentences=2), **KW)
    dec = OnlineDecoder(gen)
    rows = [dec.add(s + [D.eos()]) for s in SENTS[:5]]
    dec.step()  # admits the first two
    assert dec.drop(rows) == rows[2:]  # only waiting rows leave; admitted ones finish
    done = {}
    while dec.busy:
        done.update(dec.step())
    assert sorted(done) == rows[:2] and len(dec.srcs) == 0
    with pytest.raises(ValueError, match="more than the model's 256 positions"):
        dec.add([5] * 300)
    g2 = StreamBeamGenerator(MODELS, D, **dict(KW, min_len=5, match_source_len=True))
    with pytest.raises(ValueError, match="--min-len 5 exceeds this source's maximum length 3"):
        OnlineDecoder(g2).add([5, 6, D.eos()])


def test_scorers_refused():
    from fairseq_streambeam.scorers.masks import TokenMaskScorer

    gen = StreamBeamGenerator(MODELS, D, scorers=[TokenMaskScorer({0: ("ban", [7])}, D.eos(), D.pad())], **KW)
    with pytest.raises(ValueError, match="per-sentence scorers"):
        OnlineDecoder(gen)
