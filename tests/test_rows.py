"""runtime.rows.Rows: every field follows select and cat, whatever its kind."""

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from fairseq_streambeam.runtime.rows import Rows


@dataclass
class _Rows(Rows):
    ids: List[int]
    lengths: np.ndarray
    scores: torch.Tensor
    outs: List[List[int]]
    extra: Optional[torch.Tensor] = None


def _make(start: int, n: int) -> _Rows:
    ids = list(range(start, start + n))
    return _Rows(ids, np.array(ids) * 10, torch.tensor(ids, dtype=torch.float64) / 2, [[i] * (i % 3) for i in ids])


def _check(rows: _Rows, ids: List[int]) -> None:
    assert rows.ids == ids
    assert rows.lengths.tolist() == [i * 10 for i in ids]
    assert rows.scores.tolist() == [i / 2 for i in ids]
    assert rows.outs == [[i] * (i % 3) for i in ids]
    assert rows.extra is None
    assert len(rows) == len(ids)


def test_select_and_cat_keep_every_field_in_step():
    a, b = _make(0, 4), _make(10, 3)
    both = _Rows.cat([a, b])
    _check(both, [0, 1, 2, 3, 10, 11, 12])
    _check(both.select([6, 0, 3]), [12, 0, 3])
    _check(both.select([]), [])
    kept = a.select([1, 2])
    kept.outs[0].append(99)  # lists of lists are shared with the source rows, as the generators expect
    assert a.outs[1] == [1, 99]


@dataclass
class _Group(Rows):
    first: torch.Tensor
    second: np.ndarray


@dataclass
class _Nested(Rows):
    ids: List[int]
    group: _Group


def test_nested_rows_follow_select_and_cat():
    def make(ids):
        return _Nested(list(ids), _Group(torch.tensor(ids) * 2, np.array(ids) * 3))

    both = _Nested.cat([make([0, 1, 2]), make([7, 8])])
    got = both.select([4, 0, 2])
    assert got.ids == [8, 0, 2] and len(got) == 3
    assert got.group.first.tolist() == [16, 0, 4] and got.group.second.tolist() == [24, 0, 6]
