"""Bad input: a clear error or a defined output, never a traceback from inside the loop."""

import pytest
import torch
from helpers import make_dict, make_sample, ours, random_sentences, random_transformer

from fairseq_streambeam import Budget, StreamBeamGenerator

D = make_dict(20)
M = random_transformer(D, 31)


@pytest.mark.parametrize("decoding", ["beam", "var-batch", "var-stream", "fixed-stream", "greedy"])
def test_empty_source_gets_a_hypothesis(decoding):
    """An empty line is its EOS alone; it is decoded like any source (defined output)."""
    s = make_sample(D, [[], [5, 6, 7], []])
    out, _ = ours([M], D, s, beam_size=3, max_len_b=8, decoding=decoding, budget=Budget(2))
    assert len(out) == 3 and all(len(h) >= 1 for h in out)
    assert all(h[0]["tokens"][-1].item() == D.eos() for h in out)


def test_source_longer_than_model_positions_is_a_clear_error():
    s = make_sample(D, [[5] * 300])
    with pytest.raises(ValueError, match="more than the model's 256 source positions"):
        ours([M], D, s, beam_size=2)


def test_beam_larger_than_vocabulary_is_capped_like_fairseq():
    from helpers import assert_same_hypos, fairseq_generate

    s = make_sample(D, random_sentences(D, 3, 1))
    ref = fairseq_generate([M], D, s, beam_size=100, max_len_b=5)
    got, gen = ours([M], D, s, beam_size=100, max_len_b=5)
    assert gen.beam_size == len(D) - 1
    assert_same_hypos(ref, got)


def test_unknown_symbols_decode():
    s = make_sample(D, [[D.unk(), 5, D.unk()]])
    out, _ = ours([M], D, s, beam_size=2, max_len_b=6, unk_penalty=1.0)
    assert out[0][0]["tokens"][-1].item() == D.eos()


def test_dictionary_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        StreamBeamGenerator([M], make_dict(25), beam_size=2)


@pytest.mark.parametrize("kw,match", [
    (dict(decoding="nope"), "--decoding must be one of"),
    (dict(decoding="beam", prune_abs_threshold=1.0), "applies to var-batch and var-stream"),
    (dict(decoding="var-batch", prune_abs_threshold=0.0), "prune-abs-threshold"),
    (dict(decoding="var-batch", prune_max_cands=-1), "prune-max-cands"),
    (dict(decoding="var-stream", refill_eps=2.0), "refill-eps"),
    (dict(decoding="var-stream", finalize="never"), "finalize must be one of"),
    (dict(decoding="var-stream", stream_order="random"), "stream-order"),
    (dict(decoding="var-stream", stream_admit="random"), "stream-admit"),
    (dict(min_len=50, max_len_b=10), "min-len"),
])
def test_bad_options_are_clear_errors(kw, match):
    s = make_sample(D, [[5, 6]])
    with pytest.raises(ValueError, match=match):
        ours([M], D, s, beam_size=2, **kw)


@pytest.mark.parametrize("decoding", ["beam", "iad"])
def test_a_token_to_suppress_outside_the_dictionary_is_a_usage_error(decoding):
    """fairseq's generator asserts (a bare AssertionError); both families name the word."""
    from fairseq_streambeam.generators.aggressive import AggressiveGenerator
    from fairseq_streambeam.spec import UsageError

    build = AggressiveGenerator if decoding == "iad" else StreamBeamGenerator
    with pytest.raises(UsageError, match="tokens_to_suppress: 'nope' not a word of the target dictionary"):
        build([M], D, decoding=decoding, tokens_to_suppress=(D[5], "nope"))
    assert build([M], D, decoding=decoding, tokens_to_suppress=(D[5],)).token_indices_to_suppress.tolist() == [5]


def test_constraints_are_refused():
    s = make_sample(D, [[5, 6]])
    gen = StreamBeamGenerator([M], D, beam_size=2)
    with pytest.raises(NotImplementedError, match="constraints"):
        gen.generate([M], s, constraints=torch.zeros(1, 3, dtype=torch.long))


def test_source_with_no_finite_candidate_gets_the_defined_hypothesis():
    """Every word and <s> suppressed, unk priced at +inf, EOS banned by min-len: nothing is finite.
    fairseq would assert; here the source gets EOS with score -inf (README, 'Differences')."""
    import math

    words = (D[D.bos()],) + tuple(D[i] for i in range(D.nspecial, len(D)))
    s = make_sample(D, [[5, 6], [7]])
    out, _ = ours([M], D, s, beam_size=3, max_len_b=5, tokens_to_suppress=words, unk_penalty=math.inf)
    for h in out:
        assert len(h) == 1 and h[0]["tokens"].tolist() == [D.eos()] and h[0]["score"].item() == -math.inf


def test_prefix_with_eos_ends_the_hypothesis_there():
    s = make_sample(D, [[5, 6, 7]])
    prefix = torch.tensor([[8, D.eos(), D.pad()]])
    out = StreamBeamGenerator([M], D, beam_size=3, max_len_b=6).generate([M], s, prefix_tokens=prefix)
    assert len(out[0]) == 1 and out[0][0]["tokens"].tolist() == [8, D.eos()]


def test_max_len_a_uses_each_sources_own_length():
    """With max_len_a != 0 fairseq's limit depends on the padded batch width; ours does not: the
    batched output equals fairseq decoding each source in a batch of its own."""
    from helpers import assert_same_hypos, fairseq_generate

    sents = [[5] * 2, [6] * 9, [7, 8, 9]]
    kw = dict(beam_size=3, max_len_a=0.5, max_len_b=1)
    s = make_sample(D, sents)
    got, _ = ours([M], D, s, **kw)
    alone = [fairseq_generate([M], D, make_sample(D, [sents[i]]), **kw)[0] for i in s["id"].tolist()]
    assert_same_hypos(alone, got)


def test_max_tokens_error_names_the_sides_the_dataset_has():
    """fairseq-interactive's datasets have no reference: the error does not mention one."""
    from fairseq.data import LanguagePairDataset

    from fairseq_streambeam.task import batching_problem

    src = [torch.tensor([5, 6, 7, D.eos()])]
    mono = batching_problem(LanguagePairDataset(src, [4], D), 2, None, False)
    pair = batching_problem(LanguagePairDataset(src, [4], D, src, [4], D), 2, None, False)
    assert mono is not None and "(source): raise --max-tokens" in mono, mono
    assert pair is not None and "(source or reference): raise --max-tokens" in pair, pair
