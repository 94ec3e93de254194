"""Streaming driver: admit, step, evict, merge; the loop of every generator in the package.

A generator hands the driver an `Engine`: how to start a cohort of new sources, how to step a
cohort (one beam step, or one draft-and-verify pass), and which cohorts may merge. The driver
decides when sources enter and which cohort steps next (a runtime.scheduler.Scheduler), counts
the live budget, and merges cohorts once they can share a decoder call. The schedule changes
speed, never output: every source evolves independently of the others.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Generic, List, Sequence, TypeVar

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


class Driver:
    """Runs engines under one scheduler. `width`: running estimate of candidates per live source,
    for candidate budgets; it carries over from one window to the next."""

    def __init__(self, scheduler: Scheduler, width: float = 1.0):
        self.scheduler = scheduler
        self.width = width

    def run(self, engine: Engine[G], lengths: Sequence[int], order: Sequence[int]) -> None:
        """Decode the window's sources (`lengths`: tokens per window row) admitted in `order`."""
        sched = self.scheduler
        cohorts: List[G] = []
        next_src, live_tokens = 0, 0
        while next_src < len(order) or cohorts:
            live = sum(g.n_sources for g in cohorts)
            cands = sum(g.n_candidates for g in cohorts)
            if live:
                self.width = 0.9 * self.width + 0.1 * (cands / live)
            # a new cohort steps before more sources come (unless they join the live cohort at once)
            waiting = not engine.joins_live and any(g.steps == 0 for g in cohorts)
            if next_src < len(order) and not waiting and sched.should_refill(live, live_tokens, cands):
                pending = (lengths[i] for i in itertools.islice(order, next_src, None))
                take = sched.admit(live, live_tokens, pending, cands, self.width)
                if take:
                    rows = list(order[next_src: next_src + take])
                    next_src += take
                    live_tokens += sum(lengths[i] for i in rows)
                    new = engine.admit(rows, next_src)
                    if engine.joins_live and cohorts:
                        cohorts[0] = engine.merge(cohorts[0], new)
                    else:
                        cohorts.append(new)
            i = sched.pick(cohorts)
            g = cohorts[i]
            for other in cohorts:
                other.waited += 1
            g.waited = 0
            done = engine.step(g)
            live_tokens -= sum(lengths[j] for j in done)
            if not g.n_sources:
                cohorts.pop(i)
                continue
            for j, other in enumerate(cohorts):
                if other is not g and engine.mergeable(other, g):
                    cohorts[j] = engine.merge(other, g)
                    cohorts.remove(g)
                    break
