"""Aggressive decoding (Ge et al. 2022), batched with a KV cache and streaming refill.

Each pass asks the drafter for a block per live row (IAD: the source's continuation; GAD: a
block_drafter model's parallel guess), feeds every row its last accepted token plus its draft,
verifies the whole block in one decoder pass over the cached prefix, accepts the draft up to its
first rejected token plus the verifier's own token there (so every pass yields at least one token),
and rolls the cache back by masking the rejected slots. Verification is strict top-1 by default, so
the output is greedy decoding's (fairseq `--beam 1`) token for token; GAD++ (`beta` > 1) also
accepts a draft token that is among the verifier's top-beta and within `tau` of its top-1
log-probability. Rows that finish leave; new sources enter when fewer than eps*n are live, as in
VAR-STREAM. Which drafts are worth verifying is decided online from measured acceptance
(runtime.draft_budget.DraftBudget) and, for GAD, from measured time (DraftSwitch: passes go without
the drafter while those are cheaper per token); neither changes a top-1 verifier's output.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from ..drafters.base import Drafter
from ..drafters.input_copy import InputCopyDrafter
from ..runtime.block_step import BlockDecoder, check_block_decoder
from ..runtime.counters import Counters
from ..runtime.draft_budget import DraftBudget, DraftSwitch
from ..runtime.driver import Driver, Engine
from ..runtime.kv_cache import KVCache, check_vocabulary, without_padding_mask
from ..runtime.lean_encoder import forward_encoder
from ..runtime.lean_layer import Slots
from ..runtime.rows import Rows
from ..runtime.scheduler import Budget, Scheduler
from ..search.penalties import FairseqPenalties
from .common import Sources
from .stream_beam import _max_source_positions


@dataclass
class RowState(Rows):
    """Per-row state: window row, length limit, output tokens and their log-probs so far."""

    window_row: List[int]
    max_len: List[int]
    out: List[List[int]]
    lp: List[List[float]]
    prefix: Optional[List[List[int]]] = None  # forced first tokens (fairseq's prefix_tokens row; pad = free)


class Group:
    """Rows decoded in one batch: their state, the verifier's cache and the drafter's state for
    the same rows."""

    def __init__(self, rows: RowState, cache: KVCache, draft: Any, serial: int):
        self.rows = rows
        self.cache = cache
        self.draft = draft
        self.length = 0  # passes made
        self.waited = 0
        self.first_serial = serial

    @property
    def n_sources(self) -> int:
        return len(self.rows.window_row)

    n_candidates = n_sources


class AggressiveGenerator(SequenceGenerator):
    """IAD (`--decoding iad`) and GAD/GAD++ (`--decoding gad`). Same `generate` signature and
    output format as fairseq's generator."""

    def __init__(self, models, tgt_dict, max_len_a: float = 0, max_len_b: int = 200, max_len: int = 0,
                 min_len: int = 1, normalize_scores: bool = True, len_penalty: float = 1.0,
                 unk_penalty: float = 0.0, temperature: float = 1.0, eos: Optional[int] = None,
                 symbols_to_strip_from_output=None, drafter: Optional[Drafter] = None,
                 budget: Optional[Budget] = None, refill_eps: float = 1 / 6, compact_slack: int = 16,
                 beta: int = 1, tau: float = math.inf, draft_min_reach: float = 0.0,
                 draft_switch: bool = False, **_):
        super().__init__(models, tgt_dict, beam_size=1, max_len_a=max_len_a, max_len_b=max_len_b, max_len=max_len,
                         min_len=min_len, normalize_scores=normalize_scores, len_penalty=len_penalty,
                         unk_penalty=unk_penalty, temperature=temperature, eos=eos,
                         symbols_to_strip_from_output=symbols_to_strip_from_output)
        for m in self.model.models:
            check_block_decoder(m.decoder)
        self.blocks = [BlockDecoder(m.decoder) for m in self.model.models]
        check_vocabulary(self.model, tgt_dict)
        if beta < 1:
            raise ValueError(f"--gad-beta must be >= 1, got {beta}")
        if not tau >= 0:
            raise ValueError(f"--gad-tau must be >= 0, got {tau}")
        if draft_switch and beta > 1:  # GAD++ output depends on which passes draft, so on timing
            raise ValueError("the draft switch needs top-1 verification (--gad-beta 1)")
        self.drafter: Drafter = drafter or InputCopyDrafter()
        self.beta, self.tau = beta, tau
        self.draft_budget = DraftBudget(draft_min_reach)
        self.draft_switch = DraftSwitch() if draft_switch else None  # passes without drafts when cheaper
        self.penalties = FairseqPenalties(pad=self.pad, unk=self.unk, eos=self.eos, unk_penalty=unk_penalty,
                                          min_len=min_len, suppress=self.token_indices_to_suppress)
        self.scheduler = Scheduler("min-length", budget or Budget(), refill_eps)
        self.driver = Driver(self.scheduler)
        self.max_source_positions = _max_source_positions(self.model)
        self.compact_slack = compact_slack
        self.counters = Counters()

    @torch.no_grad()
    def _generate(self, sample, prefix_tokens: Optional[Tensor] = None, constraints: Optional[Tensor] = None,
                  bos_token: Optional[int] = None):
        if constraints is not None:
            raise NotImplementedError("aggressive decoding does not support lexical constraints")
        t0 = time.perf_counter()
        srcs = Sources.from_sample(sample, self.pad, self.max_len_a, self.max_len_b, self.max_len, self.min_len,
                                   self.max_source_positions)
        self.bos = self.eos if bos_token is None else bos_token
        results: List[List[Dict[str, Tensor]]] = [[] for _ in range(len(srcs))]
        prefix = None if prefix_tokens is None else prefix_tokens.tolist()
        engine = Engine(admit=partial(self._admit, srcs, prefix=prefix),
                        step=partial(self._pass, results=results, srcs=srcs),
                        mergeable=lambda a, b: a.length > 0 and b.length > 0, merge=self._merge)
        self.driver.run(engine, srcs.lengths, range(len(srcs)))
        self.counters.sentences += len(srcs)
        self.counters.total_seconds += time.perf_counter() - t0
        return results

    def _admit(self, srcs: Sources, new: List[int], serial: int, prefix: Optional[List[List[int]]] = None) -> Group:
        t = time.perf_counter()
        enc = forward_encoder(self.model, srcs.subset_input(new))
        if enc is not None and len({srcs.lengths[i] for i in new}) == 1:
            enc = without_padding_mask(enc)  # no padding: cross-attention needs no mask
        draft = self.drafter.open(srcs, new)
        self.counters.model_seconds += time.perf_counter() - t
        self.counters.encoder_calls += 1
        rows = RowState(list(new), [srcs.max_lens[i] for i in new], [[] for _ in new], [[] for _ in new],
                        None if prefix is None else [prefix[i] for i in new])
        return Group(rows, KVCache(self.model, len(new), enc), draft, serial)

    def _merge(self, a: Group, b: Group) -> Group:
        a.cache = KVCache.cat([a.cache, b.cache])
        a.draft = self.drafter.merge(a.draft, b.draft)
        a.rows = RowState.cat([a.rows, b.rows])
        a.waited, a.first_serial = 0, min(a.first_serial, b.first_serial)
        return a

    def _pass(self, g: Group, results, srcs: Sources) -> List[int]:
        """One draft + verification pass over every row of `g`. Returns the window rows that finished."""
        dev = srcs.net_input["src_tokens"].device
        n = g.n_sources
        outs = g.rows.out
        # a draft may fill the row up to its length limit; the verifier adds the token at max_len (EOS)
        caps = [cap - len(out) for cap, out in zip(g.rows.max_len, outs)]
        worth = self.draft_budget.cap(max(caps))
        switch = self.draft_switch
        if switch is not None and not switch.drafting(n):
            worth = 0
        timed = g.length > 0  # a group's first pass also caches the encoder keys: not timed
        caps = [min(c, worth) for c in caps]
        t = time.perf_counter()
        drafts, lens = self.drafter.propose(g.draft, caps)
        self.counters.draft_seconds += time.perf_counter() - t
        d = max(lens, default=0)
        drafts = drafts[:, :d]  # a drafter may draft more than the caps allow: those slots are not verified
        m = 1 + d
        # the block's layout on the host (numpy: cheaper than a few small torch ops)
        arange = np.arange(m)
        pad_h = arange[None, :] > np.asarray(lens)[:, None]  # slot j > 0 holds draft token j - 1
        steps_h = np.fromiter((len(out) for out in outs), np.int64, n)[:, None] + arange
        at_max = steps_h >= np.asarray(g.rows.max_len, dtype=np.int64)[:, None]
        padded = bool(pad_h.any())
        block_pad = torch.from_numpy(pad_h).to(dev) if padded else None  # None: every slot is real
        last = torch.tensor([out[-1] if out else self.bos for out in outs], dtype=torch.long)
        block = torch.cat([last.to(dev).unsqueeze(1), drafts], 1)
        if block_pad is not None:
            block = block.masked_fill(block_pad, self.pad)
        enc = g.cache.source_inputs(dev)
        # top-1 verification computes only the real slots when the block has padding (rows with
        # shorter drafts); GAD++ reads the top-beta of every slot
        slots = None
        if self.beta == 1 and padded:
            slots = Slots.real(torch.from_numpy(pad_h), dev)
        forced = self._forced_tokens(g.rows.prefix, steps_h)
        best_h, lp_h, draft_h, dlp_h, acc_h = self._verify(g, enc, block, block_pad, pad_h, steps_h, at_max, slots,
                                                           forced)
        g.cache.after_step()
        g.length += 1
        self.counters.model_seconds += time.perf_counter() - t
        self.counters.decoder_steps += 1
        self.counters.expansions += int(n * m) if slots is None else int(slots.index.numel())  # slots computed
        self.counters.verified_rows += n
        self.counters.block_slots += n + sum(lens)

        matched = acc_h[:, 0].astype(int).tolist()
        draft_l, best_l, dlp_l, lp_l = draft_h.tolist(), best_h.tolist(), dlp_h.tolist(), lp_h.tolist()
        done_rows, accepted = [], []
        for i, (out, lp) in enumerate(zip(outs, g.rows.lp)):
            j = matched[i]
            new = [int(x) for x in draft_l[i][:j]] + [int(best_l[i][j])]
            new_lp = dlp_l[i][:j] + [lp_l[i][j]]
            if self.eos in new:
                k = new.index(self.eos) + 1
                new, new_lp = new[:k], new_lp[:k]
            out += new
            lp += new_lp
            accepted.append(new)
            if out[-1] == self.eos:
                done_rows.append(i)
                results[g.rows.window_row[i]] = [self._hypo(out, lp, dev)]
        produced = sum(map(len, accepted))
        self.drafter.advance(g.draft, accepted)
        self.draft_budget.update(lens, matched)
        g.cache.rollback([j + 1 for j in matched], m)  # drop the rejected slots
        done = [g.rows.window_row[i] for i in done_rows]
        if done_rows:
            done_set = set(done_rows)
            keep = [i for i in range(n) if i not in done_set]
            g.cache.select(torch.tensor(keep, dtype=torch.long, device=dev))
            g.draft = self.drafter.select(g.draft, keep)
            g.rows = g.rows.select(keep)
        if g.n_sources and g.cache.length > 2 * max(len(out) for out in g.rows.out) + self.compact_slack:
            g.cache.compact()
        self.counters.accepted_tokens += produced
        if switch is not None and timed:
            switch.record(d > 0, time.perf_counter() - t, produced)
        return done

    def _forced_tokens(self, prefix: Optional[List[List[int]]], steps_h: np.ndarray) -> Optional[np.ndarray]:
        """Prefix token of every block slot [N, m] (slot j of row i predicts output position
        steps_h[i, j]), -1 past the prefix window; None when no slot is inside it."""
        if prefix is None or not (steps_h < len(prefix[0])).any():
            return None
        table = np.asarray(prefix, dtype=np.int64)  # [N, P], the rows' prefix_tokens
        inside = steps_h < table.shape[1]
        out = np.full(steps_h.shape, -1, dtype=np.int64)
        rows = np.nonzero(inside)[0]
        out[inside] = table[rows, steps_h[inside]]
        return out

    def _prefixed(self, lprobs: Tensor, steps: np.ndarray, at_max: np.ndarray, forced: np.ndarray) -> Tensor:
        """fairseq's adjustments at slots of which some are inside the prefix window (host arrays
        [S] of the slots computed): there fairseq forces the prefix token (unless it is pad, or the
        slot is at the length limit) and skips the minimum length and suppressed tokens."""
        dev = lprobs.device
        pen = self.penalties
        pen.fix_rows(lprobs, torch.from_numpy(at_max).to(dev) if at_max.any() else None)
        pen.fix_columns(lprobs, 0, free=False)  # pad and the unk penalty everywhere
        free = forced < 0
        before = free & (steps < self.min_len)
        if before.any():
            lprobs[:, self.eos] = lprobs[:, self.eos].masked_fill(torch.from_numpy(before).to(dev), -math.inf)
        if pen.suppress is not None and free.any():
            lprobs[torch.from_numpy(np.flatnonzero(free)).to(dev).unsqueeze(1), pen.suppress] = -math.inf
        hit = np.flatnonzero(~free & (forced != self.pad) & ~at_max)
        if hit.size:
            idx, tok = torch.from_numpy(hit).to(dev), torch.from_numpy(forced[hit]).to(dev)
            chosen = lprobs[idx, tok]
            lprobs[idx] = -math.inf
            lprobs[idx, tok] = chosen
        return lprobs

    def _verify(self, g: Group, enc, block: Tensor, block_pad: Optional[Tensor], pad_h: np.ndarray,
                steps_h: np.ndarray, at_max: np.ndarray, slots: Optional[Slots],
                forced: Optional[np.ndarray] = None) -> np.ndarray:
        """Verify block [N, m] (host padding `pad_h`, `steps_h` and `at_max` [N, m]); returns, on
        the host, the arrays of `_accept`. Top-1 verification first applies only fairseq's column
        adjustments (a few columns) and reads forced EOS off the EOS column; the passes over every
        entry (NaN, the length limit) are only made when a NaN reaches a top-1 (FairseqPenalties:
        same values)."""
        dev = block.device
        top1 = self.beta == 1
        real = ~pad_h.reshape(-1) if slots is not None else slice(None)
        steps_d = torch.from_numpy(steps_h).to(dev)
        lprobs = self._verify_lprobs(block, steps_d, block_pad, enc, g, int(steps_h.max()), slots)
        if forced is not None:  # slots inside the prefix window: every adjustment, then the plain acceptance
            flat = [a.reshape(-1)[real] for a in (steps_h, at_max, forced)]
            return self._accept(self._prefixed(lprobs, *flat), block, pad_h)
        if int(steps_h.min()) < self.min_len:
            before = steps_d.view(-1) < self.min_len
            self.penalties.fix_columns(lprobs, 0, before if slots is None else before.index_select(0, slots.index))
        else:
            self.penalties.fix_columns(lprobs, self.min_len)
        forced = at_max.reshape(-1)[real]
        if not top1:
            self.penalties.fix_rows(lprobs, torch.from_numpy(forced).to(dev) if forced.any() else None)
            return self._accept(lprobs, block, pad_h)
        # the one host sync of the pass (token ids are exact in the float32/64 packing, below 2**24)
        out = self._accept(lprobs, block, pad_h, forced if forced.any() else None)
        if np.isnan(out[1]).any():  # a NaN log-prob somewhere, or no allowed token at a forced EOS
            self.penalties.fix_rows(lprobs, torch.from_numpy(forced).to(dev) if forced.any() else None)
            out = self._accept(lprobs, block, pad_h)
        return out

    def _accept(self, lprobs: Tensor, block: Tensor, block_pad, forced_eos=None) -> np.ndarray:
        """Verification of block [N, m] (padding `block_pad` [N, m], host array or tensor) from the
        log-probs [S, V] of its N*m slots, or of its real slots only when S < N*m (block slot j
        predicts the token after slot j; draft token j+1 is accepted while every draft token before
        it was). Returns host arrays [5, N, m]: verifier top-1 ids and log-probs, draft ids and their
        log-probs (last column padding), and the number of accepted draft tokens (broadcast over
        the last axis). Top-1 verification copies only each slot's top-1, its log-prob and the
        block to the host and compares there. `forced_eos` [S] (host; top-1 only): slots at the
        length limit whose log-probs were not masked yet: EOS is their top-1, and a NaN log-prob is
        returned where EOS is not allowed either, so the caller redoes the pass with every
        adjustment."""
        if self.beta > 1:
            return self._accept_beta(lprobs, block, torch.as_tensor(np.asarray(block_pad), device=block.device))
        n, m = block.shape
        pad = np.asarray(block_pad, dtype=bool)
        # the top-1 of fairseq's greedy search, its BeamSearch.step's top-2: equal log-probs (frequent
        # in half precision) come in topk's order, not max's (the lowest id); a NaN comes first
        top_lp, top = lprobs.topk(min(2, lprobs.size(1) - 1), dim=1)
        best_lp, best = top_lp[:, 0], top[:, 0]
        dtype = torch.promote_types(lprobs.dtype, torch.float32)
        parts = [best.to(dtype), best_lp.to(dtype), block.reshape(-1).to(dtype)]
        if forced_eos is not None:
            parts.append(lprobs[:, self.eos].to(dtype))
        host = torch.cat(parts).cpu().numpy()
        s = best.numel()
        best_h, lp_h, block_h = host[:s].copy(), host[s:2 * s].copy(), host[2 * s:2 * s + n * m].reshape(n, m)
        if forced_eos is not None:
            forced = np.asarray(forced_eos, dtype=bool).reshape(-1)
            eos_lp = host[2 * s + n * m:][forced]
            best_h[forced] = self.eos
            lp_h[forced] = np.where(eos_lp == -np.inf, np.nan, eos_lp)
        if s < n * m:  # real slots only: padding slots are never read (accepting stops at the first)
            real = ~pad.reshape(-1)
            full_best, full_lp = np.full(n * m, self.pad, dtype=host.dtype), np.zeros(n * m, dtype=host.dtype)
            full_best[real], full_lp[real] = best_h, lp_h
            best_h, lp_h = full_best, full_lp
        best_h, lp_h = best_h.reshape(n, m), lp_h.reshape(n, m)
        ok = (block_h[:, 1:] == best_h[:, :-1]) & ~pad[:, 1:]  # strict: exactly greedy decoding
        accepted = np.cumprod(ok, axis=1).sum(1)
        pad_col = np.zeros((n, 1), dtype=host.dtype)
        return np.stack([best_h, lp_h, np.concatenate([block_h[:, 1:], pad_col], 1),
                         np.concatenate([lp_h[:, :-1], pad_col], 1),  # an accepted draft token is the top-1
                         np.broadcast_to(accepted[:, None], (n, m)).astype(host.dtype)])

    def _accept_beta(self, lprobs: Tensor, block: Tensor, block_pad: Tensor) -> np.ndarray:
        """GAD++ verification on the device: a draft token is accepted when it is among the
        verifier's top-beta and within tau of the top-1 log-probability. `lprobs` [N*m, V] covers
        every slot. Same packing as `_accept`."""
        n, m = block.shape
        best_lp, best = lprobs.max(dim=1)
        best, best_lp = best.view(n, m), best_lp.view(n, m)
        draft = block[:, 1:]
        pred = lprobs.view(n, m, -1)[:, :-1]
        draft_lp = pred.gather(2, draft.unsqueeze(2)).squeeze(2)
        top = pred.topk(min(self.beta, pred.size(2)), dim=2).indices
        ok = top.eq(draft.unsqueeze(2)).any(2) & (draft_lp >= best_lp[:, :-1] - self.tau)
        ok &= ~block_pad[:, 1:]
        accepted = ok.long().cumprod(1).sum(1)
        dtype = torch.promote_types(lprobs.dtype, torch.float32)
        pad_col = lprobs.new_zeros(n, 1, dtype=dtype)
        return torch.stack([
            best.to(dtype), best_lp.to(dtype),
            torch.cat([draft.to(dtype), pad_col], 1), torch.cat([draft_lp.to(dtype), pad_col], 1),
            accepted.to(dtype).unsqueeze(1).expand(n, m),
        ]).cpu().numpy()

    def _verify_lprobs(self, block, steps, block_pad, enc, g: Group, max_step: int, slots: Optional[Slots]) -> Tensor:
        """Log-probs [N*m, V] at every block slot (or [T, V] at the real `slots`), averaged over
        the ensemble like fairseq."""
        outs = []
        for i, mdl in enumerate(self.model.models):
            logits = self.blocks[i](block, steps, enc[i], g.cache.states[i], block_pad, max_position=max_step,
                                    slots=slots)
            logits = logits.div_(self.temperature) if self.temperature != 1.0 else logits
            outs.append(mdl.get_normalized_probs((logits, None), log_probs=True))
        lprobs = outs[0] if len(outs) == 1 else torch.logsumexp(torch.stack(outs, dim=0), dim=0) - math.log(len(outs))
        return lprobs.view(-1, lprobs.size(-1))

    def _hypo(self, out: List[int], lp: List[float], dev) -> Dict[str, Tensor]:
        pos = torch.tensor(lp, dtype=torch.float32, device=dev)  # on the model's device, as fairseq's output
        total = pos.sum()
        score = total / (len(out) ** self.len_penalty) if self.normalize_scores else total
        return {"tokens": torch.tensor(out, device=dev), "score": score, "attention": torch.empty(0),
                "alignment": torch.empty(0), "positional_scores": pos}
