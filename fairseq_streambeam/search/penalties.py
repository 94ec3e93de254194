"""fairseq's own per-step log-prob adjustments, applied to a cohort's live rows at once.

Same order and values as `SequenceGenerator._generate`, except that the maximum length is per
source (`source_max_len`), so results never depend on batch padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class FairseqPenalties:
    pad: int
    unk: int
    eos: int
    unk_penalty: float = 0.0
    min_len: int = 1
    suppress: Optional[Tensor] = None  # token ids never generated
    no_repeat_ngram: int = 0  # --no-repeat-ngram-size n (0 = off)

    def __call__(self, lprobs: Tensor, step: int, at_max_len: Optional[Tensor], prefix: Optional[Tensor],
                 tokens: Tensor, fix_nan: bool = True) -> Tensor:
        """lprobs [N, V] for live rows at decoding step `step` (0-based). `at_max_len` [N] bool
        (None when no row is at its limit); `prefix` [N] forced token per row (pad = free), or
        None when past every prefix; `tokens` [N, step + 1] the rows' prefixes (BOS first), read
        by n-gram repeat blocking only. Without `fix_nan` NaNs stay for the caller to rank as
        -inf: every other adjustment writes -inf or subtracts, so it gives the same log-probs."""
        self.fix_rows(lprobs, at_max_len, fix_nan)
        self.fix_columns(lprobs, step, free=prefix is None)
        if prefix is not None:
            forced = prefix != self.pad
            if at_max_len is not None:
                forced &= ~at_max_len
            chosen = lprobs.gather(1, prefix.unsqueeze(1))
            masked = torch.full_like(lprobs, -math.inf).scatter_(1, prefix.unsqueeze(1), chosen)
            lprobs = torch.where(forced.unsqueeze(1), masked, lprobs)
        if self.no_repeat_ngram:
            block_repeated_ngrams(lprobs, tokens, self.no_repeat_ngram)
        return lprobs

    def match_length(self, lprobs: Tensor, steps, length: Tensor) -> None:
        """--match-source-len as fairseq's task builds it (LengthConstrainedBeamSearch, both bounds at
        the source's length with EOS), after every other adjustment: rows at `steps` (an int, or [N])
        get no EOS before their `length` [N] and EOS at log-prob 0 from there on."""
        lprobs[:, self.eos] = torch.where(length > steps, -math.inf, 0.0)

    # Every adjustment but the unk penalty only writes -inf (or keeps the EOS column), and -inf -
    # penalty is -inf: the row-wide and the column adjustments commute, so a top-1 caller may apply
    # the cheap column writes first and the row-wide passes only if needed.

    def fix_rows(self, lprobs: Tensor, at_max_len: Optional[Tensor], fix_nan: bool = True) -> None:
        """The adjustments that read and write every entry: NaN -> -inf (fairseq's
        lprobs[lprobs != lprobs], in one pass and without a host sync; infinities stay as they are)
        and, at rows `at_max_len`, -inf everywhere but the EOS column (forced EOS at the maximum length)."""
        if fix_nan:
            lprobs.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        if at_max_len is not None:
            eos_col = lprobs[:, self.eos].clone()
            lprobs.masked_fill_(at_max_len.unsqueeze(1), -math.inf)
            lprobs[:, self.eos] = eos_col

    def fix_columns(self, lprobs: Tensor, step: int, before_min_len: Optional[Tensor] = None,
                    free: bool = True) -> None:
        """The adjustments that write a few columns: never pad, the unk penalty and, for rows not
        forced to a prefix token (`free`), no EOS before the minimum length and no suppressed token.
        Rows at different steps pass `before_min_len` [N] instead of relying on `step`."""
        lprobs.select(1, self.pad).fill_(-math.inf)  # lprobs[:, pad] = -inf, without indexing's slow path
        if self.unk_penalty:
            lprobs[:, self.unk] -= self.unk_penalty
        if not free:
            return
        if before_min_len is not None:
            lprobs[:, self.eos] = lprobs[:, self.eos].masked_fill(before_min_len, -math.inf)
        elif step < self.min_len:
            lprobs.select(1, self.eos).fill_(-math.inf)
        if self.suppress is not None:
            lprobs[:, self.suppress] = -math.inf


def block_repeated_ngrams(lprobs: Tensor, tokens: Tensor, n: int) -> None:
    """fairseq's --no-repeat-ngram-size n, in place: a token that would complete an n-gram already
    in the row's prefix (BOS included, as fairseq counts it) gets -inf. This is what fairseq's CUDA
    kernel computes; its CPU fallback compares against padding and blocks nothing (fairseq issue
    #5206). `tokens` [N, T] are the rows' prefixes; windows are compared with the last n - 1 tokens."""
    T = tokens.size(1)
    if T < n:
        return
    windows = tokens.unfold(1, n, 1)  # [N, T - n + 1, n]: every n-gram of the prefix
    if n > 1:
        match = (windows[:, :, :-1] == tokens[:, T - n + 1:].unsqueeze(1)).all(2)
    else:  # every token seen is banned, BOS (EOS) included, as in fairseq's kernel
        match = torch.ones(windows.shape[:2], dtype=torch.bool, device=tokens.device)
    # a [N, V] count of matches per token instead of indexing with the matches: no host sync
    hits = torch.zeros_like(lprobs).scatter_add_(1, windows[:, :, -1], match.to(lprobs.dtype))
    lprobs.masked_fill_(hits > 0, -math.inf)


def source_max_len(src_len_with_eos: int, max_len_a: float, max_len_b: int, model_max: int) -> int:
    """fairseq's limit min(a*x + b, max_positions - 1), with x this source's own length including
    EOS (fairseq uses the padded batch width, which makes output depend on the batch when a != 0)."""
    return int(min(max_len_a * src_len_with_eos + max_len_b, model_max - 1))  # no int() of a huge float


def length_norm(n: int, len_penalty: float) -> float:
    """fairseq's length normalizer n ** lenpen for a hypothesis of n tokens (EOS included), as a
    Python float; inf where that float overflows (fairseq raises OverflowError there), so an
    extreme lenpen gives a score of -0.0 instead of failing the whole batch."""
    try:
        return float(n) ** len_penalty
    except OverflowError:
        return math.inf
