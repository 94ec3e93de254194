"""LMBR n-gram posterior scorer (Iglesias et al., NAACL 2018; Tromble et al., EMNLP 2008).

The paper scores word w after history h as lambda * log P_NMT(w | h, x) + Theta0 + sum_n Theta_n *
P(last n-gram of h+w | evidence); this scorer adds that divided by lambda, `(Theta0 + sum_n Theta_n P)
/ lambda`: the same ranking, with scores (and var-batch's pruning threshold delta) in the NMT model's
log-prob units (docs/lmbr.md).

The paper's matrix (a row per history, a column per word) is kept sparse: a row per history s in the
evidence (order 0..3) holds only its own order's entries (w, Theta_{|s|+1} * P(s+w)), and a
candidate's score sums the rows of its history's suffixes (at most 4). A candidate carries the row
of its history's longest suffix in the evidence. Scoring gathers each suffix length's rows padded to
that length's widest row; advancing looks (row, word) up in one sorted array of transitions. Neither
synchronizes with the host.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .base import read_records, whole

NGram = Tuple[int, ...]
MAX_ORDER = 4


@dataclass(frozen=True)
class Theta:
    """Linear-BLEU weights of Tromble et al. (2008) at T = 1: Theta0 = -1, Theta_n = 1/(4 p r^(n-1))."""

    theta0: float
    theta: Tuple[float, ...]  # Theta_1..Theta_4

    @staticmethod
    def linear_bleu(p: float = 0.85, r: float = 0.72, theta0: Optional[float] = None) -> Theta:
        if not (0 < p <= 1 and 0 < r <= 1):
            raise ValueError(f"--lmbr-p and --lmbr-r must be in (0, 1], got p={p} r={r}")
        ths = tuple(1.0 / (4 * p * r ** (n - 1)) for n in range(1, MAX_ORDER + 1))
        return Theta(-1.0 if theta0 is None else theta0, ths)


def load_posteriors(path: str, vocab: Optional[int] = None) -> Dict[int, Dict[NGram, float]]:
    """JSON lines `{"id": sentence id, "ngrams": [[[token ids], posterior], ...]}` (see build_posteriors);
    with `vocab`, every token id must be one of the target dictionary's (0..vocab-1)."""

    def parse(rec: dict):
        post = {tuple(whole(t, "token id") for t in g): float(p) for g, p in rec["ngrams"]}
        bad = [p for p in post.values() if not (math.isfinite(p) and p >= 0)]
        if bad:
            raise ValueError(f"posterior {bad[0]} is not a finite number >= 0")
        return whole(rec["id"], "id"), post, [t for g in post for t in g]

    return read_records(path, "posterior", parse, vocab)


class _Table:
    """Host-side rows of one sentence (numpy, row ids from `offset`): the root, then every substring
    of length 1..3 of an evidence n-gram (closed under substrings, so h+w's longest suffix is found
    from the rows of h's suffixes), shorter first, so a longer suffix has a larger row id. `weight`
    (the scorer's 1 / lambda) multiplies every entry."""

    def __init__(self, post: Dict[NGram, float], theta: Theta, offset: int, weight: float = 1.0):
        # closure under substrings, longest first: a substring of g is one of its prefix's or suffix's
        levels: List[set] = [set() for _ in range(MAX_ORDER + 1)]
        for g in post:
            if 1 <= len(g) <= MAX_ORDER:
                levels[len(g)].add(g)
        for n in range(MAX_ORDER, 1, -1):
            below = levels[n - 1]
            for g in levels[n]:
                below.add(g[:-1])
                below.add(g[1:])
        keys: List[NGram] = [()]
        for n in range(1, MAX_ORDER):
            keys += levels[n]
        row_of = {k: offset + i for i, k in enumerate(keys)}
        self.rows, self.root = len(keys), offset
        self.anc = np.full((len(keys), MAX_ORDER), -1, dtype=np.int64)  # row of the suffix of length h
        self.level = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
        for i, k in enumerate(keys):
            for h in range(len(k) + 1):
                self.anc[i, h] = row_of[k[len(k) - h:]]
        # entries: one per n-gram g (every closure member and every scored n-gram), on row g[:-1]
        grams = [g for n in range(1, MAX_ORDER + 1) for g in levels[n]]
        parent = np.fromiter((row_of[g[:-1]] for g in grams), dtype=np.int64, count=len(grams))
        tok = np.fromiter((g[-1] for g in grams), dtype=np.int64, count=len(grams))
        score = np.fromiter((theta.theta[len(g) - 1] * post.get(g, 0.0) * weight for g in grams), dtype=np.float64,
                            count=len(grams))
        nxt = np.fromiter((row_of.get(g, -1) for g in grams), dtype=np.int64, count=len(grams))
        order = np.lexsort((tok, parent))
        self.ent_row, self.ent_tok = parent[order], tok[order]
        self.ent_score, self.ent_next = score[order].astype(np.float32), nxt[order]
        self.count = np.bincount(self.ent_row - offset, minlength=len(keys))


# the key of a transition (row, token) is row * KEY_BASE + token: token ids stay below it
KEY_BASE = 1 << 24


