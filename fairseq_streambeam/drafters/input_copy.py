"""IAD drafter (Ge et al. 2022): the draft is the source's continuation from where the output is
aligned with it. After a bifurcation the alignment is lost; it is found again once the output's
last `ngram` tokens occur exactly once in the source (a unique-substring match)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor


@dataclass
class CopyState:
    src: List[int]  # source tokens including its EOS, so a draft can end the output
    pos: Optional[int] = 0  # next source position to copy from; None = not aligned
    last: Optional[List[int]] = None  # the draft of the pass being verified


AUTO_BATCHED_BLOCK = 8  # measured on gec-tiny, CoNLL-14, CPU: batch 32 fastest at 4-8, batch 1 uncapped


class InputCopyDrafter:
    """`block_size` caps the draft; 0 = automatic: the whole remaining source for a lone row (the
    paper), `AUTO_BATCHED_BLOCK` tokens when rows are batched, where every row pays for the widest
    draft of the pass."""

    def __init__(self, ngram: int = 2, block_size: int = 0):
        if ngram < 1:
            raise ValueError(f"--iad-ngram must be >= 1, got {ngram}")
        if block_size < 0:
            raise ValueError(f"--block-size must be >= 1 (or 0 = the whole remaining source), got {block_size}")
        self.ngram = ngram
        self.block_size = block_size

    # ---- the group interface (drafters.base.Drafter): one CopyState per row ----

    def open(self, srcs, rows: List[int]) -> List[CopyState]:
        self.pad, self.device = srcs.pad, srcs.net_input["src_tokens"].device
        return [self.start(srcs.tokens(i)) for i in rows]

    def propose(self, state: List[CopyState], outs: List[List[int]], caps: List[int]) -> Tuple[Tensor, List[int]]:
        drafts = [self.draft(st, batched=len(state) > 1)[:cap] for st, cap in zip(state, caps)]
        for st, d in zip(state, drafts):
            st.last = d
        width = max((len(d) for d in drafts), default=0)
        out = torch.full((len(drafts), width), self.pad, dtype=torch.long)
        for i, d in enumerate(drafts):
            out[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        return out.to(self.device), [len(d) for d in drafts]

    def advance(self, state: List[CopyState], outs: List[List[int]], matched: List[int]) -> None:
        for st, j, out in zip(state, matched, outs):
            self.update(st, st.last or [], j, out)

    def select(self, state: List[CopyState], keep: List[int]) -> List[CopyState]:
        return [state[i] for i in keep]

    def merge(self, a: List[CopyState], b: List[CopyState]) -> List[CopyState]:
        return a + b

    # ---- one row ----

    def start(self, src: List[int]) -> CopyState:
        return CopyState(list(src), 0)

    def draft(self, st: CopyState, batched: bool = False) -> List[int]:
        if st.pos is None:
            return []
        cap = self.block_size or (AUTO_BATCHED_BLOCK if batched else 0)
        end = len(st.src) if not cap else min(len(st.src), st.pos + cap)
        return st.src[st.pos:end]

    def update(self, st: CopyState, draft: List[int], matched: int, output: List[int]) -> None:
        """After a pass that accepted `matched` draft tokens plus one model token (the last of
        `output`): keep copying if that token continues the source, else realign by n-gram."""
        if st.pos is not None and matched == len(draft):
            nxt = st.pos + matched
            if nxt < len(st.src) and output and output[-1] == st.src[nxt]:
                st.pos = nxt + 1
                return
        st.pos = self._realign(st.src, output)

    def _realign(self, src: List[int], output: List[int]) -> Optional[int]:
        n = min(self.ngram, len(output))
        if n == 0:
            return None
        tail = output[-n:]
        hits = [i for i in range(len(src) - n + 1) if src[i:i + n] == tail]
        return hits[0] + n if len(hits) == 1 else None
