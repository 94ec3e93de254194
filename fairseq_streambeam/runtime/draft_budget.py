"""How many draft tokens are worth verifying: online acceptance statistics of aggressive decoding.

Every verified draft slot costs decoder work whether or not it is accepted; on hardware where a
pass costs in proportion to its slots (CPUs, or large batches anywhere) verifying drafts that are
rarely reached is waste. `DraftBudget` counts, for each draft position j, how often it was reached
(all earlier drafts accepted) and accepted, and caps drafts at the last position whose estimated
chance of being reached is at least `min_reach`. Under top-1 verification capping drafts never
changes the output (the verifier adds its own token after the last accepted draft), only the
number of passes and slots; GAD++'s output depends on its drafts, so it takes no cap (spec.py).
"""

from __future__ import annotations

from typing import List, Optional


class DraftBudget:
    def __init__(self, min_reach: float = 0.0, prior: float = 2.0):
        if not 0.0 <= min_reach <= 1.0:
            raise ValueError(f"--draft-min-reach must be in [0, 1], got {min_reach}")
        self.min_reach = min_reach
        self.prior = prior  # pseudo-counts of acceptance per position, so early caps are not too tight
        self.reached: List[float] = []
        self.accepted: List[float] = []

    def cap(self, longest: int) -> int:
        """Most draft tokens worth verifying this pass (<= longest); all of them when disabled."""
        if self.min_reach <= 0.0:
            return longest
        reach = 1.0
        for j in range(longest):
            if reach < self.min_reach:
                return j
            reach *= self.acceptance(j)
        return longest

    def acceptance(self, j: int) -> float:
        """Estimated P(draft j accepted | drafts before j accepted)."""
        r = self.reached[j] if j < len(self.reached) else 0.0
        a = self.accepted[j] if j < len(self.accepted) else 0.0
        return (a + self.prior) / (r + self.prior) if r + self.prior > 0 else 1.0

    def update(self, lens: List[int], accepted: List[int]) -> None:
        """Row i verified lens[i] draft tokens and accepted the first accepted[i] of them."""
        grow = max(lens, default=0) - len(self.reached)  # none when not positive
        self.reached += [0.0] * grow
        self.accepted += [0.0] * grow
        for d, a in zip(lens, accepted):
            for j in range(min(a + 1, d)):  # positions 0..a were examined (a < d: position a rejected)
                self.reached[j] += 1
            for j in range(a):
                self.accepted[j] += 1


class DraftSwitch:
    """Drafting on or off, whichever has cost less wall time per output token (same output).

    A drafter that is rarely right makes every pass dearer (GAD runs the drafter model each pass)
    while adding few tokens. The switch keeps exponential averages of seconds and of accepted tokens
    per pass, with and without drafts, uses the mode with fewer seconds per token (the ratio of the
    averages: a mean of 1/tokens would overcharge drafting), and probes the other one now and then
    (one pass, its time weighed at 0.5): after `first_probe` passes, doubling the wait up to
    `max_probe` each time it loses. Tokens vary more than seconds, so they are averaged more slowly
    (`token_alpha`); the mode changes only after `confirm` winning probes in a row, and leaving
    drafting takes a gain of `margin` (going back, any gain, so a bad start does not lock it out).
    Each band of live rows (1-3, 4-15, 16-63, ...) keeps its own averages and decision: a pass's
    fixed cost makes time per token depend on its rows. The host clock sees the device's work
    through each pass's host copy. A probe times only its own pass: masked slots drafting leaves for
    later passes (batches with refill) are not charged to it. Measurements: docs/benchmarks.md."""

    def __init__(self, first_probe: int = 8, max_probe: int = 256, alpha: float = 0.2, token_alpha: float = 0.1,
                 confirm: int = 2, margin: float = 0.1):
        self.first_probe, self.max_probe, self.alpha = first_probe, max_probe, alpha
        self.token_alpha, self.confirm, self.margin = token_alpha, confirm, margin
        self.bands: dict = {}  # band of live rows -> _Band
        self.band: Optional[_Band] = None  # the band of the pass being decided and recorded

    def drafting(self, rows: int = 1) -> bool:
        """Draft in this pass of `rows` live rows?"""
        key = (max(rows, 1).bit_length() + 1) // 2  # 1-3 -> 1, 4-15 -> 2, 16-63 -> 3, ...
        if key not in self.bands:
            self.bands[key] = _Band(self)
        self.band = self.bands[key]
        return self.band.drafting()

    def record(self, drafted: bool, seconds: float, tokens: int) -> None:
        """The pass just decided took `seconds` for `tokens` output tokens, with (`drafted`) or
        without drafts."""
        if self.band is not None:
            self.band.record(drafted, seconds, tokens)


class _Band:
    """DraftSwitch's averages and decision for one band of row counts."""

    def __init__(self, switch: DraftSwitch):
        self.switch = switch  # the parameters
        self.seconds: dict = {True: None, False: None}  # averages per pass, drafting or not
        self.tokens: dict = {True: None, False: None}
        self.mode = True  # drafting until measured otherwise
        self.wait = switch.first_probe  # passes in `mode` before the other mode is measured again
        self.since = 0
        self.probing = False
        self.wins = 0  # probes in a row that found the other mode cheaper

    def drafting(self) -> bool:
        self.probing = self.since >= self.wait or self.seconds[not self.mode] is None and self.since >= 1
        return (not self.mode) if self.probing else self.mode

    def rate(self, drafted: bool) -> Optional[float]:
        """Seconds per accepted token in this mode (None before it is measured)."""
        seconds, tokens = self.seconds[drafted], self.tokens[drafted]
        return None if seconds is None or tokens is None else seconds / tokens

    def record(self, drafted: bool, seconds: float, tokens: int) -> None:
        if tokens <= 0:
            return
        sw = self.switch
        alpha = 0.5 if self.probing else sw.alpha  # a probed mode is measured rarely: weigh its time more
        for avg, value, a in ((self.seconds, seconds, alpha), (self.tokens, float(tokens), sw.token_alpha)):
            old = avg[drafted]
            avg[drafted] = value if old is None else old + a * (value - old)
        if not self.probing:
            self.since += 1
            return
        self.since, self.probing = 0, False
        other, current = self.rate(not self.mode), self.rate(self.mode)
        # leaving drafting (GAD's point) takes a clear gain; going back to it, any gain
        margin = sw.margin if self.mode else 0.0
        if other is not None and current is not None and other < current * (1.0 - margin):
            self.wins += 1
            if self.wins >= sw.confirm:  # the other mode is cheaper, probe after probe: use it
                self.mode, self.wait, self.wins = not self.mode, sw.first_probe, 0
            else:  # one probe is one noisy pass: measure again soon
                self.wait = sw.first_probe
        else:
            self.wins = 0
            self.wait = min(2 * self.wait, sw.max_probe)
