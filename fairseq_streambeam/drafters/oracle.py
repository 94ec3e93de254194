"""The two bounds of drafting, for the benchmark. `OracleDrafter` drafts each source's known output
(e.g. greedy decoding's), so every draft token is accepted: the bound of any drafter with the same
verifier, block size and hardware (method `gad-oracle`). Knowing no output, it drafts nothing: the
generator's own cost as a greedy decoder, one token per pass (method `no-draft`)."""

from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor

from .base import RowListDrafter, pad_drafts


class OracleDrafter(RowListDrafter):
    """Drafts the known output, at most `block_size` tokens per pass."""

    def __init__(self, truth: Dict[Tuple[int, ...], List[int]], block_size: int):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.truth = truth  # source tokens (with EOS, no padding) -> output tokens (with EOS)
        self.k = block_size

    def open(self, srcs, rows: List[int]) -> List[List[int]]:
        """The state: each row's known output not produced yet."""
        self.pad, self.device = srcs.pad, srcs.device
        if not self.truth:  # no-draft: no source's tokens need reading (a host copy on CUDA)
            return [[] for _ in rows]
        return [list(self.truth[tuple(srcs.tokens(i))]) for i in rows]

    def propose(self, state: List[List[int]], caps: List[int]) -> Tuple[Tensor, List[int]]:
        return pad_drafts([rest[:min(self.k, c)] for rest, c in zip(state, caps)], self.pad, self.device)

    def advance(self, state: List[List[int]], accepted: List[List[int]]) -> None:
        for rest, acc in zip(state, accepted):
            del rest[:len(acc)]
