"""Cross-attention of each candidate for --print-alignment, kept as fairseq keeps it.

fairseq (SequenceGeneratorWithAlignment) returns each hypothesis's attention as a [source width,
target length] matrix in the batch's padded layout and derives hard or soft alignments from it. Here
each candidate's history is kept over its cohort's encoder positions and put back into that layout.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F
from fairseq import utils
from torch import Tensor


def extend(hist: Tensor, parents: Tensor, step_attn: Tensor, live_row: Tensor, stepped: Tensor) -> Tensor:
    """History of each child [K, L + 1, S]: its parent's history (`hist` [rows, L, S]) and, where the
    child was made this step (`stepped` [K]), the attention of its parent's live row `live_row` [K]
    in `step_attn` [live, S]; a carried finished candidate gets zeros, which its length never reads.
    The history keeps its dtype (float32, fairseq's attention dtype, for float64 models too)."""
    hist = pad_width(hist, step_attn.size(1))
    col = step_attn.index_select(0, live_row.clamp(min=0)) * stepped.unsqueeze(1).to(step_attn.dtype)
    return torch.cat([hist.index_select(0, parents), col.unsqueeze(1).to(hist.dtype)], 1)  # float32, as fairseq


def pad_width(hist: Tensor, width: int) -> Tensor:
    """Zero attention on encoder positions added on the right (merged cohorts pad the source)."""
    return hist if hist.size(2) >= width else F.pad(hist, (0, width - hist.size(2)))


def encoder_repads_right(model) -> bool:
    """fairseq's LSTMEncoder with `left_pad` moves left padding to the right before encoding
    (utils.convert_padding_direction): its outputs, and the attention over them that fairseq
    returns, hold each source at positions 0..n-1 whatever the sample's padding."""
    return any(getattr(getattr(m, "encoder", None), "left_pad", False) for m in model.models)


def cat(a: Tensor, b: Tensor) -> Tensor:
    """Histories of two cohorts of equal length, b's rows after a's."""
    width = max(a.size(2), b.size(2))
    return torch.cat([pad_width(a, width), pad_width(b, width)], 0)


def in_sample_layout(hist: Tensor, start: int, n: int, width: int, left_pad: bool) -> Tensor:
    """[width, T] attention of one hypothesis (`hist` [T, S]: its steps over its cohort's encoder
    positions, its source's n tokens at `start`), with the source placed as in the sample."""
    out = hist.new_zeros(width, hist.size(0))
    first = width - n if left_pad else 0
    out[first:first + n] = hist[:, start:start + n].t()
    return out


def add_alignments(results: List[List[Dict[str, Tensor]]], src_tokens: Tensor, pad: int, eos: int,
                   kind: str) -> None:
    """fairseq's hard or soft alignment of every hypothesis, from its attention (on the host, as
    fairseq's SequenceGeneratorWithAlignment computes it)."""
    extract = utils.extract_hard_alignment if kind == "hard" else utils.extract_soft_alignment
    src = src_tokens.cpu()
    for i, hypos in enumerate(results):
        for h in hypos:
            if h["attention"].numel() == 0:  # a source with no finished hypothesis: EOS alone
                continue
            h["alignment"] = extract(h["attention"].t().float().cpu(), src[i], h["tokens"].cpu(), pad, eos)
