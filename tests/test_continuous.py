"""The continuous streaming order: every live source steps in one decoder call whatever its prefix
length, with the same output as var-batch (float64) and beam (fixed-stream), in fewer decoder
calls than stepping one cohort of equal lengths at a time."""

import logging

import pytest
import torch
from helpers import (
    assert_same_hypos,
    make_dict,
    make_sample,
    ours,
    random_sentences,
    random_transformer,
)
from test_model_types import D as LSTM_DICT
from test_model_types import lstm_model

from fairseq_streambeam import Budget
from fairseq_streambeam.generators import stream_beam

D = make_dict(30)
MODELS = [random_transformer(D, 31).double(), random_transformer(D, 32, eos_bias=3.0).double()]
SENTS = random_sentences(D, 16, 33, min_len=1, max_len=15)
SAMPLE = make_sample(D, SENTS)
KW = dict(beam_size=5, max_len_b=14, len_penalty=0.8)


def _pair(decoding="var-stream", budget=None, refill_eps=0.5, models=MODELS, sample=SAMPLE, **kw):
    """(min-length, continuous) runs of one streaming setting (budget: 3 sources unless given):
    hypotheses and generators."""
    kw = dict(KW, **kw)
    budget = budget or Budget(3)
    return [ours(models, D, sample, decoding=decoding, budget=budget, refill_eps=refill_eps, stream_order=order,
                 **kw) for order in ("min-length", "continuous")]


def test_one_call_steps_every_source():
    """Everything admitted at once: one call per step for all sources, so as many steps as the
    longest source needs, as var-batch; streaming: fewer calls than min-length, same rows."""
    ref, batch = ours(MODELS, D, SAMPLE, decoding="var-batch", **KW)
    got, gen = ours(MODELS, D, SAMPLE, decoding="var-stream", budget=Budget(100), stream_order="continuous", **KW)
    assert_same_hypos(ref, got, atol=1e-5)
    assert gen.counters.decoder_steps == batch.counters.decoder_steps
    (a, by_length), (b, continuous) = _pair()
    assert_same_hypos(ref, a, atol=1e-5, msg="min-length")
    assert_same_hypos(ref, b, atol=1e-5, msg="continuous")
    assert continuous.counters.expansions == by_length.counters.expansions == batch.counters.expansions
    assert continuous.counters.decoder_steps < by_length.counters.decoder_steps


def test_candidate_budget_is_filled():
    """With a candidate budget refilled once a tenth is free, continuous steps expand most of it."""
    sample = make_sample(D, random_sentences(D, 60, 34, min_len=3, max_len=15))
    models = [random_transformer(D, 39, eos_bias=0.0).double()]  # outputs of many lengths
    (a, by_length), (b, continuous) = _pair(budget=Budget(1000, None, 40), refill_eps=0.9, sample=sample,
                                            models=models)
    assert_same_hypos(a, b, atol=1e-5)
    per_step = continuous.counters.expansions / continuous.counters.decoder_steps
    assert per_step > 1.5 * by_length.counters.expansions / by_length.counters.decoder_steps
    assert per_step >= 0.75 * 40, per_step


def test_per_row_penalties_and_options():
    """Minimum length, n-gram blocking, temperature and the unk penalty at each source's own step;
    both finalization rules."""
    for finalize in ("sticky", "fairseq"):
        kw = dict(min_len=4, no_repeat_ngram_size=2, temperature=1.3, unk_penalty=0.5, finalize=finalize)
        ref = ours(MODELS, D, SAMPLE, decoding="var-batch", **KW, **kw)[0]
        assert any(len(h[0]["tokens"]) == 5 for h in ref), "the minimum length is never what stops EOS"
        for budget in (Budget(2), Budget(5, 30), Budget(None, None, 12)):
            got = _pair(budget=budget, **kw)[1][0]
            assert_same_hypos(ref, got, atol=1e-5, msg=f"{finalize} {budget}")


