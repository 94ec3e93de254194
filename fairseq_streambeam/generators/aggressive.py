"""Aggressive decoding (Ge et al. 2022), batched with a KV cache and streaming refill.

Each pass feeds every live row its last accepted token plus a draft (IAD: the source's
continuation; GAD: a block_drafter model's guess), verifies the block in one decoder pass over the
cached prefix, accepts the draft up to its first rejected token plus the verifier's own token there,
and rolls the cache back by masking the rejected slots. Strict top-1 verification gives greedy
decoding's output (fairseq `--beam 1`) token for token; GAD++ (`beta` > 1) also accepts a draft
token among the verifier's top-beta within `tau` of its top-1. Which drafts are worth verifying is
decided online (runtime.draft_budget), which never changes a top-1 verifier's output.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from ..drafters.base import Drafter
from ..drafters.input_copy import InputCopyDrafter
from ..runtime.block_step import BlockDecoder, check_block_decoder, ensemble_lprobs
from ..runtime.counters import Counters
from ..runtime.draft_budget import DraftBudget, DraftSwitch
from ..runtime.driver import Driver, Engine
from ..runtime.kv_cache import KVCache, check_vocabulary, max_positions, without_padding_mask
from ..runtime.lean_encoder import LeanEncoders
from ..runtime.lean_layer import Slots
from ..runtime.rows import Rows
from ..runtime.scheduler import Budget, Scheduler
from ..search.penalties import FairseqPenalties, length_norm
from ..spec import DecodeSpec, UsageError
from .common import Sources, family_spec, hypothesis, sequence_generator_args, to_host


@dataclass
class RowState(Rows):
    """Per-row state: window row, length limit, output tokens and their log-probs so far."""

    window_row: List[int]
    max_len: List[int]
    out: List[List[int]]
    lp: List[List[float]]
    prefix: Optional[List[List[int]]] = None  # forced first tokens (fairseq's prefix_tokens row; pad = free)


class DraftCohort:
    """Rows decoded in one batch: their state, the verifier's cache and the drafter's state for
    the same rows; `steps`: verification passes made (the driver's Cohort)."""

    def __init__(self, rows: RowState, cache: KVCache, draft: Any, serial: int):
        self.rows = rows
        self.cache = cache
        self.draft = draft
        self.steps = 0
        self.waited = 0
        self.first_serial = serial

    @property
    def n_sources(self) -> int:
        return len(self.rows.window_row)

    n_candidates = n_sources


@dataclass
class Block:
    """One pass's block [N, m]: each row's last accepted token, then its draft. Host arrays:
    `lens` draft lengths, `pad` padding slots, `steps` the output position each slot predicts,
    `at_max` slots at their row's length limit, `forced` prefix tokens (-1 free; None: no slot in
    the prefix window); `pad_t` the padding on the device (None: none), `slots` the real slots to
    compute (top-1 verification of a padded block)."""

    tokens: Tensor
    lens: List[int]
    pad: np.ndarray
    steps: np.ndarray
    at_max: np.ndarray
    forced: Optional[np.ndarray]
    pad_t: Optional[Tensor]
    slots: Optional[Slots]

    @property
    def width(self) -> int:
        return self.tokens.size(1)


@dataclass
class Verdict:
    """What verification found, on the host: the verifier's top-1 token and log-prob at every slot
    [N, m], the draft tokens [N, m - 1] and their log-probs, and the accepted draft tokens per row [N]."""

    best: np.ndarray
    best_lp: np.ndarray
    draft: np.ndarray
    draft_lp: np.ndarray
    accepted: np.ndarray


class AggressiveGenerator(SequenceGenerator):
    """IAD (`--decoding iad`) and GAD/GAD++ (`--decoding gad`), with fairseq's generator's `generate`
    signature and output. `spec` (spec.DecodeSpec), or its fields as keyword arguments (decoding iad
    unless given); `drafter` (drafters/; IAD's input copy by default); `budget`: live sources."""

    def __init__(self, models, tgt_dict, spec: Optional[DecodeSpec] = None, drafter: Optional[Drafter] = None,
                 budget: Optional[Budget] = None, **options):
        spec = family_spec(spec, options, "draft", "iad")
        super().__init__(models, tgt_dict, **sequence_generator_args(spec, tgt_dict))
        for m in self.model.models:
            check_block_decoder(m.decoder)
        self.blocks = [BlockDecoder(m.decoder, spec.compile, repacked=True, draft_blocks=True)
                       for m in self.model.models]
        self.encoders = LeanEncoders(self.model)
        check_vocabulary(self.model, tgt_dict)
        self.spec = spec
        if drafter is None and spec.decoding == "gad":  # the task builds the one --drafter/--draft-lookup name
            raise UsageError("AggressiveGenerator: --decoding gad needs drafter=; the task builds it from "
                             "--drafter or --draft-lookup (attach_to_hub, task.build_generator)")
        self.drafter: Drafter = drafter or InputCopyDrafter(spec.iad_ngram, spec.block_size)
        self.beta, self.tau = spec.gad_beta, spec.gad_tau
        self.draft_budget = DraftBudget(spec.min_reach)
        self.draft_switch = DraftSwitch() if spec.switches_drafting else None  # passes without drafts when cheaper
        self.penalties = FairseqPenalties(pad=self.pad, unk=self.unk, eos=self.eos, unk_penalty=spec.unk_penalty,
                                          min_len=spec.min_len, suppress=self.token_indices_to_suppress)
        self.scheduler = Scheduler(spec.policy, Budget() if budget is None else budget, spec.refill_eps)
        self.driver = Driver(self.scheduler)
        self.max_source_positions = max_positions(self.model.models, 0)
        self.counters = Counters()

    @torch.no_grad()
    def _generate(self, sample, prefix_tokens: Optional[Tensor] = None, constraints: Optional[Tensor] = None,
                  bos_token: Optional[int] = None):
        if constraints is not None:
            raise NotImplementedError("aggressive decoding does not support lexical constraints")
        t0 = time.perf_counter()
        srcs = Sources.from_sample(sample, self)
        self.start_call(len(srcs))
        results: List[List[Dict[str, Tensor]]] = [[] for _ in range(len(srcs))]
        self.driver.run(self.engine(srcs, results, prefix_tokens, bos_token), srcs.lengths, range(len(srcs)))
        self.counters.sentences += len(srcs)
        self.counters.total_seconds += time.perf_counter() - t0
        return results

    def start_call(self, n_sources: int) -> None:
        """Read the models as they are now, for a generate call over `n_sources` sources or an online
        decoder (sys.maxsize)."""
        for block in self.blocks:
            block.start_call(n_sources)
        self.encoders.start_call(n_sources)

    @staticmethod
    def sorted_hypotheses(hypos: List[Dict[str, Tensor]]) -> List[Dict[str, Tensor]]:
        return hypos  # one hypothesis per source

    def engine(self, srcs, results, prefix_tokens: Optional[Tensor] = None,
               bos_token: Optional[int] = None) -> Engine[DraftCohort]:
        """The driver's engine over sources `srcs` (a Sources, or an online window), writing each
        window row's hypothesis to `results[row]`."""
        self.bos = self.eos if bos_token is None else bos_token
        prefix = None if prefix_tokens is None else prefix_tokens.tolist()
        return Engine(admit=partial(self._admit, srcs, prefix=prefix),
                      step=partial(self._pass, results=results, srcs=srcs),
                      mergeable=lambda a, b: a.steps > 0 and b.steps > 0, merge=self._merge)

    def _admit(self, srcs: Sources, new: List[int], serial: int,
               prefix: Optional[List[List[int]]] = None) -> DraftCohort:
        t = time.perf_counter()
        enc = self.encoders(srcs.subset_input(new))
        if enc is not None and len({srcs.lengths[i] for i in new}) == 1:
            enc = without_padding_mask(enc)  # no padding: cross-attention needs no mask
        draft = self.drafter.open(srcs, new)
        self.counters.model_seconds += time.perf_counter() - t
        self.counters.encoder_calls += 1
        rows = RowState(list(new), [srcs.max_lens[i] for i in new], [[] for _ in new], [[] for _ in new],
                        None if prefix is None else [prefix[i] for i in new])
        cache = KVCache(self.model, len(new), enc)
        if enc is not None and any(b.graph_steps(srcs.device) for b in self.blocks):
            cache.prime(enc)  # encoder keys cached now: the first pass takes the static-shape step too
        return DraftCohort(rows, cache, draft, serial)

    def _merge(self, a: DraftCohort, b: DraftCohort) -> DraftCohort:
        a.cache = KVCache.cat([a.cache, b.cache])
        a.draft = self.drafter.merge(a.draft, b.draft)
        a.rows = RowState.cat([a.rows, b.rows])
        a.waited, a.first_serial = 0, min(a.first_serial, b.first_serial)
        return a

    def _pass(self, g: DraftCohort, results, srcs: Sources) -> List[int]:
        """One draft-and-verify pass over every row of `g`, in stages: propose a block, verify it
        (one host copy), accept tokens, roll back and evict. Returns the window rows that finished."""
        timed = g.steps > 0  # a cohort's first pass also caches the encoder keys: not timed
        t = time.perf_counter()
        block = self._propose(g, srcs.device)
        verdict = self._verify(g, block)
        g.cache.after_step()
        g.steps += 1
        self.counters.model_seconds += time.perf_counter() - t
        n = g.n_sources
        self.counters.decoder_steps += 1
        self.counters.expansions += n * block.width if block.slots is None else int(block.slots.index.numel())
        self.counters.verified_rows += n
        self.counters.block_slots += n + sum(block.lens)
        accepted, done_rows = self._accept_tokens(g, verdict, results, block.tokens.device)
        produced = sum(map(len, accepted))
        self.drafter.advance(g.draft, accepted)
        matched = verdict.accepted.tolist()
        self.draft_budget.update(block.lens, matched)
        g.cache.rollback([j + 1 for j in matched], block.width)  # drop the rejected slots
        done = self._evict(g, done_rows, block.tokens.device)
        self.counters.accepted_tokens += produced
        if self.draft_switch is not None and timed:
            self.draft_switch.record(block.width > 1, time.perf_counter() - t, produced)
        return done

    def _propose(self, g: DraftCohort, dev) -> Block:
        """Each row's draft, capped by its length limit and by what is worth verifying, as a block."""
        outs, n = g.rows.out, g.n_sources
        # a draft may fill the row up to its length limit; the verifier adds the token at max_len (EOS)
        caps = [cap - len(out) for cap, out in zip(g.rows.max_len, outs)]
        worth = self.draft_budget.cap(max(caps))
        if self.draft_switch is not None and not self.draft_switch.drafting(n):
            worth = 0
        t = time.perf_counter()
        drafts, lens = self.drafter.propose(g.draft, [min(c, worth) for c in caps])
        self.counters.draft_seconds += time.perf_counter() - t
        m = 1 + max(lens, default=0)
        drafts = drafts[:, :m - 1]  # a drafter may draft more than the caps allow: those slots are not verified
        # the block's layout on the host (numpy: cheaper than a few small torch ops)
        arange = np.arange(m)
        pad = arange[None, :] > np.asarray(lens)[:, None]  # slot j > 0 holds draft token j - 1
        max_len = np.asarray(g.rows.max_len, dtype=np.int64)[:, None]
        # real slots end at the row's limit; padding past it takes the limit's position, which a
        # learned position table has (padding is never read)
        steps = np.minimum(np.fromiter((len(out) for out in outs), np.int64, n)[:, None] + arange, max_len)
        at_max = steps >= max_len
        last = torch.tensor([out[-1] if out else self.bos for out in outs], dtype=torch.long)
        tokens = torch.cat([last.to(dev).unsqueeze(1), drafts], 1)
        pad_t = slots = None
        if pad.any():  # rows with shorter drafts
            pad_t = torch.from_numpy(pad).to(dev)
            tokens = tokens.masked_fill(pad_t, self.pad)
            if self.beta == 1:  # top-1 verification computes only the real slots; GAD++ reads every slot's top-beta
                slots = Slots.real(torch.from_numpy(pad), dev)
        return Block(tokens, lens, pad, steps, at_max, self._forced_tokens(g.rows.prefix, steps), pad_t, slots)

    def _accept_tokens(self, g: DraftCohort, v: Verdict, results, dev) -> Tuple[List[List[int]], List[int]]:
        """Append each row's accepted draft tokens and the verifier's token after them (up to EOS);
        a row that reached EOS gets its hypothesis. Returns the tokens gained and the rows finished."""
        draft_l, best_l, dlp_l, lp_l = v.draft.tolist(), v.best.tolist(), v.draft_lp.tolist(), v.best_lp.tolist()
        done_rows, accepted = [], []
        for i, (out, lp) in enumerate(zip(g.rows.out, g.rows.lp)):
            j = int(v.accepted[i])
            new, new_lp = draft_l[i][:j] + [best_l[i][j]], dlp_l[i][:j] + [lp_l[i][j]]
            if self.eos in new:
                k = new.index(self.eos) + 1
                new, new_lp = new[:k], new_lp[:k]
            out += new
            lp += new_lp
            accepted.append(new)
            if out[-1] == self.eos:
                done_rows.append(i)
                results[g.rows.window_row[i]] = [self._hypo(out, lp, dev)]
        return accepted, done_rows

    def _evict(self, g: DraftCohort, done_rows: List[int], dev) -> List[int]:
        """Finished rows leave the cohort; the cache drops the masked slots rollbacks left once they pile up."""
        done = [g.rows.window_row[i] for i in done_rows]
        if done_rows:
            done_set = set(done_rows)
            keep = [i for i in range(g.n_sources) if i not in done_set]
            g.cache.select(torch.tensor(keep, dtype=torch.long, device=dev))
            g.draft = self.drafter.select(g.draft, keep)
            g.rows = g.rows.select(keep)
        if g.n_sources:
            g.cache.compact_if_sparse(max(len(out) for out in g.rows.out))
        return done

    def _forced_tokens(self, prefix: Optional[List[List[int]]], steps_h: np.ndarray) -> Optional[np.ndarray]:
        """Prefix token of every block slot [N, m] (slot j of row i predicts output position
        steps_h[i, j]), -1 past the prefix window; None when no slot is inside it."""
        if prefix is None:
            return None
        inside = steps_h < len(prefix[0])
        if not inside.any():
            return None
        out = np.full(steps_h.shape, -1, dtype=np.int64)
        out[inside] = np.asarray(prefix, dtype=np.int64)[np.nonzero(inside)[0], steps_h[inside]]
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

    def _verify(self, g: DraftCohort, block: Block) -> Verdict:
        """Verify `block` against the verifier's greedy choices. Top-1 verification first applies only
        fairseq's column adjustments and reads forced EOS off the EOS column; the passes over every
        entry (NaN, the length limit) follow only when a NaN reaches a top-1 (same values)."""
        dev = block.tokens.device
        real = ~block.pad.reshape(-1) if block.slots is not None else slice(None)
        steps_d = torch.from_numpy(block.steps).to(dev)
        lprobs = self._verify_lprobs(g, block, steps_d)
        if block.forced is not None:  # slots inside the prefix window: every adjustment, then the plain acceptance
            flat = [a.reshape(-1)[real] for a in (block.steps, block.at_max, block.forced)]
            return self._accept(self._prefixed(lprobs, *flat), block)
        if int(block.steps.min()) < self.min_len:
            before = steps_d.view(-1) < self.min_len
            self.penalties.fix_columns(lprobs, 0, before if block.slots is None else before.index_select(
                0, block.slots.index))
        else:
            self.penalties.fix_columns(lprobs, self.min_len)
        at_max = block.at_max.reshape(-1)[real]
        if self.beta == 1:
            verdict = self._accept(lprobs, block, at_max if at_max.any() else None)
            if not np.isnan(verdict.best_lp).any():
                return verdict
            # a NaN log-prob somewhere, or no allowed token at a forced EOS: every adjustment, again
        self.penalties.fix_rows(lprobs, torch.from_numpy(at_max).to(dev) if at_max.any() else None)
        return self._accept(lprobs, block)

    def _accept(self, lprobs: Tensor, block: Block, forced_eos: Optional[np.ndarray] = None) -> Verdict:
        """The verdict on `block` from the log-probs [S, V] of its N*m slots, or of its real slots
        only when S < N*m (slot j predicts the token after slot j); top-1 compares on the host.
        `forced_eos` [S] (top-1 only): slots at the length limit, not masked yet: EOS is their top-1,
        with a NaN log-prob where EOS is not allowed either (the caller then redoes the pass)."""
        if self.beta > 1:
            return self._accept_beta(lprobs, block)
        n, m = block.tokens.shape
        # the top-1 of fairseq's greedy search, its BeamSearch.step's top-2: equal log-probs (frequent
        # in half precision) come in topk's order, not max's (the lowest id); a NaN comes first
        top_lp, top = lprobs.topk(min(2, lprobs.size(1) - 1), dim=1)
        dtype = torch.promote_types(lprobs.dtype, torch.float32)
        parts = dict(best=top[:, 0], best_lp=top_lp[:, 0].to(dtype), block=block.tokens)
        if forced_eos is not None:
            parts["eos_lp"] = lprobs[:, self.eos].to(dtype)
        h = to_host(**parts)
        best, best_lp = h["best"].copy(), h["best_lp"].copy()
        if forced_eos is not None:
            eos_lp = h["eos_lp"][forced_eos]
            best[forced_eos] = self.eos
            best_lp[forced_eos] = np.where(eos_lp == -np.inf, np.nan, eos_lp)
        if best.size < n * m:  # real slots only: padding slots are never read (accepting stops at the first)
            real = ~block.pad.reshape(-1)
            full_best, full_lp = np.full(n * m, self.pad, dtype=best.dtype), np.zeros(n * m, dtype=best_lp.dtype)
            full_best[real], full_lp[real] = best, best_lp
            best, best_lp = full_best, full_lp
        best, best_lp, tokens = best.reshape(n, m), best_lp.reshape(n, m), h["block"]
        ok = (tokens[:, 1:] == best[:, :-1]) & ~block.pad[:, 1:]  # strict: exactly greedy decoding
        # an accepted draft token is the top-1: its log-prob is the top-1's
        return Verdict(best, best_lp, tokens[:, 1:], best_lp[:, :-1], np.cumprod(ok, axis=1).sum(1))

    def _accept_beta(self, lprobs: Tensor, block: Block) -> Verdict:
        """GAD++ verification on the device: a draft token is accepted when it is among the verifier's
        top-beta and within tau of the top-1 log-probability. `lprobs` [N*m, V]: every slot."""
        n, m = block.tokens.shape
        best_lp, best = lprobs.max(dim=1)
        best, best_lp = best.view(n, m), best_lp.view(n, m)
        draft = block.tokens[:, 1:]
        pred = lprobs.view(n, m, -1)[:, :-1]
        draft_lp = pred.gather(2, draft.unsqueeze(2)).squeeze(2)
        top = pred.topk(min(self.beta, pred.size(2)), dim=2).indices
        ok = top.eq(draft.unsqueeze(2)).any(2) & (draft_lp >= best_lp[:, :-1] - self.tau)
        ok &= ~torch.as_tensor(block.pad[:, 1:], device=draft.device)
        dtype = torch.promote_types(lprobs.dtype, torch.float32)
        return Verdict(**to_host(best=best, best_lp=best_lp.to(dtype), draft=draft, draft_lp=draft_lp.to(dtype),
                                 accepted=ok.long().cumprod(1).sum(1)))

    def _verify_lprobs(self, g: DraftCohort, block: Block, steps: Tensor) -> Tensor:
        """Log-probs [N*m, V] at every block slot (or [T, V] at the real `block.slots`), averaged
        over the ensemble like fairseq."""
        enc = g.cache.source_inputs(block.tokens.device)
        top = int(block.steps.max())
        logits = [blk(block.tokens, steps, e, state, block.pad_t, max_position=top, slots=block.slots)
                  for blk, e, state in zip(self.blocks, enc, g.cache.states)]
        lprobs = ensemble_lprobs(self.model.models, logits, self.temperature)
        return lprobs.view(-1, lprobs.size(-1))

    def _hypo(self, out: List[int], lp: List[float], dev) -> Dict[str, Tensor]:
        pos = torch.tensor(lp, dtype=torch.float32, device=dev)  # on the model's device, as fairseq's output
        total = pos.sum()
        score = total / length_norm(len(out), self.len_penalty) if self.normalize_scores else total
        return hypothesis(torch.tensor(out, device=dev), score, pos)
