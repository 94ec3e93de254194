"""The scorer interface and a stack that composes scorers (applied in order, like a list of
logits processors). A scorer may keep one integer of state per candidate (e.g. an n-gram history
row); the stack keeps one state column per scorer, and the generator moves the rows with the
candidates through reordering, merges and refill."""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence

import torch
from torch import Tensor


class Scorer(Protocol):
    def reset(self) -> None:
        """Forget per-sentence tables (called once per generate call)."""

    def start(self, sentence_ids: Sequence[int], device: torch.device) -> Tensor:
        """Initial state [B] (long) of newly admitted sentences."""

    def score(self, lprobs: Tensor, state: Tensor) -> Tensor:
        """Adjusted log-probs [N, V] for live candidates with state [N]; may work in place."""

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        """State after appending `tokens` [N] (pad = a finished candidate carried unchanged)."""


class ScorerStack:
    def __init__(self, scorers: Sequence[Scorer]):
        self.scorers = list(scorers)

    def reset(self) -> None:
        for s in self.scorers:
            s.reset()

    def start(self, sentence_ids: Sequence[int], device: torch.device) -> Tensor:
        return torch.stack([s.start(sentence_ids, device) for s in self.scorers], 1)

    def score(self, lprobs: Tensor, state: Tensor) -> Tensor:
        for k, s in enumerate(self.scorers):
            lprobs = s.score(lprobs, state[:, k])
        return lprobs

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        return torch.stack([s.advance(state[:, k], tokens) for k, s in enumerate(self.scorers)], 1)


def whole(value, what: str) -> int:
    """A JSON integer (not a float such as 5.7, which int() would cut to 5, nor a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} {value!r} is not a whole number")
    return value


def first_record(seen: Dict[int, int], sid: int, path: str, line: int) -> None:
    """Sentence `sid` has no record before line `line` of `path` (a second one would replace it)."""
    if sid in seen:
        raise ValueError(f"{path}:{line}: sentence {sid} already has a record (line {seen[sid]})")
    seen[sid] = line


def check_ids(path: str, line: int, ids: List[int], vocab: Optional[int]) -> None:
    """Token ids read from line `line` of `path` lie in a dictionary of `vocab` entries."""
    bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{path}:{line}: token id {bad[0]} is not in the target dictionary ({vocab} entries)")
