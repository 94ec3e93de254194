"""Finalization rules: which ranked candidates become finished hypotheses, which stay on the beam.

Both work on candidates already ranked per source (best first) and return masks; they hold no
state. Scores are raw cumulative log-probs; the length penalty only normalizes reported scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Ranked:
    """Candidates of one step, ranked per source: [B, R] tensors, best first."""

    scores: Tensor  # cumulative log-prob, -inf where invalid
    parent: Tensor  # row of the parent candidate in the cohort
    token: Tensor  # chosen token; `pad` marks a finished candidate carried over unchanged
    valid: Tensor  # bool
    is_eos: Tensor  # bool: the token is EOS (a newly finished candidate)
    carried: Tensor  # bool: a finished candidate carried over (sticky rule only)


class FairseqFinalize:
    """fairseq's SequenceGenerator rule: rank 2k candidates; EOS among the first k ranks is final
    (while fewer than k are final); the first k non-EOS candidates continue; a source is done with k
    finished hypotheses or at its maximum length."""

    name = "fairseq"
    carries_finished = False

    def __init__(self, beam_size: int):
        self.k = beam_size
        self.target = beam_size  # finished hypotheses that end a source

    def ranked_per_source(self) -> int:
        return 2 * self.k

    def decide(self, r: Ranked, n_final: Tensor) -> tuple[Tensor, Tensor]:
        k = self.k
        rank = torch.arange(r.scores.size(1), device=r.scores.device)
        eos = r.is_eos & r.valid & (rank < k)
        final = eos & ((n_final.unsqueeze(1) + eos.long().cumsum(1)) <= k)
        cont = r.valid & ~r.is_eos
        keep = cont & (cont.long().cumsum(1) <= k)
        return final, keep


class StickyFinalize:
    """The paper's rule (Yang et al. 2020): a candidate that ends stays on the beam with its score
    frozen and is final only when it becomes the top candidate of its source; a source keeps at most
    k - (finished) candidates and is done once `nbest` hypotheses are final."""

    name = "sticky"
    carries_finished = True

    def __init__(self, beam_size: int, nbest: int):
        self.k = beam_size
        self.target = max(1, min(nbest, beam_size))

    def ranked_per_source(self) -> int:
        return self.k

    def decide(self, r: Ranked, n_final: Tensor) -> tuple[Tensor, Tensor]:
        rank = torch.arange(r.scores.size(1), device=r.scores.device)
        within = r.valid & (rank.unsqueeze(0) < (self.k - n_final).unsqueeze(1))
        ended = (r.is_eos | r.carried) & within
        lead = ended.long().cumprod(1).bool()
        final = lead & ((n_final.unsqueeze(1) + lead.long().cumsum(1)) <= self.target)
        keep = within & ~final
        return final, keep


def build_finalize(rule: str, beam_size: int, nbest: int):
    if rule == "fairseq":
        return FairseqFinalize(beam_size)
    if rule == "sticky":
        return StickyFinalize(beam_size, nbest)
    raise ValueError(f"unknown finalization rule {rule!r} (expected fairseq or sticky)")
