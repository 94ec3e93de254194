"""IAD drafter (Ge et al. 2022): the draft is the source's continuation from where the output is
aligned with it. After a bifurcation the alignment is lost; it is found again once the output's
last `ngram` tokens occur exactly once in the source (a unique-substring match). Meanwhile a row
drafts from a guessed edit: where the source resumes if the model's token deleted source tokens
(it occurs just ahead in the source), or, for batched rows only, replaced one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from torch import Tensor

from .base import RowListDrafter, pad_drafts


@dataclass
class CopyState:
    src: List[int]  # source tokens including its EOS, so a draft can end the output
    pos: Optional[int] = 0  # next source position to copy from; None = not aligned
    last: Optional[List[int]] = None  # the draft of the pass being verified
    tail: List[int] = field(default_factory=list)  # the output's last `ngram` tokens (realignment)
    guess: Optional[int] = None  # unaligned: where the source probably continues after the last edit
    skipped: bool = False  # the guess is a deletion's (the model's token occurs ahead in the source)
    from_guess: bool = False  # the draft being verified was copied from `guess`


AUTO_BATCHED_BLOCK = 8  # batched rows pay for the widest draft: a cap (docs/benchmarks.md); a lone row is uncapped
DELETION_WINDOW = 16  # how far ahead of an edit the model's token is looked for (a deletion's guess)


class InputCopyDrafter(RowListDrafter):
    """`block_size` caps the draft; 0 = automatic: the whole remaining source for a lone row (the
    paper), `AUTO_BATCHED_BLOCK` tokens when rows are batched (every row pays for the widest draft).
    `vocab_map`: the target id of each source id when the dictionaries differ (drafts are target
    tokens), else None."""

    def __init__(self, ngram: int = 2, block_size: int = 0, vocab_map: Optional[List[int]] = None):
        if ngram < 1:
            raise ValueError(f"--iad-ngram must be >= 1, got {ngram}")
        if block_size < 0:
            raise ValueError(f"--block-size must be >= 1 (or 0 = the whole remaining source), got {block_size}")
        self.ngram = ngram
        self.block_size = block_size
        self.vocab_map = vocab_map

    # ---- the cohort interface (drafters.base.Drafter): one CopyState per row ----

    def open(self, srcs, rows: List[int]) -> List[CopyState]:
        self.pad, self.device = srcs.pad, srcs.device
        return [self.start(srcs.tokens(i)) for i in rows]

    def propose(self, state: List[CopyState], caps: List[int]) -> Tuple[Tensor, List[int]]:
        drafts = [self.draft(st, batched=len(state) > 1, cap=cap) for st, cap in zip(state, caps)]
        return pad_drafts(drafts, self.pad, self.device)

    def advance(self, state: List[CopyState], accepted: List[List[int]]) -> None:
        for st, acc in zip(state, accepted):
            self.update(st, acc)

    # ---- one row ----

    def start(self, src: List[int]) -> CopyState:
        m = self.vocab_map
        return CopyState(list(src) if m is None else [m[i] for i in src])

    def draft(self, st: CopyState, batched: bool = False, cap: Optional[int] = None) -> List[int]:
        """The source from the aligned position, at most `cap` tokens (the draft `update` checks). An
        unaligned row drafts from its guess: a row in a batch from any guess, as its slots are paid
        for anyway (the block is as wide as the widest draft); a lone row from a deletion's only, as a
        pass costs it far more than a slot (reading the weights) and a replacement's rarely holds."""
        pos, st.from_guess = st.pos, False
        if pos is None and st.guess is not None and (batched or st.skipped):
            pos, st.from_guess = st.guess, True
        if pos is None:
            st.last = []
            return st.last
        size = self.block_size or (AUTO_BATCHED_BLOCK if batched else 0)
        st.last = st.src[pos:pos + size if size else None][:cap]
        return st.last

    def update(self, st: CopyState, accepted: List[int]) -> None:
        """After a pass that accepted `accepted` (the accepted draft tokens, then one model token):
        keep copying if the model's token continues the source, else realign by n-gram."""
        draft, matched, last = st.last or [], len(accepted) - 1, accepted[-1]
        st.tail = (st.tail + accepted)[-self.ngram:]
        start = st.guess if st.from_guess else st.pos
        if start is not None and matched == len(draft):
            nxt = start + matched
            if nxt < len(st.src) and last == st.src[nxt]:
                st.pos, st.guess = nxt + 1, None
                return
        st.pos = self._realign(st.src, st.tail)
        # where the source probably resumes: the model's token deleted source tokens b.. up to its
        # next occurrence, or else replaced source token b; a guess that failed at once is not
        # guessed again
        st.guess, st.skipped = None, False
        if st.pos is None and start is not None and not (st.from_guess and matched == 0):
            b = start + matched
            ahead = st.src[b + 1:b + 1 + DELETION_WINDOW]
            if last in ahead:
                hit = b + 2 + ahead.index(last)
                st.guess, st.skipped = (hit, True) if hit < len(st.src) else (None, False)
            elif b + 1 < len(st.src):
                st.guess = b + 1

    def _realign(self, src: List[int], tail: List[int]) -> Optional[int]:
        """Where the source continues after `tail` (the output's last tokens), if they occur
        exactly once in it."""
        n = len(tail)
        hits = [i for i in range(len(src) - n + 1) if src[i:i + n] == tail]
        return hits[0] + n if len(hits) == 1 else None