class LMBRScorer:
    """`posteriors`: sentence id -> {n-gram: posterior} (a sentence without any gets only Theta0);
    `lam` (lambda > 0) weighs the NMT log-probs against the evidence (the module's docstring).
    State per candidate: a row id (long)."""

    def __init__(self, posteriors: Dict[int, Dict[NGram, float]], theta: Theta, lam: float, pad: int):
        if not lam > 0:
            raise ValueError(f"--lmbr-lambda must be > 0, got {lam}")
        self.posteriors = posteriors
        self.theta = theta
        self.lam = lam
        self.pad = pad
        self.reset()

    def reset(self) -> None:
        """Forget the rows of earlier sources (called per generate call)."""
        self.anc = self.count = self.row_ptr = self.ent_tok = self.ent_score = None
        self.trans_key = self.trans_next = None
        self.rows = 0
        self.width = [0] * MAX_ORDER  # most entries of a row, per history length
        self._cols: Optional[Tuple[Tensor, Tensor]] = None

    def has_record(self, sentence_id: int) -> bool:
        return int(sentence_id) in self.posteriors

    def start(self, sentence_ids: Sequence[int], device: torch.device) -> Tensor:
        """Build rows for new sources; returns each source's initial state (its root row)."""
        tables = []
        for sid in sentence_ids:
            t = _Table(self.posteriors.get(int(sid), {}), self.theta, self.rows, 1.0 / self.lam)
            self.rows += t.rows
            tables.append(t)
        if not tables:
            return torch.zeros(0, dtype=torch.long, device=device)
        n_ent = 0 if self.ent_tok is None else self.ent_tok.numel()
        count = np.concatenate([t.count for t in tables])
        level = np.concatenate([t.level for t in tables])
        ptr = np.cumsum(count) - count + n_ent
        ent_next = np.concatenate([t.ent_next for t in tables])
        ent_tok = np.concatenate([t.ent_tok for t in tables])
        ent_row = np.concatenate([t.ent_row for t in tables])
        trans = ent_next >= 0
        for h in range(MAX_ORDER):
            self.width[h] = max(self.width[h], int(count[level == h].max(initial=0)))
        # per gathered column: the history length whose row it reads, and the entry within the row (as
        # many columns per length as its longest row has entries); built here, so a step uploads nothing
        lvl = torch.cat([torch.full((w,), h, dtype=torch.long) for h, w in enumerate(self.width)])
        self._cols = lvl.to(device), torch.cat([torch.arange(w) for w in self.width]).to(device)

        def cat(old, new, dtype):
            new_t = torch.from_numpy(np.ascontiguousarray(new)).to(device=device, dtype=dtype)
            return new_t if old is None else torch.cat([old, new_t])

        self.anc = cat(self.anc, np.concatenate([t.anc for t in tables]), torch.long)
        self.count = cat(self.count, count, torch.long)
        self.row_ptr = cat(self.row_ptr, ptr, torch.long)
        self.ent_tok = cat(self.ent_tok, ent_tok, torch.long)
        self.ent_score = cat(self.ent_score, np.concatenate([t.ent_score for t in tables]), torch.float32)
        # rows of later sources have larger ids: the keys stay sorted across admissions
        self.trans_key = cat(self.trans_key, ent_row[trans] * KEY_BASE + ent_tok[trans], torch.long)
        self.trans_next = cat(self.trans_next, ent_next[trans], torch.long)
        return torch.tensor([t.root for t in tables], dtype=torch.long, device=device)

    def score(self, lprobs: Tensor, state: Tensor) -> Tensor:
        """lprobs + Theta0 / lambda (in place), plus the entries (Theta_n P / lambda) of the rows of
        each candidate's history suffixes, added with one gather and one in-place scatter-add."""
        if self.theta.theta0:
            lprobs = lprobs.add_(self.theta.theta0 / self.lam)
        if self.ent_tok is None or self.ent_tok.numel() == 0:
            return lprobs
        lvl, span = self._cols
        rows = self.anc[state].index_select(1, lvl)  # [N, W]
        safe = rows.clamp(min=0)
        ok = (rows >= 0) & (span < self.count[safe])
        idx = (self.row_ptr[safe] + span).clamp(max=self.ent_tok.numel() - 1)
        add = self.ent_score[idx].masked_fill_(~ok, 0.0)
        return lprobs.scatter_add_(1, self.ent_tok[idx], add.to(lprobs.dtype))

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        """Row after appending `tokens`: the longest suffix of the new history in the evidence
        (the longest history suffix whose row has `tokens` as an extension), else the sentence's
        root. Carried (finished) candidates, marked by token `pad`, keep their row."""
        if self.trans_key is None or self.trans_key.numel() == 0:
            return state
        anc = self.anc[state]  # [N, 4]
        keys = torch.where(anc >= 0, anc * KEY_BASE + tokens.unsqueeze(1), torch.full_like(anc, -1))
        pos = torch.searchsorted(self.trans_key, keys).clamp(max=self.trans_key.numel() - 1)
        hit = self.trans_key[pos] == keys
        # a longer suffix's row has a larger id: the largest hit is the longest suffix
        nxt = torch.where(hit, self.trans_next[pos], torch.full_like(pos, -1)).max(dim=1).values
        nxt = torch.where(nxt >= 0, nxt, anc[:, 0])
        return torch.where(tokens == self.pad, state, nxt)


def write_posteriors(path: Path, records: Dict[int, Dict[NGram, float]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for sid in sorted(records):
            f.write(json.dumps({"id": sid, "ngrams": [[list(g), p] for g, p in sorted(records[sid].items())]}) + "\n")
