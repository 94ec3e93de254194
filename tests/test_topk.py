"""search.topk.top_children ranks as one torch.topk over the children's scores does, bit for bit,
and beam search ranked through it keeps fairseq's output."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_same_hypos,
    fairseq_generate,
    load_checkpoints,
    make_dict,
    make_sample,
    ours,
    random_sentences,
    random_transformer,
    shared_path,
)
from test_aggressive import _nan_log_probs

from fairseq_streambeam.search import topk as T

INF = math.inf


@pytest.fixture
def full_sums(monkeypatch):
    """Counts the calls that formed every sum (torch.topk's path) instead of the block path's."""
    calls = []
    summed = T._summed

    def counted(*args):
        calls.append(1)
        return summed(*args)
    monkeypatch.setattr(T, "_summed", counted)
    return calls


def reference(lprobs, score, r, fix_nan=False):
    """fairseq's order: NaN log-probs to -inf, then the sums, then one topk."""
    if fix_nan:
        lprobs = lprobs.nan_to_num(nan=-INF, posinf=INF, neginf=-INF)
    return (lprobs + score.unsqueeze(2)).reshape(lprobs.size(0), -1).topk(r, dim=1)


def log_probs(s, p, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(s * p, v, generator=g, dtype=dtype)).log_softmax(-1).view(s, p, v)


def assert_ranks(got, ref):
    assert got[0].dtype == ref[0].dtype and torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("s,p,v,r,dtype,score_dtype", [
    (7, 5, 8008, 10, torch.float32, torch.float32),  # fixed beam, deen-tiny's vocabulary
    (40, 1, 8008, 5, torch.float32, torch.float32),  # per-row children (variable-width beams)
    (3, 50, 8008, 100, torch.float32, torch.float32),  # k = 50
    (64, 4, 1024, 8, torch.float64, torch.float64),
    (4, 5, 8008, 10, torch.float32, torch.float64),  # scores more precise than the log-probs
    (4, 5, 8008, 10, torch.float64, torch.float32),  # log-probs more precise than the scores
])
def test_block_path_ranks_as_torch_topk(full_sums, s, p, v, r, dtype, score_dtype):
    lp = log_probs(s, p, v, dtype)
    score = -20 * torch.rand(s, p, dtype=score_dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = T.top_children(lp.clone(), score, r)
    assert not full_sums  # the block path answered
    assert_ranks(got, reference(lp, score, r))


def test_best_children_in_one_block(full_sums):
    """All of a source's best children in one block, and the next in another row's."""
    lp = log_probs(2, 16, 1024)
    lp[0, 1, 300:315] = torch.linspace(-0.01, -0.5, 15)
    lp[1, 2, 1000:1024] = torch.linspace(-0.02, -0.3, 24)
    score = torch.full((2, 16), -5.0)
    score[:, :3] = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -0.7]])
    with torch.no_grad():
        assert_ranks(T.top_children(lp.clone(), score, 12), reference(lp, score, 12))
    assert not full_sums


def test_ties_nans_and_infinities_take_torch_topk(full_sums):
    """Where torch.topk's answer is not unique (equal sums, -inf) or a NaN is met, the sums are
    formed in full and ranked by torch.topk, NaN counted as -inf when asked."""
    with torch.no_grad():
        lp = log_probs(4, 5, 8008)
        lp[2, 3] = lp[2, 1]  # two rows of one source with the same children and score
        score = torch.zeros(4, 5)
        assert_ranks(T.top_children(lp.clone(), score, 10), reference(lp, score, 10))
        assert len(full_sums) == 1
        nan = log_probs(4, 5, 8008)
        nan[1, 0, 17] = nan[3, 4, 5000] = float("nan")
        assert_ranks(T.top_children(nan.clone(), score, 10, fix_nan=True), reference(nan, score, 10, fix_nan=True))
        assert len(full_sums) == 2
        few = torch.full((4, 5, 8008), -INF)
        few[:, :, :3] = log_probs(4, 5, 3)  # 15 finite children a source
        assert_ranks(T.top_children(few.clone(), score, 15), reference(few, score, 15))
        assert len(full_sums) == 2  # the 16th best is -inf, below the 15th: still unique
        assert_ranks(T.top_children(few.clone(), score, 16), reference(few, score, 16))
        assert len(full_sums) == 3  # the 16th and 17th are -inf: torch.topk picks among them
        both = log_probs(4, 5, 8008)
        both[0, 1, 3] = INF  # +inf on a row whose score is -inf: a NaN sum, first in fairseq's ranking
        score[0, 1] = -INF
        got, ref = T.top_children(both.clone(), score, 10, fix_nan=True), reference(both, score, 10, fix_nan=True)
        assert got[0][0, 0].isnan() and got[1][0, 0] == 8008 + 3
        assert_ranks(got, ref)
        assert len(full_sums) == 4


def test_other_inputs_take_torch_topk(full_sums):
    """Vocabularies no block size divides, half precision, strided log-probs, too few blocks or
    elements, and grad mode (the GPU's path too: torch.topk over every sum)."""
    assert T.block_size(8008) == 143 and T.block_size(1024) == 128 and T.block_size(8 * 1009) == 0
    score = torch.randn(8, 5)
    wide = log_probs(8, 5, 2048)
    cases = [(log_probs(8, 5, 8 * 1009), 10), (log_probs(8, 5, 1024).half(), 10), (wide[:, :, :1024], 10),
             (log_probs(8, 5, 1024), 40), (log_probs(4, 1, 1024), 3)]
    with torch.no_grad():
        for lp, r in cases:
            sc = score[:lp.size(0), :lp.size(1)]
            ref = reference(lp, sc, r)
            assert_ranks(T.top_children(lp if not lp.is_contiguous() else lp.clone(), sc, r), ref)
    lp = log_probs(8, 5, 1024)
    assert_ranks(T.top_children(lp.clone(), score, 10), reference(lp, score, 10))  # grad enabled
    assert len(full_sums) == len(cases) + 1


def test_beam_with_nan_log_probs_through_the_block_path_matches_fairseq(full_sums):
    """NaN log-probs left by the penalties for ranking to read as -inf (no scorer): fairseq's output,
    on a vocabulary the block path takes."""
    d = make_dict(1020)  # 1024 with the specials
    m = random_transformer(d, 86, eos_bias=1.0)
    for column in (7, 9, 10, 11, 12, 13):  # NaN in many rows: ranked as NaN, the output would differ
        m = _nan_log_probs(m, column)
    s = make_sample(d, random_sentences(d, 12, 87, max_len=10))
    kw = dict(beam_size=4, max_len_b=9, min_len=2, unk_penalty=0.5)
    got, gen = ours([m], d, s, **kw)
    assert gen.lean_steps
    assert_same_hypos(fairseq_generate([m], d, s, **kw), got)


def test_deen_tiny_beam_ranked_by_blocks_matches_fairseq(full_sums, monkeypatch):
    from test_exact_fairseq import _deen_sample

    root = shared_path("models", "deen-tiny")
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root / "data-bin")
    task.load_dataset("test")
    d = task.target_dictionary
    s = _deen_sample(task, 16, 187)
    calls = []
    block = T.top_children

    def counted(*args):
        calls.append(1)
        return block(*args)
    monkeypatch.setattr("fairseq_streambeam.search.beam_state.top_children", counted)
    got, _ = ours(models, d, s, beam_size=5)
    assert_same_hypos(fairseq_generate(models, d, s, beam_size=5), got)
    assert calls and len(full_sums) < len(calls) / 10  # the steps ranked by blocks
