"""Finalization rules: which ranked candidates become finished hypotheses, which stay on the beam.

Both work on candidates already ranked per source (best first), copied to the host (numpy: a
step's few decisions cost less there than as device operators, each a kernel launch on a GPU), and
return masks; they hold no state. Scores are raw cumulative log-probs; the length penalty only
normalizes reported scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from torch import Tensor


@dataclass
class Ranked:
    """Candidates of one step, ranked per source: [B, R] tensors on the device, best first."""

    scores: Tensor  # cumulative log-prob, -inf where invalid
    parent: Tensor  # row of the parent candidate in the cohort
    token: Tensor  # chosen token; `pad` marks a finished candidate carried over unchanged


@dataclass
class RankedHost:
    """The ranked candidates on the host [B, R]: scores, parents, and what their tokens say."""

    scores: np.ndarray
    parent: np.ndarray
    valid: np.ndarray  # bool: a candidate (score above -inf)
    is_eos: np.ndarray  # bool: the token is EOS (a newly finished candidate)
    carried: np.ndarray  # bool: a finished candidate carried over (sticky rule only)

    @staticmethod
    def of(scores: np.ndarray, parent: np.ndarray, token: np.ndarray, eos: int, pad: int) -> RankedHost:
        valid = scores > -np.inf
        return RankedHost(scores, parent, valid, valid & (token == eos), valid & (token == pad))


class FairseqFinalize:
    """fairseq's SequenceGenerator rule: rank 2k candidates; EOS among the first k ranks is final
    (while fewer than k are final); the first k non-EOS candidates continue; a source is done with k
    finished hypotheses or at its maximum length."""

    def __init__(self, beam_size: int):
        self.k = beam_size
        self.target = beam_size  # finished hypotheses that end a source
        self.ranked = 2 * beam_size  # candidates ranked per source

    def decide(self, r: RankedHost, n_final: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = self.k
        eos = r.is_eos & (np.arange(r.scores.shape[1]) < k)
        final = eos & ((n_final[:, None] + eos.cumsum(1)) <= k)
        cont = r.valid & ~r.is_eos
        keep = cont & (cont.cumsum(1) <= k)
        return final, keep


class StickyFinalize:
    """The paper's rule (Yang et al. 2020): a candidate that ends stays on the beam, score frozen,
    and is final only once it is its source's top candidate; a source keeps at most k - (finished)
    candidates and is done once `finish_count` (z; k by default, as in the authors' runs) are final.
    A smaller z stops before hypotheses that may score better after length normalization finish."""

    def __init__(self, beam_size: int, finish_count: Optional[int] = None):
        self.k = beam_size
        self.target = finished_per_source("sticky", beam_size, finish_count)
        self.ranked = beam_size

    def decide(self, r: RankedHost, n_final: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        within = r.valid & (np.arange(r.scores.shape[1])[None, :] < (self.k - n_final)[:, None])
        ended = (r.is_eos | r.carried) & within
        lead = ended.cumprod(1).astype(bool)
        final = lead & ((n_final[:, None] + lead.cumsum(1)) <= self.target)
        keep = within & ~final
        return final, keep


def finished_per_source(rule: str, beam_size: int, finish_count: Optional[int] = None, nbest: int = 1) -> int:
    """How many finished hypotheses end a source under `rule` (at most that many are returned);
    raises ValueError, with the option names, for a finish count the rule cannot honour or an
    `nbest` that asks for more hypotheses than a source gets."""
    if rule == "fairseq":
        if finish_count is not None:
            raise ValueError("--finish-count applies to the sticky rule (--decoding var-batch and var-stream); "
                             "the fairseq rule always ends a source with k (--beam) finished hypotheses")
        count = beam_size
    elif rule == "sticky":
        count = beam_size if finish_count is None else finish_count
        if not 1 <= count <= beam_size:
            raise ValueError(f"--finish-count must be between 1 and the beam size ({beam_size}), got {count}")
    else:
        raise ValueError(f"unknown finalization rule {rule!r} (expected fairseq or sticky)")
    if nbest > count:
        by = "--finish-count" if finish_count is not None else "the beam size"
        raise ValueError(f"--nbest {nbest} asks for more hypotheses than the {count} that end a source ({by}); "
                         f"lower --nbest or raise {'--finish-count' if finish_count is not None else '--beam'}")
    return count


def build_finalize(rule: str, beam_size: int, finish_count: Optional[int] = None,
                   nbest: int = 1) -> Union[FairseqFinalize, StickyFinalize]:
    """The finalization rule `rule` (fairseq or sticky), checked against `nbest` (see
    `finished_per_source`)."""
    finished_per_source(rule, beam_size, finish_count, nbest)
    return FairseqFinalize(beam_size) if rule == "fairseq" else StickyFinalize(beam_size, finish_count)
