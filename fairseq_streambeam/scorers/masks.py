"""Per-sentence token masks applied before top-k (the constraints of Iglesias et al.'s
Algorithm 1): each sentence may allow only a set of tokens, or ban a set. Kept sparse (a padded
list per sentence), applied to a batch of live candidates with one gather/scatter."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import read_records, whole

Mask = Tuple[str, List[int]]  # ("allow" | "ban", token ids)


def load_masks(path: str, vocab: Optional[int] = None) -> Dict[int, Mask]:
    """JSON lines `{"id": sentence id, "allow": [ids]}` or `{"id": ..., "ban": [ids]}`; with `vocab`,
    every token id must be one of the target dictionary's (0..vocab-1)."""

    def parse(rec):
        kinds = [k for k in ("allow", "ban") if k in rec] if isinstance(rec, dict) else []
        if len(kinds) != 1 or "id" not in rec or not isinstance(rec[kinds[0]], list):
            raise ValueError('a mask record has an "id" and exactly one list "allow" or "ban"')
        toks = [whole(t, "token id") for t in rec[kinds[0]]]
        return whole(rec["id"], "id"), (kinds[0], toks), toks

    return read_records(path, "mask", parse, vocab)


class TokenMaskScorer:
    """State per candidate: its sentence's row in the mask table (-1 = unconstrained)."""

    def __init__(self, masks: Dict[int, Mask], eos: int, pad: int):
        self.masks = masks
        self.eos, self.pad = eos, pad
        self.reset()

    def reset(self) -> None:
        self.rows: List[Tuple[bool, List[int]]] = []
        self.table = self.allow = None

    def has_record(self, sentence_id: int) -> bool:
        return int(sentence_id) in self.masks

    def start(self, sentence_ids: Sequence[int], device: torch.device) -> Tensor:
        ids = []
        for sid in sentence_ids:
            m = self.masks.get(int(sid))
            if m is None:
                ids.append(-1)
                continue
            kind, toks = m
            if kind == "allow" and self.eos not in toks:
                toks = [*toks, self.eos]  # a sentence must be able to end
            ids.append(len(self.rows))
            self.rows.append((kind == "allow", toks))
        if self.rows:
            width = max(len(t) for _, t in self.rows) or 1
            # padding entries repeat a token with no further effect: EOS (allowed anyway) in an
            # allow-list, the first banned token in a ban-list (pad, never chosen, for an empty one)
            fill = [self.eos if a else (t[0] if t else self.pad) for a, t in self.rows]
            self.table = torch.tensor([t + [f] * (width - len(t)) for (_, t), f in zip(self.rows, fill)],
                                      dtype=torch.long, device=device)
            self.allow = torch.tensor([a for a, _ in self.rows], dtype=torch.bool, device=device)
        return torch.tensor(ids, dtype=torch.long, device=device)

    def score(self, lprobs: Tensor, state: Tensor) -> Tensor:
        if self.table is None:
            return lprobs
        has = state >= 0
        row = state.clamp(min=0)
        toks = self.table[row]  # [N, W]
        allow = (self.allow[row] & has).unsqueeze(1)
        ban = (~self.allow[row] & has).unsqueeze(1)
        neg = torch.full_like(lprobs, -math.inf)
        kept = neg.scatter(1, toks, lprobs.gather(1, toks))
        lprobs = torch.where(allow, kept, lprobs)
        return torch.where(ban, lprobs.scatter(1, toks, -math.inf), lprobs)

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        return state