def test_masked_slots_are_cut_off(monkeypatch):
    """Long outputs, one or two sources admitted at a time: rows join with masked cache slots, and
    after every step the cache holds no more slots than the furthest live source has decoded (the
    rest are masked in every row and cut off), with the same output."""
    from fairseq_streambeam.generators.stream_beam import StreamBeamGenerator

    seen = []
    tidy = StreamBeamGenerator._tidy_ragged

    def checked(self, c):
        before = c.cache.length
        tidy(self, c)
        if c.live_h.any():
            top = int(c.src.steps.h.max())
            assert c.cache.length == top, (c.cache.length, top)
            seen.append(before - top)

    monkeypatch.setattr(StreamBeamGenerator, "_tidy_ragged", checked)
    models = [random_transformer(D, 35, eos_bias=1.0).double()]
    kw = dict(max_len_b=60, beam_size=3)
    ref = ours(models, D, SAMPLE, decoding="var-batch", **KW | kw)[0]
    lengths = sorted(len(h[0]["tokens"]) for h in ref)
    assert lengths[-1] > 40 and lengths[len(lengths) // 2] < 20, lengths  # long rows beside short ones
    got, gen = ours(models, D, SAMPLE, decoding="var-stream", budget=Budget(2), refill_eps=1.0,
                    stream_order="continuous", **KW | kw)
    assert max(seen) > 20, "no long run of masked slots was cut off"
    assert_same_hypos(ref, got, atol=1e-5)


@pytest.mark.parametrize("lean", [True, False])
def test_prefix_tokens_step_cohorts_of_one_length(lean):
    """Prefix tokens are forced per cohort step: such a call keeps cohorts of equal lengths, on
    lean steps and on fairseq's (layers the lean path does not take: a hook on a projection)."""
    models = MODELS
    if not lean:
        models = [random_transformer(D, 31).double(), random_transformer(D, 32, eos_bias=3.0).double()]
        for m in models:
            m.decoder.layers[0].fc1.register_forward_pre_hook(lambda module, args: None)
    prefix = torch.tensor([s[:2] if len(s) >= 2 else s + [D.eos()] * (2 - len(s)) for s in
                           [SENTS[i] for i in SAMPLE["id"].tolist()]])
    ref = ours(models, D, SAMPLE, decoding="var-batch", **KW)[1].generate(models, SAMPLE, prefix_tokens=prefix)
    gen = ours(models, D, SAMPLE, decoding="var-stream", budget=Budget(3), stream_order="continuous", **KW)[1]
    assert gen.lean_steps == lean and gen.scheduler.policy == "continuous"
    assert_same_hypos(ref, gen.generate(models, SAMPLE, prefix_tokens=prefix), atol=1e-5)


def test_fixed_stream_equals_beam_float32():
    """float32 random models: fixed-stream in the continuous order gives beam's top hypothesis."""
    models = [random_transformer(D, 36), random_transformer(D, 37, eos_bias=2.0)]
    sample = make_sample(D, random_sentences(D, 24, 38, min_len=1, max_len=14))
    beam = ours(models, D, sample, decoding="beam", **KW)[0]
    for budget, eps in ((Budget(3), 0.5), (Budget(7), 1.0), (Budget(None, None, 20), 0.9)):
        got, gen = ours(models, D, sample, decoding="fixed-stream", budget=budget, refill_eps=eps,
                        stream_order="continuous", **KW)
        assert gen.scheduler.policy == "continuous"
        top = [a[0]["tokens"].tolist() == b[0]["tokens"].tolist() for a, b in zip(beam, got)]
        assert all(top), f"{budget} eps={eps}: top-1 differs for {top.count(False)} of {len(top)}"


def test_non_transformer_falls_back(caplog):
    """Decoders without per-row positions fall back to min-length, saying so once."""
    models = [lstm_model(1).double()]
    s = make_sample(LSTM_DICT, random_sentences(LSTM_DICT, 9, 4, max_len=10))
    kw = dict(beam_size=5, max_len_b=12)
    ref = ours(models, LSTM_DICT, s, decoding="var-batch", **kw)[0]
    with caplog.at_level(logging.INFO, logger=stream_beam.__name__):
        got, gen = ours(models, LSTM_DICT, s, decoding="var-stream", budget=Budget(3), stream_order="continuous",
                        **kw)
    assert gen.scheduler.policy == "min-length"
    assert sum("falls back to min-length" in r.getMessage() for r in caplog.records) == 1
    assert_same_hypos(ref, got, atol=1e-5)


def test_candidate_budget_given_as_an_option_is_used():
    """`stream_candidates=` to a generator built without a budget is its budget (it was ignored)."""
    from fairseq_streambeam import StreamBeamGenerator

    gen = StreamBeamGenerator(MODELS[:1], D, beam_size=4, decoding="var-stream", stream_candidates=3)
    assert gen.scheduler.budget.max_candidates == 3 and gen.scheduler.budget.max_sentences is None
    assert StreamBeamGenerator(MODELS[:1], D, beam_size=4, decoding="var-stream").scheduler.budget.max_sentences == 64
