"""Scheduling: which cohort steps next, and when and how many new sources enter.

Policies (the output never depends on them; only speed does):
- ``batch``: admit a batch, decode it until every source is done, then admit the next
  (fairseq's behaviour; VAR-BATCH in the paper).
- ``min-length``: step the cohort with the shortest target prefix; refill when fewer than
  eps*n sources are live (VAR-STREAM, Yang et al. 2020).
- ``fifo``: like min-length, but step the cohort holding the earliest-admitted source (paper A.2).
- ``continuous``: every live source steps in each decoder call, whatever its prefix length: new
  sources join the one live batch at once (the generator keeps a single cohort whose rows carry
  their own positions), so a step expands the whole budget; refill as min-length.
A latency bound (`max_wait`) steps a cohort first once it has waited that many decoder steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

POLICIES = ("batch", "min-length", "fifo", "continuous")
RAGGED = ("continuous",)  # policies whose one cohort holds sources at different steps


class Cohort(Protocol):
    """Live sources decoded together (one cache, one decoder call per step): a beam cohort, or a
    draft-and-verify cohort of aggressive decoding."""

    steps: int  # decoder steps taken so far (0: not stepped yet; draft-and-verify: passes)
    waited: int  # steps since this cohort last stepped (the latency bound)
    first_serial: int  # admission serial of its earliest source (fifo)

    @property
    def n_sources(self) -> int: ...

    @property
    def n_candidates(self) -> int: ...


@dataclass
class Budget:
    """Live budget: at most `max_sentences` sources, `max_tokens` source tokens, and (streaming)
    about `max_candidates` live beam candidates. With variable-width beams a source budget leaves
    the batch mostly empty; a candidate budget refills by what a decoder step actually expands."""

    max_sentences: Optional[int] = None
    max_tokens: Optional[int] = None
    max_candidates: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_sentences is None and self.max_tokens is None and self.max_candidates is None:
            self.max_sentences = 64
        for name in ("max_sentences", "max_tokens", "max_candidates"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"stream budget {name} must be >= 1, got {v}")


class Scheduler:
    def __init__(self, policy: str, budget: Budget, refill_eps: float = 1 / 6, max_wait: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {POLICIES}")
        if not isinstance(budget, Budget):  # e.g. budget=64 from Python: it would fail at the first refill
            raise TypeError(f"budget must be a Budget, e.g. Budget(max_sentences=64), got {budget!r}")
        self.policy = policy
        self.budget = budget
        self.eps = refill_eps
        self.max_wait = max_wait

    def should_refill(self, live_sources: int, live_tokens: int, live_candidates: int = 0) -> bool:
        if live_sources == 0:
            return True
        if self.policy == "batch":
            return False
        b = self.budget
        if b.max_candidates is not None:
            return live_candidates < self.eps * b.max_candidates
        if b.max_sentences is not None:
            return live_sources < self.eps * b.max_sentences
        return live_tokens < self.eps * b.max_tokens  # Budget: max_tokens is set when the others are not

    def admit(self, live_sources: int, live_tokens: int, pending_lengths: Iterable[int], live_candidates: int = 0,
              width: float = 1.0) -> int:
        """How many of the pending sources (in order) to admit now; at least one when none is live.
        `width` estimates the candidates a source will hold (for the candidate budget)."""
        b = self.budget
        n = 0
        tokens = live_tokens
        for length in pending_lengths:
            if b.max_sentences is not None and live_sources + n >= b.max_sentences:
                break
            if b.max_tokens is not None and tokens + length > b.max_tokens and live_sources + n > 0:
                break
            if (b.max_candidates is not None and live_candidates + (n + 1) * max(width, 1.0) > b.max_candidates
                    and live_sources + n > 0):
                break
            n += 1
            tokens += length
        return n

    def pick(self, cohorts: Sequence[Cohort]) -> int:
        """Index of the cohort to step next."""
        if self.max_wait:
            waited = max(range(len(cohorts)), key=lambda i: cohorts[i].waited)
            if cohorts[waited].waited >= self.max_wait:
                return waited
        if self.policy == "fifo":
            return min(range(len(cohorts)), key=lambda i: cohorts[i].first_serial)
        return min(range(len(cohorts)), key=lambda i: cohorts[i].steps)
