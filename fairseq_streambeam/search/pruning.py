"""Beam-width rules of the paper (Yang et al. 2020, Sec. 3): fixed width k, absolute threshold
delta, and at most M candidates per parent. Fixed beam search is delta=inf, M=unlimited."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pruning:
    """k: most candidates a source keeps; delta: drop candidates more than delta below the source's
    best candidate or finished hypothesis; max_cands (M): most children of one parent per step.
    The values are checked by spec.DecodeSpec."""

    beam_size: int
    delta: float = math.inf
    max_cands: int = 0  # 0 = unlimited

    @property
    def is_fixed(self) -> bool:
        return math.isinf(self.delta) and self.max_cands == 0

    def children_per_parent(self, ranked: int, vocab: int) -> int:
        """How many children of each parent can matter: min(M, candidates ranked, vocab - 1)."""
        c = min(ranked, vocab - 1)
        return min(c, self.max_cands) if self.max_cands > 0 else c

    def threshold_keep(self, scores: np.ndarray, valid: np.ndarray, best_final: np.ndarray) -> np.ndarray:
        """Mask of candidates [B, R] within delta of the best of (top candidate, best finished), on the host."""
        if math.isinf(self.delta):
            return valid
        ref = np.maximum(np.where(valid, scores, -np.inf).max(1), best_final)
        return valid & (scores > (ref - self.delta)[:, None])
