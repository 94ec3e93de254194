"""StreamBeamGenerator: fixed, variable-width (VAR-BATCH) and streaming (VAR-STREAM) beam search.

The loop (see docs/design.md) is runtime.driver's: the Scheduler admits sources and picks a
cohort; the cohort's KVCache feeds one incremental decoder step; fairseq's penalties adjust the log-probs;
`rank_candidates` + the finalization rule + pruning decide what is final and what continues;
beams and cache follow the back-pointers. Every source evolves independently of the others, so
the schedule changes speed, never output. With the continuous order there is one cohort whose
sources are at different steps: its rows step through `forward_block` at their own positions,
over a cache whose rows are padded with masked slots.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from ..adapters import alignment as attention
from ..runtime.block_step import BlockDecoder, block_decodable
from ..runtime.counters import Counters
from ..runtime.driver import Driver, Engine
from ..runtime.kv_cache import KVCache, check_incremental, check_vocabulary, stand_in, transformer_decoders
from ..runtime.lean_encoder import forward_encoder
from ..runtime.rows import Rows
from ..runtime.scheduler import RAGGED, Budget, Scheduler
from ..scorers.base import ScorerStack
from ..search.beam_state import Beams, rank_candidates
from ..search.finalize import build_finalize
from ..search.penalties import FairseqPenalties
from ..search.pruning import Pruning
from .common import Sources

DECODINGS = ("beam", "greedy", "var-batch", "var-stream", "fixed-stream")
STREAMING = ("var-stream", "fixed-stream")
PAPER_DELTA = 1.5  # Yang et al. 2020, Table 1 settings
PAPER_M = 5
ORDERS = ("min-length", "fifo", "continuous")
ADMIT_ORDERS = ("shortest-first", "longest-first")

logger = logging.getLogger(__name__)


@dataclass
class DecodeMode:
    """Resolved decoding mode: pruning, finalization rule and scheduling policy."""

    name: str
    pruning: Pruning
    finalize: str
    policy: str

    @staticmethod
    def resolve(decoding: str, beam_size: int, delta: Optional[float], max_cands: Optional[int],
                finalize: str = "auto", stream_order: str = "min-length") -> DecodeMode:
        if decoding not in DECODINGS:
            raise ValueError(f"unknown --decoding {decoding!r}; expected one of {DECODINGS}")
        variable = decoding.startswith("var-")
        if not variable and (delta is not None or max_cands is not None):
            raise ValueError(
                f"--prune-abs-threshold/--prune-max-cands only apply to var-batch and var-stream, "
                f"not --decoding {decoding}"
            )
        if decoding == "greedy":
            beam_size = 1
        pruning = Pruning(
            beam_size=beam_size,
            delta=(PAPER_DELTA if delta is None else delta) if variable else math.inf,
            max_cands=(PAPER_M if max_cands is None else max_cands) if variable else 0,
        )
        if finalize == "auto":
            finalize = "sticky" if variable else "fairseq"
        if stream_order not in ORDERS:
            raise ValueError(f"--stream-order must be one of {ORDERS}, got {stream_order!r}")
        policy = stream_order if decoding in STREAMING else "batch"
        return DecodeMode(decoding, pruning, finalize, policy)


@dataclass
class SourceState(Rows):
    """Per-source state of a cohort, one entry per live source: window row, length limit, source
    length (with EOS), tokens decoded (host, and a device copy when ragged), where its tokens sit in
    the cohort's encoder positions (alignment), finished counts, best finished score, the best EOS
    candidate neither final nor kept (the backoff of Iglesias et al. Alg. 1), forced prefix."""

    ids: List[int]
    max_len: List[int]
    src_len: np.ndarray
    steps_h: np.ndarray
    enc_start: np.ndarray
    max_len_t: Tensor
    n_final: Tensor
    best_final: Tensor
    lost_best: Tensor
    steps_t: Optional[Tensor] = None
    prefix: Optional[Tensor] = None

    @staticmethod
    def start(ids: List[int], max_len: List[int], src_len: np.ndarray, device, dtype, ragged: bool,
              prefix: Optional[Tensor]) -> SourceState:
        n = len(ids)
        return SourceState(
            ids=ids, max_len=max_len, src_len=src_len, steps_h=np.zeros(n, dtype=np.int64),
            enc_start=np.zeros(n, dtype=np.int64), max_len_t=torch.tensor(max_len, device=device),
            n_final=torch.zeros(n, dtype=torch.long, device=device),
            best_final=torch.full((n,), -math.inf, dtype=dtype, device=device),
            lost_best=torch.full((n,), -math.inf, dtype=dtype, device=device),
            steps_t=torch.zeros(n, dtype=torch.long, device=device) if ragged else None, prefix=prefix)


class Cohort:
    """Live sources whose candidates all have `length` decoded tokens, with their beams and cache.
    Ragged (continuous order): sources at different steps share the cohort; `length` is then the
    furthest source's step, beams' tokens and cum are right-aligned (each row's last token in the
    last column, padding on the left) and every row steps at its own position."""

    def __init__(self, src: SourceState, beams: Beams, cache: KVCache, serial: int, ragged: bool = False):
        self.src = src
        self.beams = beams
        self.cache = cache
        self.ragged = ragged
        self.src_width = int(src.src_len.max())  # encoder positions
        self.length = 0
        self.waited = 0
        self.first_serial = serial
        self.backoff: Dict[int, Dict[str, Tensor]] = {}  # window row -> the backoff hypothesis
        self.live_h = np.ones(beams.rows, dtype=bool)  # host mirrors of beams.live / row lengths
        self.len_h = np.zeros(beams.rows, dtype=np.int64)
        self.cache_src_h = np.arange(len(src))  # cohort-local source of each decoder-cache row
        # --print-alignment only: each candidate's attention history and the sample's layout
        self.attn: Optional[Tensor] = None
        self.sample_width, self.left_pad = 0, True

    @property
    def n_sources(self) -> int:
        return len(self.src.ids)

    @property
    def n_candidates(self) -> int:
        return self.beams.rows

    @staticmethod
    def merge(a: Cohort, b: Cohort, pad: int = 1) -> Cohort:
        """b's sources appended to a's. Cohorts of different lengths merge only when ragged: the
        shorter one's tokens are left-padded with `pad` (its cum with 0) to the longer's width."""
        assert a.length == b.length or (a.ragged and b.ragged)
        off = a.n_sources  # b's sources follow a's
        length = max(a.length, b.length)
        a.beams = Beams.cat([_widen(a.beams, length, pad), _widen(b.beams, length, pad)], [0, off])
        a.length = length
        a.src = SourceState.cat([a.src, b.src])
        a.cache = KVCache.cat([a.cache, b.cache])
        a.src_width = max(a.src_width, b.src_width)
        a.backoff.update(b.backoff)
        a.live_h = np.concatenate([a.live_h, b.live_h])
        a.len_h = np.concatenate([a.len_h, b.len_h])
        a.cache_src_h = np.concatenate([a.cache_src_h, b.cache_src_h + off])
        a.attn = None if a.attn is None else attention.cat(a.attn, b.attn)  # type: ignore[arg-type]
        a.waited = 0
        a.first_serial = min(a.first_serial, b.first_serial)
        return a


class StreamBeamGenerator(SequenceGenerator):
    """Drop-in for fairseq's SequenceGenerator (same `generate`/`_generate` signature and output).

    decoding: beam | greedy | var-batch | var-stream | fixed-stream. delta / max_cands: the paper's
    pruning (var-* only; defaults 1.5 and 5). finalize: fairseq | sticky | auto (sticky for var-*).
    finish_count (z): finished hypotheses that end a source under the sticky rule (default k; an
    error with the fairseq rule). nbest: hypotheses the caller reads, at most those that end a source.
    budget: live sources for streaming modes. refill_eps: refill when fewer than eps*n are live.
    stream_admit: shortest-first | longest-first, the order streaming admits a window's sources.
    max_wait: step a cohort that waited this many steps first (latency bound; 0 = off).
    """

    def __init__(
        self,
        models,
        tgt_dict,
        beam_size: int = 1,
        max_len_a: float = 0,
        max_len_b: int = 200,
        max_len: int = 0,
        min_len: int = 1,
        normalize_scores: bool = True,
        len_penalty: float = 1.0,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        tokens_to_suppress=(),
        no_repeat_ngram_size: int = 0,
        match_source_len: bool = False,
        lm_model=None,
        lm_weight: float = 1.0,
        eos: Optional[int] = None,
        symbols_to_strip_from_output=None,
        decoding: str = "beam",
        delta: Optional[float] = None,
        max_cands: Optional[int] = None,
        finalize: str = "auto",
        nbest: int = 1,
        finish_count: Optional[int] = None,
        stream_order: str = "min-length",
        stream_admit: str = "shortest-first",
        budget: Optional[Budget] = None,
        refill_eps: float = 1 / 6,
        max_wait: int = 0,
        keep_encoder_out: Optional[bool] = None,
        profile: bool = False,
        print_alignment: Optional[str] = None,
        scorers: Sequence = (),
    ):
        super().__init__(
            models, tgt_dict, beam_size=beam_size, max_len_a=max_len_a, max_len_b=max_len_b,
            max_len=max_len, min_len=min_len, normalize_scores=normalize_scores,
            len_penalty=len_penalty, unk_penalty=unk_penalty, temperature=temperature, eos=eos,
            symbols_to_strip_from_output=symbols_to_strip_from_output,
            tokens_to_suppress=tokens_to_suppress, lm_model=lm_model, lm_weight=lm_weight,
            match_source_len=match_source_len,
        )
        check_incremental(self.model)
        check_vocabulary(self.model, tgt_dict)
        self.mode = DecodeMode.resolve(decoding, self.beam_size, delta, max_cands, finalize, stream_order)
        self.pruning = self.mode.pruning
        if stream_admit not in ADMIT_ORDERS:
            raise ValueError(f"--stream-admit must be one of {ADMIT_ORDERS}, got {stream_admit!r}")
        self.admit_longest_first = stream_admit == "longest-first"
        self.finalizer = build_finalize(self.mode.finalize, self.pruning.beam_size, finish_count, nbest)
        # fixed beams under fairseq's rule rank ties in fairseq's order (search/beam_state.py)
        self.rank_like_fairseq = self.pruning.is_fixed and self.mode.finalize == "fairseq"
        policy = self.mode.policy
        if policy in RAGGED:
            why = _no_ragged_steps(self.model, lm_model, print_alignment)
            if why:
                logger.info("--stream-order %s falls back to min-length: %s", policy, why)
                policy = "min-length"
        # rows at different steps go through the block step, one decoder call per cohort step
        self.blocks = [BlockDecoder(m.decoder) for m in self.model.models] if policy in RAGGED else []
        self.scheduler = Scheduler(policy, budget or Budget(), refill_eps, max_wait)
        self.driver = Driver(self.scheduler, width=float(self.pruning.beam_size) / 2)
        self.penalties = FairseqPenalties(
            pad=self.pad, unk=self.unk, eos=self.eos, unk_penalty=unk_penalty, min_len=min_len,
            suppress=self.token_indices_to_suppress, no_repeat_ngram=no_repeat_ngram_size,
        )
        self.mergeable = transformer_decoders(self.model)  # cohorts of equal length share one cache
        self.keep_encoder_out = not self.mergeable if keep_encoder_out is None else keep_encoder_out
        self.max_source_positions = _max_source_positions(self.model)
        self.profile = profile
        if print_alignment is not None and any(getattr(m, "full_context_alignment", False) for m in self.model.models):
            raise ValueError("--print-alignment with a full-context alignment model needs --decoding fairseq")
        self.print_alignment = None if print_alignment is None else str(print_alignment)  # hard | soft
        # additive / masking terms applied in order before top-k (LMBR, token masks): see scorers/base.py
        self.scorer = ScorerStack(scorers) if scorers else None
        self.counters = Counters()

    @torch.no_grad()
    def _generate(self, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                  constraints: Optional[Tensor] = None, bos_token: Optional[int] = None):
        if constraints is not None:
            raise NotImplementedError("fairseq_streambeam does not support lexical constraints; "
                                      "use --decoding fairseq")
        t0 = time.perf_counter()
        srcs = Sources.from_sample(sample, self.pad, self.max_len_a, self.max_len_b, self.max_len, self.min_len,
                                   self.max_source_positions, self.match_source_len)
        n_src, lengths = len(srcs), srcs.lengths
        device = srcs.net_input["src_tokens"].device
        bos = self.eos if bos_token is None else bos_token
        results: List[List[Dict[str, Tensor]]] = [[] for _ in range(n_src)]
        if self.scorer is not None:
            self.scorer.reset()

        # continuous order: one cohort of sources at different steps; prefix tokens are forced per
        # step of a whole cohort, so a call with them steps cohorts of one length (shortest first)
        ragged = self.scheduler.policy in RAGGED and prefix_tokens is None
        # streaming admits sources by length: shortest first, cohorts (and their merges) pad little;
        # longest first, long outputs start early and the window's last steps are fuller. Batch
        # modes keep fairseq's batch as it is. Output is per window row either way.
        order = list(range(n_src))
        if self.mode.policy != "batch":
            order.sort(key=lengths.__getitem__, reverse=self.admit_longest_first)
        engine = Engine(
            admit=partial(self._admit, srcs, prefix_tokens=prefix_tokens, bos=bos, device=device, ragged=ragged),
            step=partial(self._step, results=results),
            mergeable=lambda a, b: self.mergeable and a.length == b.length,
            merge=partial(Cohort.merge, pad=self.pad),
            joins_live=ragged,
        )
        self.driver.run(engine, lengths, order)

        out = [self._sorted(r) for r in results]
        if self.print_alignment:
            attention.add_alignments(out, srcs.net_input["src_tokens"], self.pad, self.eos, self.print_alignment)
        self.counters.sentences += n_src
        self.counters.total_seconds += time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------------------------------

    def _admit(self, srcs: Sources, new: List[int], serial: int, prefix_tokens: Optional[Tensor], bos: int, device,
               ragged: bool = False) -> Cohort:
        """Encode sources `new` (window rows) together and start their beams; `ragged`: cache
        their encoder keys now, so they can join a cohort of sources at other steps."""
        if not self.mergeable:  # fairseq's LSTM encoder packs its input with enforce_sorted: longest first
            new = sorted(new, key=lambda i: -srcs.lengths[i])
        t = self._tick()
        enc = forward_encoder(self.model, srcs.subset_input(new))
        self.counters.model_seconds += self._tock(t)
        self.counters.encoder_calls += 1
        dtype = torch.float32
        state = None if self.scorer is None else self.scorer.start([srcs.sentence_ids[i] for i in new], device)
        beams = Beams.start(len(new), bos, device, dtype, state)
        prefix = None
        if prefix_tokens is not None:
            prefix = prefix_tokens if srcs.is_whole(new) else prefix_tokens.index_select(
                0, torch.tensor(new, device=device))
        cache = KVCache(self.model, len(new), enc, self.keep_encoder_out)
        if ragged:
            cache.prime(enc)  # the encoder keys are cached: outputs are no longer read
        src_len = np.array([srcs.lengths[i] for i in new])
        sources = SourceState.start(new, [srcs.max_lens[i] for i in new], src_len, device, dtype, ragged, prefix)
        cohort = Cohort(sources, beams, cache, serial, ragged)
        if srcs.is_whole(new):  # fairseq's own batch: its padded width
            cohort.src_width = srcs.net_input["src_tokens"].size(1)
        if self.print_alignment:
            cohort.attn = attention.start(len(new), device)
            cohort.sample_width, cohort.left_pad = srcs.net_input["src_tokens"].size(1), srcs.left_pad
            if srcs.left_pad:
                sources.enc_start = cohort.src_width - src_len
        return cohort

    def _step(self, c: Cohort, results: List[List[Dict[str, Tensor]]]) -> List[int]:
        """One decoder step for cohort `c`: expand, rank, finalize, prune, reorder. Returns the
        window rows of sources that finished."""
        L = c.length  # ragged: the furthest source's step; sources' own steps are s.steps_h / s.steps_t
        s = c.src
        b = c.beams
        ragged = c.ragged
        all_live = bool(c.live_h.all())
        if all_live:
            tokens_in, row_src = b.tokens, b.src
        else:
            live_idx = torch.from_numpy(np.flatnonzero(c.live_h)).to(b.src.device)
            tokens_in, row_src = b.tokens.index_select(0, live_idx), b.src.index_select(0, live_idx)
        t = self._tick()
        if ragged:
            lprobs, step_attn = self._ragged_lprobs(c, tokens_in, row_src), None
        else:
            lprobs, step_attn = self.model.forward_decoder(tokens_in, c.cache.decoder_inputs(row_src), c.cache.states,
                                                           self.temperature)
        if self.lm_model is not None:  # shallow fusion as fairseq does it: the LM reads the whole prefix
            lm_out = self.lm_model(tokens_in)
            lprobs = lprobs + self.lm_weight * self.lm_model.get_normalized_probs(lm_out, log_probs=True)[:, -1, :]
        dt = self._tock(t)
        rows = tokens_in.size(0)
        cnt = self.counters
        cnt.model_seconds += dt
        cnt.decoder_steps += 1
        cnt.expansions += rows
        cnt.padded_positions += rows * c.src_width
        cnt.source_positions += int(s.src_len[c.cache_src_h].sum())
        if cnt.trace is not None:
            cnt.trace.append((L, rows, dt))
        c.cache.after_step()

        if ragged:
            lprobs = self._ragged_penalties(c, lprobs, row_src, tokens_in)
        else:
            at_max = s.max_len_t.index_select(0, row_src) <= L if L >= min(s.max_len) else None
            prefix = None
            if s.prefix is not None and L < s.prefix.size(1):
                prefix = s.prefix[:, L].index_select(0, row_src)
            lprobs = self.penalties(lprobs, L, at_max, prefix, tokens_in)
        if self.scorer is not None:
            lprobs = self.scorer.score(lprobs, b.state if all_live else b.state.index_select(0, live_idx))

        n_src = len(s)
        ranked = rank_candidates(b, lprobs, n_src, self.pruning, self.finalizer.ranked_per_source(),
                                 self.eos, self.pad, self.rank_like_fairseq)
        final, keep = self.finalizer.decide(ranked, s.n_final)
        # masked_fill with a Python -inf, not torch.where with new_tensor(-inf): a new device tensor
        # from a host number is a host-to-device copy, which synchronizes on CUDA
        fin_best = ranked.scores.masked_fill(~final, -math.inf).max(1).values
        s.best_final = torch.maximum(s.best_final, fin_best)
        keep = self.pruning.threshold_keep(ranked.scores, keep, s.best_final)
        s.n_final = s.n_final + final.sum(1)
        done = (s.n_final >= self.finalizer.target) | ~keep.any(1) | (s.max_len_t <= (s.steps_t if ragged else L))
        keep &= ~done.unsqueeze(1)
        lost = ranked.is_eos & ~final & ~keep
        lost_best, lost_rank = ranked.scores.masked_fill(~lost, -math.inf).max(1)
        improved = lost_best > s.lost_best
        s.lost_best = torch.maximum(s.lost_best, lost_best)

        # the one host sync of the step: what is final, what continues, which sources are done
        R = ranked.scores.size(1)
        packed = torch.cat([
            final.view(-1).long(), keep.view(-1).long(), ranked.carried.view(-1).long(),
            ranked.is_eos.view(-1).long(), ranked.parent.view(-1), done.long(), improved.long(), lost_rank,
        ]).cpu().numpy()
        nr = n_src * R
        final_h, keep_h, carried_h, eos_h, parent_h = (packed[j * nr:(j + 1) * nr] for j in range(5))
        done_h = packed[5 * nr: 5 * nr + n_src].astype(bool)
        improved_h, lost_rank_h = packed[5 * nr + n_src: 5 * nr + 2 * n_src], packed[5 * nr + 2 * n_src:]

        dev = b.src.device
        cache_row = np.cumsum(c.live_h) - 1  # live (decoder-cache) row of each candidate row

        def child_attn(pos: np.ndarray) -> Optional[Tensor]:
            """Attention histories of the ranked candidates at flat positions `pos` (alignment only)."""
            if c.attn is None:
                return None
            if step_attn is None:
                raise ValueError("--print-alignment needs a model whose decoder returns its attention")
            par, stepped = parent_h[pos], ~carried_h[pos].astype(bool)
            return attention.extend(c.attn, torch.from_numpy(par).to(dev), step_attn,
                                    torch.from_numpy(np.where(stepped, cache_row[par], 0)).to(dev),
                                    torch.from_numpy(stepped).to(dev))

        fin_pos = np.flatnonzero(final_h)
        if fin_pos.size:
            for row, hypo in self._hypotheses(c, ranked, fin_pos, parent_h, carried_h, R, child_attn(fin_pos)):
                results[row].append(hypo)
        better = np.flatnonzero(improved_h)
        if better.size:
            pos = better * R + lost_rank_h[better]
            for row, hypo in self._hypotheses(c, ranked, pos, parent_h, carried_h, R, child_attn(pos)):
                c.backoff[row] = hypo

        kp = np.flatnonzero(keep_h)
        survive = ~done_h
        new_src_of = np.cumsum(survive) - 1
        parents = parent_h[kp]
        carried = carried_h[kp].astype(bool)
        new_live = ~carried & ~eos_h[kp].astype(bool)
        c.attn = child_attn(kp)
        kp_t = torch.from_numpy(kp).to(dev)
        par_t = torch.from_numpy(parents).to(dev)
        tok = ranked.token.view(-1).index_select(0, kp_t)
        sc = ranked.scores.view(-1).index_select(0, kp_t)
        c.beams = Beams(
            tokens=torch.cat([b.tokens.index_select(0, par_t), tok.unsqueeze(1)], 1),
            cum=torch.cat([b.cum.index_select(0, par_t), sc.unsqueeze(1)], 1),
            src=torch.from_numpy(new_src_of[kp // R]).to(dev),
            live=torch.from_numpy(new_live).to(dev),
            state=None if self.scorer is None else self.scorer.advance(b.state.index_select(0, par_t), tok),
        )
        c.len_h = np.where(carried, c.len_h[parents], s.steps_h[kp // R] + 1)
        row_src_old = (kp // R)[new_live]  # source of each new cache row, old numbering
        moved = not np.array_equal(row_src_old, c.cache_src_h)
        c.cache.reorder(torch.from_numpy(cache_row[parents[new_live]]).to(dev), sources_moved=moved)
        c.cache_src_h = new_src_of[row_src_old]
        c.live_h = new_live

        done_ids = [s.ids[j] for j in np.flatnonzero(done_h)]
        if done_ids:
            for row in done_ids:
                if not results[row]:
                    self.counters.backoff_hypotheses += row in c.backoff
                    results[row].append(c.backoff.get(row) or self._empty_hypo(dev))
                c.backoff.pop(row, None)
            keep_src = np.flatnonzero(survive)
            c.src = s = s.select(keep_src)
            c.cache.select_sources(torch.from_numpy(keep_src).to(dev))
        c.length = L + 1
        s.steps_h = s.steps_h + 1
        if ragged:
            s.steps_t = s.steps_t + 1  # type: ignore[operator]
            if len(s):
                self._tidy_ragged(c)
        return done_ids

    def _ragged_lprobs(self, c: Cohort, tokens_in: Tensor, row_src: Tensor) -> Tensor:
        """Log-probs [N, V] of the live rows of a ragged cohort, each row's last token at its own
        position. fairseq's incremental decoder takes one position for the whole batch (the
        prefix width), so the rows go through `forward_block` as blocks of one token over the
        cohort's cache; the scores are fairseq's `EnsembleModel.forward_decoder`'s (temperature,
        normalized log-probs, the ensemble's log-mean-exp)."""
        positions = c.src.steps_t.index_select(0, row_src).unsqueeze(1)  # type: ignore[union-attr]
        tokens = tokens_in[:, -1:]
        top = int(c.src.steps_h.max())
        encs = stand_in(self.model, tokens.size(0), tokens.device)
        outs = []
        for m, block, state, enc in zip(self.model.models, self.blocks, c.cache.states, encs):
            logits = block(tokens, positions, enc, state, None, max_position=top)
            if self.temperature != 1.0:
                logits = logits.div_(self.temperature)
            outs.append(m.get_normalized_probs((logits, None), log_probs=True)[:, -1, :])
        if len(outs) == 1:
            return outs[0]
        return torch.logsumexp(torch.stack(outs, dim=0), dim=0) - math.log(len(outs))

    def _ragged_penalties(self, c: Cohort, lprobs: Tensor, row_src: Tensor, tokens_in: Tensor) -> Tensor:
        """fairseq's per-step adjustments for rows at their sources' own steps: the length limit
        and the minimum length per row. The rows' prefixes are left-padded, which n-gram blocking
        never matches (padding is never a token of a prefix)."""
        s = c.src
        steps = s.steps_t.index_select(0, row_src)  # type: ignore[union-attr]
        at_max = None
        if bool((s.steps_h >= np.asarray(s.max_len)).any()):
            at_max = s.max_len_t.index_select(0, row_src) <= steps
        short = int(s.steps_h.min()) < self.min_len
        lprobs = self.penalties(lprobs, max(int(s.steps_h.min()), self.min_len), at_max, None, tokens_in)
        if short:  # no EOS before the minimum length, per row: an -inf write, like the others in any order
            lprobs[:, self.eos] = lprobs[:, self.eos].masked_fill(steps < self.min_len, -math.inf)
        return lprobs

    def _tidy_ragged(self, c: Cohort) -> None:
        """After a ragged step: drop the token columns and the cache slots no source reaches any
        more. Every row's slots end at the cache's last slot (rows step together; a joining row
        has none yet), so all but the furthest source's `top` last slots are masked in every row
        and are cut off as a view."""
        top = int(c.src.steps_h.max())
        if top < c.length:
            b = c.beams
            c.beams = Beams(tokens=b.tokens[:, b.tokens.size(1) - top - 1:], cum=b.cum[:, b.cum.size(1) - top:],
                            src=b.src, live=b.live, state=b.state)
            c.length = top
        if c.live_h.any() and c.cache.length > top:
            c.cache.truncate(top, last=True)

    def _hypotheses(self, c: Cohort, ranked, fin_pos: np.ndarray, parent_h: np.ndarray,
                    carried_h: np.ndarray, R: int, attn: Optional[Tensor] = None):
        """fairseq hypothesis dicts (tokens end with EOS) of ranked candidates at flat positions
        `fin_pos`, as (window row, hypothesis) pairs; `attn` [F, L + 1, S] their attention
        histories (--print-alignment), returned in the sample's layout."""
        b = c.beams
        dev = b.src.device
        idx = torch.from_numpy(fin_pos).to(dev)
        parents = parent_h[fin_pos]
        par_t = torch.from_numpy(parents).to(dev)
        raw = ranked.scores.view(-1).index_select(0, idx)
        toks = torch.cat([b.tokens.index_select(0, par_t)[:, 1:],
                          torch.full((len(fin_pos), 1), self.eos, dtype=torch.long, device=dev)], 1)
        cum = torch.cat([b.cum.index_select(0, par_t), raw.unsqueeze(1)], 1)
        pos = cum.clone()
        pos[:, 1:] = cum[:, 1:] - cum[:, :-1]
        src_of = fin_pos // R
        s = c.src
        lens = np.where(carried_h[fin_pos].astype(bool), c.len_h[parents], s.steps_h[src_of] + 1)
        start = b.tokens.size(1) - 1 - s.steps_h[src_of]  # 0 unless ragged (right-aligned rows)
        if self.normalize_scores:
            div = torch.tensor([float(n) ** self.len_penalty for n in lens], dtype=raw.dtype, device=dev)
            score = raw / div
        else:
            score = raw
        for j, p in enumerate(fin_pos):
            n, src, s0 = int(lens[j]), p // R, int(start[j])
            yield s.ids[src], {
                "tokens": toks[j, s0:s0 + n], "score": score[j],
                "attention": torch.empty(0) if attn is None else attention.in_sample_layout(
                    attn[j, :n], int(s.enc_start[src]), int(s.src_len[src]), c.sample_width, c.left_pad),
                "alignment": torch.empty(0), "positional_scores": pos[j, s0:s0 + n],
            }

    def _empty_hypo(self, dev) -> Dict[str, Tensor]:
        """Defined output for a source whose every candidate was invalid (e.g. all -inf)."""
        return {"tokens": torch.tensor([self.eos], device=dev), "score": torch.tensor(-math.inf, device=dev),
                "attention": torch.empty(0), "alignment": torch.empty(0),
                "positional_scores": torch.tensor([-math.inf], device=dev)}

    @staticmethod
    def _sorted(hypos: List[Dict[str, Tensor]]) -> List[Dict[str, Tensor]]:
        # the same sort as fairseq's SequenceGenerator, so ties break the same way
        scores = torch.tensor([float(h["score"].item()) for h in hypos])
        _, order = torch.sort(scores, descending=True)
        return [hypos[i] for i in order]

    def _tick(self) -> float:
        if self.profile and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _tock(self, t: float) -> float:
        return self._tick() - t


