"""Hand-computed cases for the pure parts: ranking, finalization rules, pruning, scheduling."""

import math

import numpy as np
import pytest
import torch

from fairseq_streambeam.runtime.scheduler import Budget, Scheduler
from fairseq_streambeam.search.beam_state import Beams, rank_candidates
from fairseq_streambeam.search.finalize import (
    FairseqFinalize,
    RankedHost,
    StickyFinalize,
    build_finalize,
    finished_per_source,
)
from fairseq_streambeam.search.pruning import Pruning

EOS, PAD = 2, 1
NEG = -math.inf


def ranked(scores, tokens):
    t = np.array(tokens)
    return RankedHost.of(np.array(scores, dtype=np.float32), np.zeros_like(t), t, EOS, PAD)


def test_fairseq_rule_finalizes_eos_in_top_k_and_keeps_first_k_others():
    r = ranked([[-1.0, -1.5, -2.0, -2.5]], [[EOS, 7, EOS, 8]])
    final, keep = FairseqFinalize(beam_size=2).decide(r, np.array([0]))
    assert final.tolist() == [[True, False, False, False]]  # EOS at rank 2 is outside the top k=2
    assert keep.tolist() == [[False, True, False, True]]


def test_fairseq_rule_stops_at_k_finished():
    r = ranked([[-1.0, -1.5, -2.0, -2.5]], [[EOS, EOS, 7, 8]])
    final, _ = FairseqFinalize(beam_size=2).decide(r, np.array([1]))
    assert final.tolist() == [[True, False, False, False]]


def test_sticky_rule_finalizes_only_a_leading_run_of_ended():
    r = ranked([[-1.0, -1.2, -1.5]], [[PAD, 7, EOS]])
    final, keep = StickyFinalize(beam_size=3, finish_count=1).decide(r, np.array([0]))
    assert final.tolist() == [[True, False, False]]
    assert keep.tolist() == [[False, True, True]]  # the EOS at rank 2 stays on the beam, not final
    r = ranked([[-1.0, -1.2, -1.5]], [[7, EOS, 8]])
    final, keep = StickyFinalize(beam_size=3, finish_count=1).decide(r, np.array([0]))
    assert not final.any() and keep.tolist() == [[True, True, True]]


def test_sticky_finish_count_caps_a_leading_run():
    """A leading run of three ended candidates: z = 2 finalizes two (and the source is done), z = k
    all three; z defaults to k."""
    r = ranked([[-1.0, -1.1, -1.2, -1.5]], [[PAD, EOS, EOS, 7]])
    final, keep = StickyFinalize(beam_size=4, finish_count=2).decide(r, np.array([0]))
    assert final.tolist() == [[True, True, False, False]]
    assert keep.tolist() == [[False, False, True, True]]
    final, _ = StickyFinalize(beam_size=4, finish_count=4).decide(r, np.array([0]))
    assert final.tolist() == [[True, True, True, False]]
    assert StickyFinalize(beam_size=4).target == 4
    final, _ = StickyFinalize(beam_size=4, finish_count=3).decide(r, np.array([1]))  # one already final
    assert final.tolist() == [[True, True, False, False]]


def test_finish_count_and_nbest_are_checked():
    assert finished_per_source("sticky", 5) == 5
    assert finished_per_source("sticky", 5, 2, nbest=2) == 2
    assert finished_per_source("fairseq", 5, nbest=5) == 5
    with pytest.raises(ValueError, match="--finish-count applies to the sticky rule"):
        finished_per_source("fairseq", 5, 5)
    for z in (0, 6):
        with pytest.raises(ValueError, match="between 1 and the beam size"):
            finished_per_source("sticky", 5, z)
    with pytest.raises(ValueError, match="--nbest 3 asks for more hypotheses than the 2"):
        build_finalize("sticky", 5, 2, nbest=3)
    with pytest.raises(ValueError, match="--nbest 6 asks for more hypotheses than the 5"):
        build_finalize("fairseq", 5, nbest=6)
    assert isinstance(build_finalize("sticky", 5, 2, nbest=2), StickyFinalize)


def test_sticky_width_shrinks_with_finished():
    r = ranked([[-1.0, -1.2, -1.5]], [[7, 8, 9]])
    _, keep = StickyFinalize(beam_size=3, finish_count=3).decide(r, np.array([2]))
    assert keep.tolist() == [[True, False, False]]


