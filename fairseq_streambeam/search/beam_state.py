"""Beam state of one cohort (sources whose candidates share a target length): pure tensor logic.

Candidate rows are grouped by source in ascending source order; a source has 1..k rows. `live`
rows are expanded by the model; finished rows (sticky rule) are carried without model work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..runtime.rows import Rows
from .finalize import Ranked
from .pruning import Pruning
from .topk import top_children


@dataclass
class Beams(Rows):
    """tokens [N, L+1] (BOS first); cum [N, L] cumulative score after each token; src [N]
    cohort-local source index; live [N] (False: finished row carried by the sticky rule);
    state [N] a scorer's per-candidate state (LMBR history row), or None without scorer."""

    tokens: Tensor
    cum: Tensor
    src: Tensor
    live: Tensor
    state: Optional[Tensor] = None

    @staticmethod
    def start(n_sources: int, bos: int, device: torch.device, dtype: torch.dtype,
              state: Optional[Tensor] = None) -> Beams:
        return Beams(
            tokens=torch.full((n_sources, 1), bos, dtype=torch.long, device=device),
            cum=torch.zeros(n_sources, 0, dtype=dtype, device=device),
            src=torch.arange(n_sources, device=device),
            live=torch.ones(n_sources, dtype=torch.bool, device=device),
            state=state,
        )

    @property
    def rows(self) -> int:
        return self.src.numel()

    def score(self) -> Tensor:
        """Current cumulative score of every row (0 before the first token)."""
        return self.cum[:, -1] if self.cum.size(1) else self.cum.new_zeros(self.rows)


def rank_candidates(beams: Beams, live_lprobs: Tensor, n_sources: int, pruning: Pruning, ranked: int, pad: int,
                    like_fairseq: bool = False, fix_nan: bool = False) -> Ranked:
    """Rank each source's candidates: children of live rows (at most M per parent) and, for
    finished rows, the row itself carried over unchanged (token `pad`).

    `live_lprobs` [live rows, V] may be overwritten (the caller reads its log-probs no more);
    `fix_nan`: its NaNs count as -inf (fairseq's adjustment, when the caller left it to ranking:
    `search.topk`). Ranks are torch.topk's over the children's scores (`search.topk.top_children`).

    Two stages: top-c children per parent, then top-R over the source's parents ([B, k*c]); the
    top-R set equals that of one top-k over all parents x vocab. `like_fairseq` (fixed beams,
    fairseq's rule): when every source has 1 or k live rows, rank with fairseq's own call
    (BeamSearch.step: one top-R over each source's rows x vocabulary), so that ties (common in half
    precision) come in fairseq's order; topk orders ties arbitrarily, and two stages pick others.
    """
    k = pruning.beam_size
    c = pruning.children_per_parent(ranked, live_lprobs.size(1))
    r = min(ranked, k * c)
    score = beams.score()
    n = beams.rows
    device = score.device
    all_live = live_lprobs.size(0) == n
    live_score = score if all_live else score[beams.live]
    vocab = live_lprobs.size(1)
    per = n // n_sources if n_sources else 0  # live rows of each source, when all sources have as many
    # a child's score is in the more precise of the two (fairseq's adaptive softmax keeps float64)
    score = score.to(torch.result_type(live_lprobs, live_score))
    if like_fairseq and all_live and per in (1, k) and per * n_sources == n and c >= r and r < per * vocab:
        scores, idx = top_children(live_lprobs.reshape(n_sources, per, vocab), live_score.view(n_sources, per), r,
                                   fix_nan)
        parent = torch.arange(n_sources, device=device).unsqueeze(1) * per + idx // vocab
        return Ranked(scores, parent, idx % vocab)
    top_s, top_t = top_children(live_lprobs.unsqueeze(1), live_score.unsqueeze(1), c, fix_nan)
    if all_live:
        child_s, child_t = top_s, top_t
    else:
        child_s = score.new_full((n, c), -math.inf)
        child_t = torch.full((n, c), pad, dtype=torch.long, device=device)
        child_s[beams.live] = top_s
        child_t[beams.live] = top_t
        carried = ~beams.live
        child_s[carried, 0] = score[carried]

    counts = torch.zeros(n_sources, dtype=torch.long, device=device).index_add_(
        0, beams.src, torch.ones_like(beams.src)
    )
    starts = counts.cumsum(0) - counts
    slot = torch.arange(n, device=device) - starts[beams.src]
    flat = ((beams.src * k + slot) * c).unsqueeze(1) + torch.arange(c, device=device)
    grid = score.new_full((n_sources * k * c,), -math.inf)
    grid[flat.view(-1)] = child_s.reshape(-1)
    scores, idx = grid.view(n_sources, k * c).topk(r, dim=1)
    parent = (starts.unsqueeze(1) + idx // c).clamp_(max=max(n - 1, 0))
    return Ranked(scores, parent, child_t.view(-1)[(parent * c + idx % c).view(-1)].view(n_sources, r))