def _max_source_positions(model) -> int:
    best = math.inf
    for m in model.models:
        mp = m.max_positions() if hasattr(m, "max_positions") else None
        if isinstance(mp, tuple):
            mp = mp[0]
        if isinstance(mp, int):
            best = min(best, mp)
    return int(best) if best != math.inf else 10**9


def _widen(b: Beams, length: int, pad: int) -> Beams:
    """`b` right-aligned to `length` decoded tokens: tokens [N, length + 1] left-padded with `pad`,
    cum [N, length] with 0 (a row's score before its first token)."""
    extra = length + 1 - b.tokens.size(1)
    if extra == 0:
        return b
    return Beams(tokens=torch.cat([b.tokens.new_full((b.rows, extra), pad), b.tokens], 1),
                 cum=torch.cat([b.cum.new_zeros(b.rows, extra), b.cum], 1), src=b.src, live=b.live, state=b.state)


def _no_ragged_steps(model, lm_model, print_alignment) -> Optional[str]:
    """Why rows of different lengths cannot step together with this model and these options
    (None: they can)."""
    if not transformer_decoders(model) or not all(block_decodable(m.decoder) for m in model.models):
        return "it needs fairseq transformer decoders with encoder attention (per-row positions)"
    if lm_model is not None:
        return "shallow fusion's language model reads whole prefixes of one length"
    if print_alignment is not None:
        return "--print-alignment reads each step's attention from fairseq's decoder"
    return None
