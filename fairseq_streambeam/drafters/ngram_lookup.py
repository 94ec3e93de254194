"""Lookup drafter for GAD: drafts from n-gram statistics instead of a drafter model.

A draft continues the row's output with (1) what followed the output's last two tokens earlier in
the same output, else (2) the most frequent continuation of its longest known context (up to
`order` tokens) in a table built from target-side text, best the model's own greedy output on
training sources (`scripts/train_drafter.sh --beam 1`). No model pass, no training; a pass costs
little more than one without drafts, and verification keeps the output greedy's (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import numpy as np
from torch import Tensor

from .base import RowListDrafter, pad_drafts

SELF_CONTEXT = 2  # tokens of the output's tail looked up earlier in the same output
# Defaults chosen by simulated tokens per pass (docs/benchmarks.md): longer drafts add little,
# longer contexts nothing; one-token contexts and repeats from the output help.
LOOKUP_BLOCK = 4
LOOKUP_ORDER = 2


class NgramTable:
    """Most frequent next token for each context of 1..`order` tokens seen in the sequences,
    stored per order as sorted context keys (base-`vocab` numbers) and next tokens."""

    def __init__(self, order: int, vocab: int, keys: List[np.ndarray], nexts: List[np.ndarray]):
        self.order, self.vocab, self.keys, self.nexts = order, vocab, keys, nexts

    @classmethod
    def from_sequences(cls, seqs: Iterable[List[int]], vocab: int, bos: int, order: int = LOOKUP_ORDER) -> NgramTable:
        """`seqs`: token ids, each ending in EOS; BOS is put before each, as the decoder sees it."""
        if order < 1:
            raise ValueError(f"n-gram order must be >= 1, got {order}")
        if float(vocab) ** (order + 1) >= 2.0 ** 62:  # the table's keys are context * vocab + next token
            raise ValueError(f"a {order}-token context and its next token in a {vocab}-word vocabulary do not fit "
                             "in 62 bits: lower --draft-lookup-order")
        parts = [[bos, *s] for s in seqs]
        lens = np.array([len(p) for p in parts], dtype=np.int64)
        flat = np.fromiter((t for p in parts for t in p), dtype=np.int64, count=int(lens.sum()))
        offset = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)  # position within its sequence
        keys, nexts = [], []
        for n in range(1, order + 1):
            at = np.nonzero(offset >= n)[0]  # positions with n tokens of context in their sequence
            key = np.zeros(len(at), dtype=np.int64)
            for j in range(n, 0, -1):
                key = key * vocab + flat[at - j]
            pair, count = np.unique(key * vocab + flat[at], return_counts=True)
            ctx, nxt = pair // vocab, pair % vocab
            best = np.lexsort((-count, ctx))  # by context, most frequent first (ties: smallest id)
            ctx, nxt = ctx[best], nxt[best]
            first_of = np.ones(len(ctx), dtype=bool)
            first_of[1:] = ctx[1:] != ctx[:-1]
            keys.append(ctx[first_of])
            nexts.append(nxt[first_of])
        return cls(order, vocab, keys, nexts)

    @classmethod
    def from_file(cls, path: str, dictionary, order: int = LOOKUP_ORDER) -> NgramTable:
        """Target-side text, one sentence per line, tokenized and segmented like the model's target."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--draft-lookup: no such file {path}")
        index, unk, eos = dictionary.indices, dictionary.unk(), dictionary.eos()
        with p.open(encoding="utf-8") as f:  # Dictionary.encode_line's split, 10x faster without tensors
            seqs = [[index.get(w, unk) for w in line.split()] + [eos] for line in f]
        if not any(len(s) > 1 for s in seqs):
            raise ValueError("no text to draft from (the file is empty)")
        return cls.from_sequences(seqs, len(dictionary), eos, order)

    def next(self, context: List[int]) -> Optional[int]:
        """The most frequent token after the longest known tail of `context`."""
        for n in range(min(self.order, len(context)), 0, -1):
            key = 0
            for t in context[-n:]:
                key = key * self.vocab + t
            keys = self.keys[n - 1]
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                return int(self.nexts[n - 1][i])
        return None


class LookupDrafter(RowListDrafter):
    """Drafter (drafters.base interface) over an `NgramTable`; its state is each row's output."""

    def __init__(self, table: NgramTable, bos: int, eos: int, block_size: int = LOOKUP_BLOCK):
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1 with --draft-lookup, got {block_size}")
        self.table, self.bos, self.eos, self.block_size = table, bos, eos, block_size

    def open(self, srcs, rows: List[int]) -> List[List[int]]:
        self.pad, self.device = srcs.pad, srcs.device
        return [[] for _ in rows]

    def propose(self, state: List[List[int]], caps: List[int]) -> Tuple[Tensor, List[int]]:
        return pad_drafts([self.draft(out, min(cap, self.block_size)) for out, cap in zip(state, caps)],
                          self.pad, self.device)

    def advance(self, state: List[List[int]], accepted: List[List[int]]) -> None:
        for out, acc in zip(state, accepted):
            out += acc

    def draft(self, out: List[int], k: int) -> List[int]:
        if k <= 0 or (out and out[-1] == self.eos):
            return []
        copied = _repeat(out, k)
        if copied:
            return copied
        context, drafted = [self.bos, *out], []
        while len(drafted) < k:
            nxt = self.table.next(context)
            if nxt is None:
                break
            drafted.append(nxt)
            context.append(nxt)
            if nxt == self.eos:
                break
        return drafted


def _repeat(out: List[int], k: int) -> List[int]:
    """Up to k tokens that followed the latest earlier occurrence of the output's last
    SELF_CONTEXT tokens in the output itself."""
    n = SELF_CONTEXT
    if len(out) <= n:
        return []
    tail = out[-n:]
    for i in range(len(out) - n - 1, -1, -1):
        if out[i:i + n] == tail:
            return out[i + n:i + n + k]
    return []
