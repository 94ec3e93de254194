"""The scorer interface and a stack that composes scorers (applied in order, like a list of
logits processors). A scorer may keep one integer of state per candidate (e.g. an n-gram history
row); the stack keeps one state column per scorer, and the generator moves the rows with the
candidates through reordering, merges and refill."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor


class Scorer(Protocol):
    """A scorer whose file keys records by sentence id (LMBR posteriors, token masks) may also have
    `has_record(sentence_id) -> bool`, so that the sentences decoded without a record are counted
    (ScorerStack.missing); one without it has no record to miss."""

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

    def missing(self, sentence_ids: Sequence[int]) -> int:
        """How many of these sentences some scorer has no record for (`has_record`, see Scorer)."""
        checks = [s.has_record for s in self.scorers if hasattr(s, "has_record")]
        return sum(not all(has(int(sid)) for has in checks) for sid in sentence_ids)

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


def read_records(path: str, what: str, parse: Callable[[dict], Tuple[int, Any, List[int]]],
                 vocab: Optional[int]) -> Dict[int, Any]:
    """Sentence id -> value from a JSON-lines file, blank lines skipped. `parse(record)` gives (id,
    value, token ids) or raises ValueError/KeyError/TypeError, reported as `path:line: not a {what}
    record (...)`; each sentence has one record, and with `vocab` its token ids lie in 0..vocab-1.
    A file with no record is refused: the step that should have written it most likely failed."""
    out: Dict[int, Any] = {}
    seen: Dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sid, value, ids = parse(json.loads(line))
            except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError too
                raise ValueError(f"{path}:{ln}: not a {what} record ({e})") from None
            if sid in seen:
                raise ValueError(f"{path}:{ln}: sentence {sid} already has a record (line {seen[sid]})")
            bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{path}:{ln}: token id {bad[0]} is not in the target dictionary ({vocab} entries)")
            seen[sid], out[sid] = ln, value
    if not out:
        raise ValueError(f"{path}: no {what} record (the file is empty)")
    return out
