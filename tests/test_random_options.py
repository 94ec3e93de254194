"""Random models under random combinations of fairseq's generation options: beam, fixed-stream and
IAD against fairseq's SequenceGenerator (greedy for IAD), and var-stream against var-batch in
float64, so that no pair of options is only ever tested apart."""

import torch
from fairseq.search import LengthConstrainedBeamSearch
from fairseq.sequence_generator import SequenceGenerator
from helpers import assert_same_hypos, make_dict, make_sample, random_sentences, random_transformer
from hypothesis import given, settings
from hypothesis import strategies as st

from fairseq_streambeam import Budget, StreamBeamGenerator
from fairseq_streambeam.generators.aggressive import AggressiveGenerator


@st.composite
def problems(draw):
    """Models, a sample and fairseq's generation options, drawn together."""
    seed = draw(st.integers(0, 10**6))
    d = make_dict(draw(st.sampled_from([8, 12, 40])))
    arch = dict(layers=draw(st.integers(1, 3)), dim=draw(st.sampled_from([16, 32])),
                peaky=draw(st.sampled_from([0.5, 2.0, 4.0])), eos_bias=draw(st.sampled_from([0.0, 3.0, 8.0])))
    if draw(st.booleans()):
        arch.update(encoder_normalize_before=True, decoder_normalize_before=True)
    models = [random_transformer(d, seed + i, **arch) for i in range(draw(st.integers(1, 2)))]
    n = draw(st.integers(1, 10))
    sents = random_sentences(d, n, seed, max_len=draw(st.sampled_from([5, 15])))
    kw = dict(beam_size=draw(st.sampled_from([1, 2, 5])), max_len_b=draw(st.sampled_from([3, 8, 20])),
              len_penalty=draw(st.sampled_from([0.5, 1.0, 1.6])), min_len=draw(st.sampled_from([1, 3])),
              unk_penalty=draw(st.sampled_from([0.0, -1.0, 2.0])), temperature=draw(st.sampled_from([1.0, 0.7, 1.5])),
              normalize_scores=draw(st.booleans()))
    kw["min_len"] = min(kw["min_len"], kw["max_len_b"])
    if draw(st.integers(0, 3)) == 0:  # fairseq reads the batch's longest source: sources of one length
        kw["max_len_a"], kw["match_source_len"] = draw(st.sampled_from([(0.5, False), (0, True)]))
        sents = [(s * len(sents[0]))[:len(sents[0])] for s in sents]
        kw["min_len"] = min(kw["min_len"], len(sents[0]))
    prefix = None
    if draw(st.integers(0, 3)) == 0 and not kw.get("match_source_len"):
        prefix = torch.randint(d.nspecial, len(d), (n, draw(st.integers(1, 3))),
                               generator=torch.Generator().manual_seed(seed))
    return d, models, make_sample(d, sents, left_pad=draw(st.booleans())), kw, prefix


def _fairseq(models, d, sample, prefix, **kw):
    """fairseq's generator as its task builds it (--match-source-len constrains the search)."""
    search = LengthConstrainedBeamSearch(d, 1, 0, 1, 0) if kw.get("match_source_len") else None
    return SequenceGenerator(models, d, search_strategy=search, **kw).generate(models, sample, prefix_tokens=prefix)


@settings(max_examples=25, deadline=None)
@given(problem=problems(), decoding=st.sampled_from(["beam", "fixed-stream", "iad"]), n=st.integers(1, 4))
def test_random_options_match_fairseq(problem, decoding, n):
    d, models, sample, kw, prefix = problem
    if decoding == "iad":
        if kw.pop("match_source_len", False):
            kw.pop("max_len_a", None)  # iad refuses --match-source-len; its sources are still one length
        kw["beam_size"] = 1
        ref = _fairseq(models, d, sample, prefix, **kw)
        got = AggressiveGenerator(models, d, **{k: v for k, v in kw.items() if k != "beam_size"}, decoding="iad",
                                  budget=Budget(n)).generate(models, sample, prefix_tokens=prefix)
        assert_same_hypos(ref, got, nbest=1, msg=f"{kw}")
        return
    ref = _fairseq(models, d, sample, prefix, **kw)
    extra = dict(budget=Budget(n)) if decoding == "fixed-stream" else {}
    gen = StreamBeamGenerator(models, d, decoding=decoding, **extra, **kw)
    got = gen.generate(models, sample, prefix_tokens=prefix)
    assert_same_hypos(ref, got, msg=f"{decoding} {kw}")


@settings(max_examples=15, deadline=None)
@given(problem=problems(), delta=st.sampled_from([0.5, 1.5, 4.0]), cands=st.sampled_from([0, 1, 3]),
       rule=st.sampled_from(["sticky", "fairseq"]), n=st.integers(1, 5), budget=st.sampled_from([None, 3, 20]),
       order=st.sampled_from(["min-length", "fifo", "continuous"]), eps=st.sampled_from([0.0, 0.5, 1.0]))
def test_random_options_var_stream_equals_var_batch(problem, delta, cands, rule, n, budget, order, eps):
    d, models, sample, kw, prefix = problem
    models = [m.double() for m in models]  # batch composition then moves no token
    kw = dict(kw, prune_abs_threshold=delta, prune_max_cands=cands, finalize=rule)
    batch = StreamBeamGenerator(models, d, decoding="var-batch", **kw).generate(models, sample, prefix_tokens=prefix)
    stream = StreamBeamGenerator(models, d, decoding="var-stream", budget=Budget(n, None, budget), refill_eps=eps,
                                 stream_order=order, **kw).generate(models, sample, prefix_tokens=prefix)
    # scores are float32, and fairseq's attention softmax is float32 even in float64 models
    assert_same_hypos(batch, stream, atol=1e-5, msg=f"{kw} n={n} candidates={budget} {order} eps={eps}")
