"""The drafter interface of aggressive decoding: what AggressiveGenerator asks of IAD's input copy
and GAD's block drafter model. A drafter keeps one opaque state per group of rows decoded together
and must follow the group's row changes (rows leaving, groups merging)."""

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
    def open(self, srcs, rows: List[int]) -> Any:
        """State for window rows `rows` of `srcs` (a generators.common.Sources) entering decoding."""

    def propose(self, state: Any, outs: List[List[int]], caps: List[int]) -> Tuple[Tensor, List[int]]:
        """Drafts [N, d] (on the model's device, padded) and their lengths, each at most caps[i],
        given the output so far of each row."""

    def advance(self, state: Any, outs: List[List[int]], matched: List[int]) -> None:
        """After verification: row i accepted matched[i] draft tokens plus one verifier token; its
        output is now outs[i]."""

    def select(self, state: Any, keep: List[int]) -> Any:
        """Keep rows `keep` (in that order)."""

    def merge(self, a: Any, b: Any) -> Any:
        """Rows of a, then rows of b."""
