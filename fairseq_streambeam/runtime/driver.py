"""Streaming driver: admit, step, evict, merge; the loop of every generator in the package.

A generator hands the driver an `Engine`: how to start a cohort of new sources, how to step a
cohort (one beam step, or one draft-and-verify pass), and which cohorts may merge. The driver
decides when sources enter and which cohort steps next (a runtime.scheduler.Scheduler), counts
the live budget, and merges cohorts once they can share a decoder call. The schedule changes
speed, never output: every source evolves independently of the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Generic, Iterable, Iterator, List, Sequence, TypeVar, Union

from .scheduler import Cohort, Scheduler

G = TypeVar("G", bound=Cohort)


@dataclass
class Engine(Generic[G]):
    """What a generator does for the driver. `admit(rows, serial)`: a new cohort for window rows
    `rows`; `step(cohort)`: one step, returning the window rows that finished; `mergeable(a, b)`
    and `merge(a, b)` (b's sources after a's). `joins_live`: new sources join the first live
    cohort at once (their state is primed to step with rows further along)."""

    admit: Callable[[List[int], int], G]
    step: Callable[[G], List[int]]
    mergeable: Callable[[G, G], bool]
    merge: Callable[[G, G], G]
    joins_live: bool = False


class Feed:
    """Sources waiting to enter, in admission order (window rows), and every row's length in
    tokens. Offline, the window's rows are all known at the start; online (generators/online.py)
    rows are pushed while the run goes on, and dropped if their request goes away first."""

    def __init__(self, lengths: Union[Sequence[int], Dict[int, int]], order: Iterable[int] = ()):
        self.lengths = lengths
        self.waiting: Deque[int] = deque(order)

    def push(self, row: int) -> None:
        self.waiting.append(row)

    def drop(self, rows: Iterable[int]) -> List[int]:
        """Remove waiting rows `rows`; returns those that were still waiting."""
        gone = set(rows) & set(self.waiting)
        if gone:
            self.waiting = deque(r for r in self.waiting if r not in gone)
        return sorted(gone)

    def pending(self) -> Iterator[int]:
        return (self.lengths[i] for i in self.waiting)

    def take(self, n: int) -> List[int]:
        return [self.waiting.popleft() for _ in range(n)]


class Driver:
    """Runs engines under one scheduler. `width`: running estimate of candidates per live source,
    for candidate budgets; it carries over from one window to the next."""

    def __init__(self, scheduler: Scheduler, width: float = 1.0):
        self.scheduler = scheduler
        self.width = width

    def run(self, engine: Engine[G], lengths: Sequence[int], order: Sequence[int]) -> None:
        """Decode the window's sources (`lengths`: tokens per window row) admitted in `order`."""
        run = Run(self, engine, Feed(lengths, order))
        while run.busy:
            run.step()


class Run(Generic[G]):
    """One engine's cohorts and feed under a driver, advanced one cohort step at a time."""

    def __init__(self, driver: Driver, engine: Engine[G], feed: Feed):
        self.driver, self.engine, self.feed = driver, engine, feed
        self.cohorts: List[G] = []
        self.admitted = 0  # admission serial
        self.live_tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self.cohorts or self.feed.waiting)

    @property
    def live_sources(self) -> int:
        return sum(g.n_sources for g in self.cohorts)

    @property
    def live_candidates(self) -> int:
        return sum(g.n_candidates for g in self.cohorts)

    def step(self) -> List[int]:
        """Admit new sources if the scheduler refills now, then step one cohort; returns the window
        rows that finished."""
        d, engine, sched, feed = self.driver, self.engine, self.driver.scheduler, self.feed
        cohorts = self.cohorts
        live, cands = self.live_sources, self.live_candidates
        if live:
            d.width = 0.9 * d.width + 0.1 * (cands / live)
        # a new cohort steps before more sources come (unless they join the live cohort at once)
        waiting = not engine.joins_live and any(g.steps == 0 for g in cohorts)
        if feed.waiting and not waiting and sched.should_refill(live, self.live_tokens, cands):
            take = sched.admit(live, self.live_tokens, feed.pending(), cands, d.width)
            if take:
                rows = feed.take(take)
                self.admitted += take
                self.live_tokens += sum(feed.lengths[i] for i in rows)
                new = engine.admit(rows, self.admitted)
                if engine.joins_live and cohorts:
                    cohorts[0] = engine.merge(cohorts[0], new)
                else:
                    cohorts.append(new)
        if not cohorts:
            return []
        i = sched.pick(cohorts)
        g = cohorts[i]
        for other in cohorts:
            other.waited += 1
        g.waited = 0
        done = engine.step(g)
        self.live_tokens -= sum(feed.lengths[j] for j in done)
        if not g.n_sources:
            cohorts.pop(i)
            return done
        for j, other in enumerate(cohorts):
            if other is not g and engine.mergeable(other, g):
                cohorts[j] = engine.merge(other, g)
                cohorts.remove(g)
                break
        return done
