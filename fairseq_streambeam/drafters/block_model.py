"""GAD drafter (Ge et al. 2022): a `block_drafter` model drafts the next k tokens of every row in
one parallel pass. It keeps its own cache of each row's accepted prefix: a pass feeds the tokens
accepted since the last one (causal) and k mask slots (bidirectional), takes the argmax at the mask
slots and cuts them off the cache again. A row's source is encoded when its cohort first drafts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch
from torch import Tensor

from ..runtime.block_step import BlockDecoder
from ..runtime.kv_cache import KVCache, max_positions, stand_in
from ..runtime.lean_encoder import encode


@dataclass
class ModelDraftState:
    """Drafter state of one cohort of rows, built (sources encoded, prefixes cached: `cache.built`)
    when it first drafts: with the draft switch a cohort may never draft."""

    rows: List[int]  # window rows (sources) in this cohort, in order
    pending: List[List[int]]  # accepted tokens not yet fed to the drafter, per row (starts as [BOS])
    fed: List[int]  # tokens fed so far per row = target position of the next fed token
    cache: KVCache  # the drafter decoder's cache
    srcs: Any  # the window's sources (generators.common.Sources), to build the cohort from
    outs: List[List[int]]  # the rows' outputs so far (to rebuild the cache)


class ModelDrafter:
    """Drafts with a trained `block_drafter` fairseq model (see models/block_drafter.py)."""

    def __init__(self, model, tgt_dict, block_size: int = 0):
        from ..models.block_drafter import BlockDrafterModel

        if not isinstance(model, BlockDrafterModel):
            raise ValueError(f"--drafter must be a block_drafter checkpoint (fairseq-train --arch block_drafter*); "
                             f"got a {type(model).__name__}")
        self.model = model
        self.block = BlockDecoder(model.decoder)
        self.k = block_size or model.draft_block_size
        self.pad, self.bos, self.mask = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.max_pos = max_positions([model], 1)

    def open(self, srcs, rows: List[int]) -> ModelDraftState:
        return ModelDraftState(list(rows), [[self.bos] for _ in rows], [0] * len(rows),
                               KVCache(self.model, len(rows)), srcs, [[] for _ in rows])

    def propose(self, g: ModelDraftState, caps: List[int]) -> Tuple[Tensor, List[int]]:
        n = len(g.pending)
        dev = next(self.model.parameters()).device
        if max(caps, default=0) <= 0:  # nothing to draft: no drafter pass (the pending tokens wait)
            return torch.empty(n, 0, dtype=torch.long, device=dev), [0] * n
        # mask slots beyond every row's cap would draft tokens nobody verifies (length limits, the
        # adaptive draft cap): fewer mask slots
        k = min(self.k, max(caps))
        lens = [max(0, min(k, c)) for c in caps]
        return self._feed(g, k).argmax(-1), lens

    def _feed(self, g: ModelDraftState, k: int) -> Tensor:
        """Feed every row's pending tokens plus k mask slots (building the cohort first); returns
        the mask slots' logits [N, k, V] and cuts those slots off the cache again."""
        n = len(g.pending)
        dev = next(self.model.parameters()).device
        a = max(len(p) for p in g.pending)
        head = torch.full((n, a), self.pad, dtype=torch.long)
        pos = torch.zeros((n, a + k), dtype=torch.long)
        for i, p in enumerate(g.pending):
            head[i, :len(p)] = torch.tensor(p, dtype=torch.long)
            pos[i, :a] = g.fed[i] + torch.arange(a)
            pos[i, a:] = g.fed[i] + len(p) + torch.arange(k)
        block_pad = torch.cat([head.eq(self.pad), torch.zeros(n, k, dtype=torch.bool)], 1).to(dev)
        tokens = torch.cat([head, torch.full((n, k), self.mask, dtype=torch.long)], 1).to(dev)
        # target positions are 0..max_pos-1; drafts past them are beyond every row's length limit anyway
        pos = pos.clamp(max=self.max_pos - 1)
        top = int(pos.max())
        pos = pos.to(dev)
        if g.cache.built:
            enc = stand_in(self.model, n, dev)[0]
        else:  # the first pass of this cohort caches the cross-attention keys
            enc = encode(self.model.encoder, g.srcs.subset_input(g.rows))
        logits = self.model.draft_logits(enc, tokens, pos, block_pad, k, state=g.cache.states[0], max_position=top,
                                         block=self.block)
        g.cache.truncate(g.cache.length - k)
        for i, p in enumerate(g.pending):
            g.fed[i] += len(p)
        g.pending = [[] for _ in g.pending]
        return logits

    def advance(self, g: ModelDraftState, accepted: List[List[int]]) -> None:
        for out, pending, acc in zip(g.outs, g.pending, accepted):
            out += acc
            pending += acc
        g.cache.compact_if_sparse(max(g.fed) + 1)

    def select(self, g: ModelDraftState, keep: List[int]) -> ModelDraftState:
        if g.cache.built:
            dev = next(self.model.parameters()).device
            g.cache.select(torch.tensor(keep, dtype=torch.long, device=dev))
        g.rows, g.pending, g.fed, g.outs = ([x[i] for i in keep] for x in (g.rows, g.pending, g.fed, g.outs))
        return g

    def merge(self, a: ModelDraftState, b: ModelDraftState) -> ModelDraftState:
        """`b` entered after `a`. A new cohort left unbuilt did not draft in its first pass (the draft
        switch was off): then `a` drops its cache rather than build `b`'s, and the merged cohort is
        built again when it next drafts; a new cohort that drafted has `a` built too."""
        if a.cache.built and not b.cache.built:
            self._drop(a)
        elif b.cache.built and not a.cache.built:
            self._feed(a, 0)
        if a.cache.built:
            a.cache = KVCache.cat([a.cache, b.cache])
        a.rows, a.pending, a.fed, a.outs = a.rows + b.rows, a.pending + b.pending, a.fed + b.fed, a.outs + b.outs
        return a

    def _drop(self, g: ModelDraftState) -> None:
        """Forget the cohort's cache: every row's whole prefix is pending again."""
        g.cache = KVCache(self.model, len(g.rows))
        g.fed = [0] * len(g.rows)
        g.pending = [[self.bos] + out for out in g.outs]
