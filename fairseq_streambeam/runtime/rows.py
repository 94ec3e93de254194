"""Row container: per-row (or per-source) fields that must stay in step.

A `Rows` dataclass holds one entry per row in each of its fields: a tensor (indexed on its
first dimension), a numpy array, a list, a nested `Rows` (a group of fields), or None (an
absent field). `select` and `cat` apply to every field at once, so rows leaving or cohorts
merging never leave a field behind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, TypeVar

import numpy as np
import torch
from torch import Tensor

R = TypeVar("R", bound="Rows")


@dataclasses.dataclass
class Rows:
    def __len__(self) -> int:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                return len(value)
        return 0

    def select(self: R, keep: Sequence[int]) -> R:
        """Rows `keep`, in that order."""
        return self._select(np.asarray(keep, dtype=np.int64), {})

    def _select(self: R, idx: np.ndarray, tensors: dict) -> R:
        """`select` with `tensors`: one index tensor per device, shared with nested Rows fields."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Rows):
                out[f.name] = value._select(idx, tensors)
            elif isinstance(value, Tensor):
                dev = value.device
                if dev not in tensors:
                    tensors[dev] = torch.from_numpy(idx).to(dev)
                out[f.name] = value.index_select(0, tensors[dev])
            else:
                out[f.name] = _take(value, idx)
        return type(self)(**out)

    @classmethod
    def cat(cls: type[R], parts: Sequence[R]) -> R:
        """Rows of each part in turn."""
        return cls(**{f.name: _join([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)})


def _take(value: Any, idx: np.ndarray) -> Any:
    if value is None:
        return None
    return value[idx] if isinstance(value, np.ndarray) else [value[i] for i in idx]


def _join(values: List[Any]) -> Any:
    if values[0] is None:
        return None
    if isinstance(values[0], Rows):
        return type(values[0]).cat(values)
    if isinstance(values[0], Tensor):
        return torch.cat(values)
    return np.concatenate(values) if isinstance(values[0], np.ndarray) else [x for v in values for x in v]
