"""LMBR n-gram posterior scorer (Iglesias et al., NAACL 2018; Tromble et al., EMNLP 2008).

Each step, the candidate word w after history h scores

    lambda * log P_NMT(w | h, x)  +  Theta0  +  sum_{n=1..4} Theta_n * P_LMBR(last n-gram of h+w | evidence)

The matrix of the paper (one row per history, one column per word) is kept sparse: a row per
history s present in the evidence (all n-grams of order 0..3) holds only its *own* order's entries
(w, Theta_{|s|+1} * P(s+w)) and points to its back-off row s[1:]; a candidate's score sums the rows
along that chain (at most 4), so no row repeats the lower orders. Every candidate carries the row of
the longest suffix of its history present in the evidence; it moves with the candidate through
beam reordering and refill, and advances with one lookup per chain level.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

NGram = Tuple[int, ...]
MAX_ORDER = 4


@dataclass(frozen=True)
class Theta:
    """Linear-BLEU weights of Tromble et al. (2008): Theta0 = -1/T, Theta_n = 1/(4 T p r^(n-1))."""

    theta0: float
    theta: Tuple[float, ...]  # Theta_1..Theta_4

    @staticmethod
    def linear_bleu(p: float = 0.85, r: float = 0.72, T: float = 1.0, theta0: Optional[float] = None) -> Theta:
        if not (0 < p <= 1 and 0 < r <= 1):
            raise ValueError(f"--lmbr-p and --lmbr-r must be in (0, 1], got p={p} r={r}")
        ths = tuple(1.0 / (4 * T * p * r ** (n - 1)) for n in range(1, MAX_ORDER + 1))
        return Theta(-1.0 / T if theta0 is None else theta0, ths)


def load_posteriors(path: str) -> Dict[int, Dict[NGram, float]]:
    """JSON lines `{"id": sentence id, "ngrams": [[[token ids], posterior], ...]}` (see build_posteriors)."""
    out: Dict[int, Dict[NGram, float]] = {}
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[int(rec["id"])] = {tuple(g): float(p) for g, p in rec["ngrams"]}
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{ln}: not a posterior record ({e})") from e
    return out


class _Table:
    """Host-side rows of one sentence before they join the device tables."""

    def __init__(self, post: Dict[NGram, float], theta: Theta, offset: int):
        # histories: every substring of length <= 3 of an evidence n-gram (closed under substrings,
        # so the longest suffix in the table of h+w is found from the row of h alone)
        subs = {g[i:j] for g in post for i in range(len(g)) for j in range(i + 1, min(len(g), i + MAX_ORDER - 1) + 1)}
        keys: List[NGram] = [()] + sorted(subs, key=lambda g: (len(g), g))
        self.row_of = {k: offset + i for i, k in enumerate(keys)}
        own: Dict[NGram, Dict[int, float]] = defaultdict(dict)
        for k in keys[1:]:
            own[k[:-1]].setdefault(k[-1], 0.0)  # a transition, even where the n-gram scores nothing
        for g, p in post.items():
            if 1 <= len(g) <= MAX_ORDER and p != 0.0:
                own[g[:-1]][g[-1]] = own[g[:-1]].get(g[-1], 0.0) + theta.theta[len(g) - 1] * p
        self.backoff, self.ent_tok, self.ent_score, self.ent_next, self.count = [], [], [], [], []
        root = offset
        for k in keys:
            self.backoff.append(self.row_of[k[1:]] if k else -1)
            ents = sorted(own.get(k, {}).items())
            self.count.append(len(ents))
            for w, s in ents:
                self.ent_tok.append(w)
                self.ent_score.append(s)
                self.ent_next.append(self.row_of.get(k + (w,), -1))
        self.root = root
        self.rows = len(keys)


class LMBRScorer:
    """Adds LMBR n-gram posterior scores to a batch of live candidates in one pass per chain level.

    `posteriors` maps sentence id -> {n-gram: posterior}; a sentence without posteriors gets only
    lambda and Theta0. State per candidate: a row id (long)."""

    def __init__(self, posteriors: Dict[int, Dict[NGram, float]], theta: Theta, lam: float, pad: int):
        self.posteriors = posteriors
        self.theta = theta
        self.lam = lam
        self.pad = pad
        self.reset()

    def reset(self) -> None:
        """Forget the rows of earlier sources (called per generate call)."""
        self.backoff = self.count = self.row_ptr = self.ent_tok = self.ent_score = self.ent_next = None
        self.root_of: Optional[Tensor] = None
        self.rows = 0
        self.max_entries = 0

    def start(self, sentence_ids: Sequence[int], device: torch.device) -> Tensor:
        """Build rows for new sources; returns each source's initial state (its root row)."""
        tables = []
        for sid in sentence_ids:
            t = _Table(self.posteriors.get(int(sid), {}), self.theta, self.rows)
            self.rows += t.rows
            tables.append(t)
        n_ent = 0 if self.ent_tok is None else self.ent_tok.numel()
        counts = [c for t in tables for c in t.count]
        ptr = torch.tensor(counts, dtype=torch.long).cumsum(0) - torch.tensor(counts, dtype=torch.long) + n_ent

        def cat(old, new, dtype):
            new_t = torch.tensor(new, dtype=dtype, device=device)
            return new_t if old is None else torch.cat([old, new_t])

        self.backoff = cat(self.backoff, [b for t in tables for b in t.backoff], torch.long)
        self.count = cat(self.count, counts, torch.long)
        self.row_ptr = cat(self.row_ptr, ptr.tolist(), torch.long)
        self.root_of = cat(self.root_of, [t.root for t in tables for _ in range(t.rows)], torch.long)
        self.ent_tok = cat(self.ent_tok, [w for t in tables for w in t.ent_tok], torch.long)
        self.ent_score = cat(self.ent_score, [s for t in tables for s in t.ent_score], torch.float32)
        self.ent_next = cat(self.ent_next, [x for t in tables for x in t.ent_next], torch.long)
        self.max_entries = max([self.max_entries, *counts]) if counts else self.max_entries
        return torch.tensor([t.root for t in tables], dtype=torch.long, device=device)

    def _entries(self, rows: Tensor) -> Tuple[Tensor, Tensor]:
        """Entry indices [..., E] of each row (clamped) and their validity mask; rows -1 have none."""
        span = torch.arange(max(self.max_entries, 1), device=rows.device)
        safe = rows.clamp(min=0).unsqueeze(-1)
        ok = (rows >= 0).unsqueeze(-1) & (span < self.count[safe])
        idx = (self.row_ptr[safe] + span).clamp(max=max(self.ent_tok.numel() - 1, 0))
        return idx, ok

    def chain(self, state: Tensor) -> Tensor:
        """[N, 4] rows along each candidate's back-off chain (-1 past the root)."""
        levels = [state]
        for _ in range(MAX_ORDER - 1):
            r = levels[-1]
            levels.append(torch.where(r >= 0, self.backoff[r.clamp(min=0)], r))
        return torch.stack(levels, 1)

    def score(self, lprobs: Tensor, state: Tensor) -> Tensor:
        """lambda * lprobs + Theta0 + the rows along each candidate's back-off chain, added with
        one gather and one in-place scatter-add over all chain levels."""
        if self.lam != 1.0:
            lprobs.mul_(self.lam)
        if self.theta.theta0:
            lprobs.add_(self.theta.theta0)
        if self.ent_tok is None or self.ent_tok.numel() == 0:
            return lprobs
        idx, ok = self._entries(self.chain(state))  # [N, 4, E]
        add = torch.where(ok, self.ent_score[idx], torch.zeros((), dtype=self.ent_score.dtype, device=idx.device))
        n = lprobs.size(0)
        return lprobs.scatter_add_(1, self.ent_tok[idx].view(n, -1), add.view(n, -1).to(lprobs.dtype))

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        """Row after appending `tokens`: the longest suffix of the new history in the evidence
        (the first chain level whose row has `tokens` as an extension), else the sentence's root.
        Carried (finished) candidates, marked by token `pad`, keep their row."""
        if self.ent_tok is None or self.ent_tok.numel() == 0:
            return state
        idx, ok = self._entries(self.chain(state))  # [N, 4, E]
        hit = ok & (self.ent_tok[idx] == tokens.view(-1, 1, 1)) & (self.ent_next[idx] >= 0)
        cand = torch.where(hit, self.ent_next[idx], torch.full_like(idx, -1)).max(dim=2).values  # [N, 4]
        found = cand >= 0
        first = found.to(torch.int8).argmax(dim=1, keepdim=True)  # longest level with an extension
        nxt = torch.where(found.any(1), cand.gather(1, first).squeeze(1), self.root_of[state])
        return torch.where(tokens == self.pad, state, nxt)


def reference_score(post: Dict[NGram, float], theta: Theta, lam: float, history: Sequence[int], word: int,
                    lprob: float) -> float:
    """Slow, obviously-correct scoring of one candidate (the specification the tests hold to)."""
    h = tuple(history)
    total = lam * lprob + theta.theta0
    for n in range(1, MAX_ORDER + 1):
        if n - 1 <= len(h):
            g = (h[len(h) - (n - 1):] if n > 1 else ()) + (word,)
            total += theta.theta[n - 1] * post.get(g, 0.0)
    return total if not math.isinf(lprob) else lprob


def write_posteriors(path: Path, records: Dict[int, Dict[NGram, float]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for sid in sorted(records):
            f.write(json.dumps({"id": sid, "ngrams": [[list(g), p] for g, p in sorted(records[sid].items())]}) + "\n")
