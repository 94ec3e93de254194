"""The two bounds of drafting, for the benchmark. `OracleDrafter` knows the answer: it drafts each
source's known output (e.g. greedy decoding's), so every draft token is accepted; timing aggressive
decoding with it bounds what any drafter could reach with the same verifier, block size and
hardware (method `gad-oracle`). `NoDrafter` drafts nothing, so the generator decodes one token per
pass: its own cost as a greedy decoder, without drafting (method `no-draft`)."""

from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor

from .base import pad_drafts


class NoDrafter:
    """Drafts nothing: every pass verifies only the row's last token (greedy decoding, one token per pass)."""

    def open(self, srcs, rows: List[int]) -> int:
        self.pad, self.device = srcs.pad, srcs.device
        return len(rows)  # the state: how many rows

    def propose(self, state: int, caps: List[int]) -> Tuple[Tensor, List[int]]:
        return pad_drafts([[] for _ in range(state)], self.pad, self.device)

    def advance(self, state: int, accepted: List[List[int]]) -> None:
        pass

    def select(self, state: int, keep: List[int]) -> int:
        return len(keep)

    def merge(self, a: int, b: int) -> int:
        return a + b


class OracleDrafter:
    """Drafts the known output, at most `block_size` tokens per pass."""

    def __init__(self, truth: Dict[Tuple[int, ...], List[int]], block_size: int):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.truth = truth  # source tokens (with EOS, no padding) -> output tokens (with EOS)
        self.k = block_size

    def open(self, srcs, rows: List[int]) -> List[List[int]]:
        """The state: each row's known output not produced yet."""
        self.pad, self.device = srcs.pad, srcs.device
        return [list(self.truth[tuple(srcs.tokens(i))]) for i in rows]

    def propose(self, state: List[List[int]], caps: List[int]) -> Tuple[Tensor, List[int]]:
        return pad_drafts([rest[:min(self.k, c)] for rest, c in zip(state, caps)], self.pad, self.device)

    def advance(self, state: List[List[int]], accepted: List[List[int]]) -> None:
        for rest, acc in zip(state, accepted):
            del rest[:len(acc)]

    def select(self, state: List[List[int]], keep: List[int]) -> List[List[int]]:
        return [state[i] for i in keep]

    def merge(self, a: List[List[int]], b: List[List[int]]) -> List[List[int]]:
        return a + b
