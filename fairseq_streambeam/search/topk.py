"""`top_children`: the best children of each source's rows, as one torch.topk over their sums
finds them, found on the CPU through block maxima.

A beam step ranks `lprobs + score` over each source's rows x vocabulary. Eagerly that is three
passes over [rows, V] (fairseq's NaN -> -inf, the sum, torch.topk, which on the CPU copies every
element into a (value, index) list before selecting). Here one pass takes the maxima of blocks of
64-256 log-probs; a sum's block maximum is the block maximum's sum, as rounding is monotone, so
the r+1 best blocks are chosen from these, and only their elements are summed and ranked
(docs/benchmarks.md, "What the engine's parts save").

The result is torch.topk's over the sums, bit for bit, whenever that is unique: when the r+1
best sums of every source are distinct. Each chosen block holds its own maximum, so the gathered
sums include r+1 that are at least every other block's maximum: the (r+1)-th best gathered sum
bounds every sum outside them, and with r+1 distinct values the r best are the source's.
Otherwise, in any source of the call (ties, -inf, a NaN, whose block maximum is a NaN and so ranks
first), the sums are formed in full and ranked by torch.topk, which orders equal values its own
way, as fairseq's search sees them.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

BLOCKS = range(64, 257)  # block sizes (log-probs a block) that divide V, the nearest to 128 taken
MIN_ELEMENTS = 1 << 15  # smaller inputs take torch.topk: the block path's operators cost more


def block_size(v: int) -> int:
    """The block size for a vocabulary of `v` (0: none divides it, so ranking takes torch.topk;
    fairseq pads dictionaries to a multiple of 8, which most sizes fit)."""
    return min((b for b in BLOCKS if v % b == 0), key=lambda b: abs(b - 128), default=0)


def top_children(lprobs: Tensor, score: Tensor, r: int, fix_nan: bool = False) -> Tuple[Tensor, Tensor]:
    """The r best of `lprobs` [S, P, V] + `score` [S, P] (a row's score added to its V children),
    ranked per source over its P x V sums: values [S, r] and flat indices into P x V, as
    `(lprobs + score[..., None]).view(S, -1).topk(r)` gives them (in the two's promoted dtype).
    `fix_nan`: NaN log-probs count as -inf (fairseq's adjustment, when not made yet). `lprobs`
    may be overwritten."""
    s, p, v = lprobs.shape
    dtype = torch.result_type(lprobs, score)
    add = score.to(dtype).unsqueeze(2)
    b = block_size(v)
    if (not b or not lprobs.is_cpu or lprobs.dtype not in (torch.float32, torch.float64)
            or lprobs.numel() < MIN_ELEMENTS or r + 1 > p * v // b or not lprobs.is_contiguous()
            or torch.is_grad_enabled()):
        return _summed(lprobs, add, dtype, fix_nan).topk(r, dim=1)
    blocks = lprobs.view(-1, b)  # [S * P * V / b, b]: source-major, then row, then position
    keys = (blocks.amax(1).view(s, p, -1).to(dtype) + add).view(s, -1)
    chosen = keys.topk(r + 1, dim=1, sorted=False).indices  # [S, r + 1] blocks of each source
    first = torch.arange(0, s * keys.size(1), keys.size(1)).unsqueeze(1)
    sums = blocks.index_select(0, (chosen + first).view(-1)).view(s, r + 1, b).to(dtype)
    sums += add.view(s, p).gather(1, torch.div(chosen, v // b, rounding_mode="floor")).unsqueeze(2)
    top, pos = sums.view(s, -1).topk(r + 1, dim=1)
    if not bool((top[:, :-1] > top[:, 1:]).all()):
        return _summed(lprobs, add, dtype, fix_nan).topk(r, dim=1)
    pos = pos[:, :r]
    return top[:, :r].contiguous(), chosen.gather(1, torch.div(pos, b, rounding_mode="floor")) * b + pos % b


def _summed(lprobs: Tensor, add: Tensor, dtype: torch.dtype, fix_nan: bool) -> Tensor:
    """(lprobs + add) [S, P * V], in place where the dtype allows; NaN log-probs -> -inf first if
    asked (as fairseq orders it: a sum that is NaN, +inf plus -inf, stays NaN and ranks first)."""
    if fix_nan:
        lprobs.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    out = lprobs.add_(add) if dtype == lprobs.dtype else lprobs + add
    return out.reshape(out.size(0), -1)
