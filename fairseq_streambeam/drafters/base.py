"""The drafter interface of aggressive decoding: what AggressiveGenerator asks of IAD's input copy
and GAD's block drafter model. A drafter keeps one opaque state per cohort (rows decoded together)
and follows the cohort's row changes (rows leaving, cohorts merging)."""

from __future__ import annotations

from typing import Any, List, Protocol, Tuple

import numpy as np
import torch
from torch import Tensor


def pad_drafts(drafts: List[List[int]], pad: int, device) -> Tuple[Tensor, List[int]]:
    """Host-side drafts as the [N, d] padded tensor and lengths that `Drafter.propose` returns."""
    lens = [len(d) for d in drafts]
    out = np.full((len(drafts), max(lens, default=0)), pad, dtype=np.int64)  # numpy: no per-row tensors
    for i, d in enumerate(drafts):
        out[i, :len(d)] = d
    return torch.from_numpy(out).to(device), lens


class Drafter(Protocol):
    """Drafters see only what they are given: a row's source at `open` and the tokens it accepted
    after each pass. Whatever of the output they need (a tail, a count, the whole prefix) they
    keep in their own state; the generator's lists are never shared with them."""

    def open(self, srcs, rows: List[int]) -> Any:
        """State for window rows `rows` of `srcs` (a generators.common.Sources) entering decoding."""

    def propose(self, state: Any, caps: List[int]) -> Tuple[Tensor, List[int]]:
        """Drafts [N, d] (on the model's device, padded) and their lengths, each at most caps[i]."""

    def advance(self, state: Any, accepted: List[List[int]]) -> None:
        """After verification: the tokens row i accepted in this pass, its accepted draft tokens
        then the verifier's token (cut after EOS: such a row leaves at once)."""

    def select(self, state: Any, keep: List[int]) -> Any:
        """Keep rows `keep` (in that order)."""

    def merge(self, a: Any, b: Any) -> Any:
        """Rows of a, then rows of b."""


class RowListDrafter:
    """`select` and `merge` of a drafter whose state is a list with one item per row."""

    def select(self, state: list, keep: List[int]) -> list:
        return [state[i] for i in keep]

    def merge(self, a: list, b: list) -> list:
        return a + b