def test_threshold_is_relative_to_best_of_candidates_and_finished():
    p = Pruning(beam_size=4, delta=1.0)
    s = np.array([[-1.0, -1.9, -2.1, NEG]], dtype=np.float32)
    keep = p.threshold_keep(s, s > NEG, np.array([NEG], dtype=np.float32))
    assert keep.tolist() == [[True, True, False, False]]
    keep = p.threshold_keep(s, s > NEG, np.array([-0.5], dtype=np.float32))  # a better finished hypothesis
    assert keep.tolist() == [[True, False, False, False]]


def test_rank_candidates_two_sources_and_max_cands():
    # source 0 has two live parents, source 1 one; vocab 5 (pad=1, eos=2)
    beams = Beams(tokens=torch.full((3, 2), EOS), cum=torch.tensor([[-1.0], [-2.0], [-0.5]]),
                  src=torch.tensor([0, 0, 1]), live=torch.ones(3, dtype=torch.bool))
    lp = torch.log(torch.tensor([
        [0.1, 0.0, 0.2, 0.3, 0.4],
        [0.0, 0.0, 0.1, 0.1, 0.8],
        [0.5, 0.0, 0.1, 0.2, 0.2],
    ]))
    r = rank_candidates(beams, lp, 2, Pruning(beam_size=2, max_cands=1), ranked=4, pad=PAD)
    # M=1: one child per parent; source 0 -> parent 0 token 4 (-1+log .4), parent 1 token 4 (-2+log .8)
    assert r.token[0, :2].tolist() == [4, 4] and r.parent[0, :2].tolist() == [0, 1]
    assert torch.allclose(r.scores[0, :2], torch.tensor([-1 + math.log(0.4), -2 + math.log(0.8)]))
    assert r.token[1, 0].item() == 0 and r.parent[1, 0].item() == 2
    assert (r.scores[1, 1:] == NEG).all()  # one parent with M=1 gives one candidate


def test_rank_carries_finished_rows_unchanged():
    beams = Beams(tokens=torch.full((2, 2), EOS), cum=torch.tensor([[-0.1], [-1.0]]),
                  src=torch.tensor([0, 0]), live=torch.tensor([False, True]))
    lp = torch.log(torch.tensor([[0.1, 0.0, 0.1, 0.4, 0.4]]))
    r = rank_candidates(beams, lp, 1, Pruning(beam_size=2), ranked=2, pad=PAD)
    assert r.token[0, 0].item() == PAD and r.parent[0, 0].item() == 0  # carried: token pad
    assert r.scores[0, 0].item() == beams.cum[0, 0].item()


def test_scheduler_refill_and_pick():
    s = Scheduler("min-length", Budget(max_sentences=6), refill_eps=0.5)
    assert s.should_refill(0, 0) and s.should_refill(2, 0) and not s.should_refill(3, 0)
    assert s.admit(2, 10, [3, 3, 3, 3, 3, 3]) == 4
    s = Scheduler("min-length", Budget(max_tokens=10), refill_eps=0.5)
    assert s.admit(0, 0, [4, 4, 4]) == 2
    assert s.admit(0, 0, [40]) == 1  # a source over the budget still gets in alone
    c = Scheduler("min-length", Budget(max_sentences=100, max_candidates=20), refill_eps=0.5)
    assert c.should_refill(50, 0, 9) and not c.should_refill(3, 0, 10)  # candidates decide, not sources
    assert c.admit(2, 0, [3] * 10, live_candidates=8, width=3.0) == 4  # 8 + 4 * 3 <= 20 < 8 + 5 * 3
    assert c.admit(0, 0, [3], live_candidates=0, width=50.0) == 1  # one source always fits when none is live
    b = Scheduler("batch", Budget(max_sentences=6))
    assert not b.should_refill(1, 0)

    class C:
        def __init__(self, steps, waited, serial):
            self.steps, self.waited, self.first_serial = steps, waited, serial

    cs = [C(5, 0, 0), C(2, 1, 10), C(7, 4, 3)]
    assert s.pick(cs) == 1
    assert Scheduler("fifo", Budget(4)).pick(cs) == 0
    assert Scheduler("min-length", Budget(4), max_wait=4).pick(cs) == 2


def test_a_huge_max_len_a_is_the_models_limit():
    """A length limit a * x + b beyond any integer (a served request's "max_len_a": 1e308) is the
    model's positions - 1, not an overflow."""
    from fairseq_streambeam.search.penalties import source_max_len

    assert source_max_len(10, 1e308, 0, 1024) == 1023 and source_max_len(10, 1.5, 3, 1024) == 18
