"""How many draft tokens are worth verifying: online acceptance statistics of aggressive decoding.

Every verified draft slot costs decoder work whether or not it is accepted; on hardware where a
pass costs in proportion to its slots (CPUs, or large batches anywhere) verifying drafts that are
rarely reached is waste. `DraftBudget` counts, for each draft position j, how often it was reached
(all earlier drafts accepted) and accepted, and caps drafts at the last position whose estimated
chance of being reached is at least `min_reach`. Capping drafts never changes the output (the
verifier adds its own token after the last accepted draft), only the number of passes and slots.
"""

from __future__ import annotations

from typing import List


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
        longest = max(lens, default=0)
        if longest > len(self.reached):
            grow = longest - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for d, a in zip(lens, accepted):
            for j in range(min(a + 1, d)):  # positions 0..a were examined (a < d: position a rejected)
                self.reached[j] += 1
            for j in range(a):
                self.accepted[j] += 1
