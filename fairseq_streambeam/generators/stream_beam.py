"""StreamBeamGenerator: fixed, variable-width (VAR-BATCH) and streaming (VAR-STREAM) beam search.

The loop is runtime.driver's (docs/design.md, "Steps"). Every source evolves independently of the
others, so the schedule changes speed, never output.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from ..adapters import alignment
from ..runtime.block_step import BlockDecoder, block_decodable, ensemble_lprobs
from ..runtime.counters import Counters
from ..runtime.driver import Driver, Engine
from ..runtime.kv_cache import (
    KVCache,
    check_incremental,
    check_vocabulary,
    max_positions,
    stand_in,
    transformer_decoders,
)
from ..runtime.lean_encoder import LeanEncoders
from ..runtime.lean_layer import SourceGroups
from ..runtime.rows import Rows
from ..runtime.scheduler import RAGGED, Budget, Scheduler
from ..scorers.base import ScorerStack
from ..search.beam_state import Beams, rank_candidates
from ..search.finalize import Ranked, RankedHost, build_finalize
from ..search.penalties import FairseqPenalties, length_norm
from ..spec import DecodeSpec, UsageError
from .common import Sources, empty_hypothesis, family_spec, hypothesis, sequence_generator_args, to_host

logger = logging.getLogger(__name__)


class LiveRows(NamedTuple):
    """The rows a step expands: their tokens [N, L + 1], cohort-local sources [N], and their
    indices among the cohort's candidate rows (None: every row)."""

    tokens: Tensor
    src: Tensor
    idx: Optional[Tensor]


@dataclass
class StepHost:
    """A step's decisions, made on the host from the ranked candidates' one copy there (the step's
    one synchronization): which ranked candidates [B, R] are final and which continue, which
    sources are done, and each source's best lost EOS candidate (improved, rank)."""

    final: np.ndarray  # [B, R] bool
    keep: np.ndarray  # [B, R] bool
    carried: np.ndarray  # [B, R] bool
    eos: np.ndarray  # [B, R] bool
    parent: np.ndarray  # [B, R] cohort row of each candidate's parent
    done: np.ndarray  # [B] bool
    improved: np.ndarray  # [B] bool
    lost_rank: np.ndarray  # [B]


@dataclass
class Steps(Rows):
    """Tokens each source has decoded: on the host, and on the device when its rows step at their
    own positions (ragged cohorts)."""

    h: np.ndarray
    t: Optional[Tensor] = None


@dataclass
class Finish(Rows):
    """Per source, on the host: hypotheses finished, the best finished score (delta's reference),
    and the best EOS candidate neither final nor kept (the backoff of Iglesias et al. Alg. 1)."""

    count: np.ndarray
    best: np.ndarray
    lost_best: np.ndarray


@dataclass
class SourceState(Rows):
    """Per-source state of a cohort, one entry per live source: window row, length limit (host and
    device), source length (with EOS), where its tokens sit in the cohort's encoder positions
    (alignment), forced prefix, tokens decoded, and its finish state."""

    ids: List[int]
    max_len: np.ndarray
    max_len_t: Tensor
    src_len: np.ndarray
    enc_start: np.ndarray
    prefix: Optional[Tensor]
    steps: Steps
    finish: Finish

    @staticmethod
    def start(ids: List[int], max_len: List[int], src_len: np.ndarray, device, ragged: bool,
              prefix: Optional[Tensor]) -> SourceState:
        n = len(ids)
        return SourceState(
            ids=ids, max_len=np.array(max_len, dtype=np.int64), max_len_t=torch.tensor(max_len, device=device),
            src_len=src_len, enc_start=np.zeros(n, dtype=np.int64), prefix=prefix,
            steps=Steps(np.zeros(n, dtype=np.int64),
                        torch.zeros(n, dtype=torch.long, device=device) if ragged else None),
            finish=Finish(np.zeros(n, dtype=np.int64), np.full(n, -np.inf, dtype=np.float32),
                          np.full(n, -np.inf, dtype=np.float32)))


class BeamCohort:
    """Live sources whose candidates have all decoded `steps` tokens, with their beams and cache (the
    driver's Cohort). Ragged (continuous order): sources at different steps, `steps` the furthest's;
    tokens and cum are right-aligned (padding on the left) and each row steps at its own position."""

    def __init__(self, src: SourceState, beams: Beams, cache: KVCache, serial: int, ragged: bool = False):
        self.src = src
        self.beams = beams
        self.cache = cache
        self.ragged = ragged
        self.src_width = int(src.src_len.max())  # encoder positions
        self.steps = 0
        self.waited = 0
        self.first_serial = serial
        self.backoff: Dict[int, Dict[str, Tensor]] = {}  # window row -> the backoff hypothesis
        self.live_h = np.ones(beams.rows, dtype=bool)  # host mirrors of beams.live / row lengths
        self.len_h = np.zeros(beams.rows, dtype=np.int64)
        self.cache_src_h = np.arange(len(src))  # cohort-local source of each decoder-cache row
        # --print-alignment only: each candidate's attention history and the sample's layout
        # (width 0: each source alone, as online decoding returns it)
        self.attn: Optional[Tensor] = None
        self.sample_width, self.left_pad = 0, True

    @property
    def n_sources(self) -> int:
        return len(self.src.ids)

    @property
    def n_candidates(self) -> int:
        return self.beams.rows

    @staticmethod
    def merge(a: BeamCohort, b: BeamCohort, pad: int = 1) -> BeamCohort:
        """b's sources appended to a's. Cohorts of different lengths merge only when ragged: the
        shorter one's tokens are left-padded with `pad` (its cum with 0) to the longer's width."""
        assert a.steps == b.steps or (a.ragged and b.ragged)
        off = a.n_sources  # b's sources follow a's
        steps = max(a.steps, b.steps)
        wide_b = _widen(b.beams, steps, pad)
        a.beams = Beams.cat([_widen(a.beams, steps, pad), replace(wide_b, src=wide_b.src + off)])
        a.steps = steps
        a.src = SourceState.cat([a.src, b.src])
        a.cache = KVCache.cat([a.cache, b.cache])
        a.src_width = max(a.src_width, b.src_width)
        a.backoff.update(b.backoff)
        a.live_h = np.concatenate([a.live_h, b.live_h])
        a.len_h = np.concatenate([a.len_h, b.len_h])
        a.cache_src_h = np.concatenate([a.cache_src_h, b.cache_src_h + off])
        a.attn = None if a.attn is None else alignment.cat(a.attn, b.attn)  # type: ignore[arg-type]
        a.waited = 0
        a.first_serial = min(a.first_serial, b.first_serial)
        return a


class StreamBeamGenerator(SequenceGenerator):
    """Drop-in for fairseq's SequenceGenerator (same `generate`/`_generate` signature and output)
    for the beam decodings of spec.DECODINGS. `spec` (a spec.DecodeSpec), or its fields as keyword
    arguments under SequenceGenerator's names (`beam_size=5, decoding="var-stream"`). `scorers`:
    per-step additive or masking terms (scorers/); `budget`: live sources for streaming; `lm_model`:
    shallow fusion, as fairseq's."""

    def __init__(self, models, tgt_dict, spec: Optional[DecodeSpec] = None, scorers: Sequence = (),
                 budget: Optional[Budget] = None, lm_model=None, **options):
        spec = family_spec(spec, options, "beam", "beam")
        super().__init__(models, tgt_dict, lm_model=lm_model, **sequence_generator_args(spec, tgt_dict))
        check_incremental(self.model)
        check_vocabulary(self.model, tgt_dict)
        self.spec = spec
        self.pruning = replace(spec.pruning, beam_size=self.beam_size)  # fairseq caps k at the vocabulary
        self.finalizer = build_finalize(spec.rule, self.beam_size, spec.finish_count, spec.nbest)
        # fixed beams under fairseq's rule rank ties in fairseq's order (search/beam_state.py)
        self.rank_like_fairseq = self.pruning.is_fixed and spec.rule == "fairseq"
        policy = spec.policy
        if policy in RAGGED:
            why = _no_ragged_steps(self.model, lm_model, spec.print_alignment)
            if why:
                logger.info("--stream-order %s falls back to min-length: %s", policy, why)
                policy = "min-length"
        # rows at different steps, and every step where the lean layers apply, go through the block
        # step, multiplying by repacked weights. Fixed beams in half precision keep fairseq's decoder
        # step and encoder products: products in other shapes round differently, which moves
        # float16 scores (float32 ones only in their last bits)
        blocks = ([BlockDecoder(m.decoder, spec.compile, repacked=True)
                   for m in self.model.models] if block_steps(self.model) else [])
        self._steps = (blocks, policy in RAGGED, bool(blocks) and all(b.lean for b in blocks)
                       and spec.print_alignment is None)
        self._choose_steps()
        self.encoders = LeanEncoders(self.model)
        if budget is None:  # the task gives its run's budget
            budget = Budget(max_candidates=spec.stream_candidates)
        self.scheduler = Scheduler(policy, budget, spec.refill_eps, spec.max_wait_steps)
        self.driver = Driver(self.scheduler, width=float(self.pruning.beam_size) / 2)
        self.penalties = FairseqPenalties(pad=self.pad, unk=self.unk, eos=self.eos, unk_penalty=spec.unk_penalty,
                                          min_len=spec.min_len, suppress=self.token_indices_to_suppress,
                                          no_repeat_ngram=spec.no_repeat_ngram_size)
        self.mergeable = transformer_decoders(self.model)  # cohorts of equal length share one cache
        self.keep_encoder_out = not self.mergeable
        self.max_source_positions = max_positions(self.model.models, 0)
        if spec.print_alignment and any(getattr(m, "full_context_alignment", False) for m in self.model.models):
            raise UsageError("--print-alignment with a full-context alignment model needs --decoding fairseq")
        self.print_alignment = spec.print_alignment  # hard | soft | None
        if not scorers and (spec.lmbr_posteriors or spec.token_masks):  # files the task reads into scorers
            raise UsageError("StreamBeamGenerator: --lmbr-posteriors and --token-masks need scorers=; the task "
                             "builds them from the files (attach_to_hub, task.build_generator)")
        # additive / masking terms applied in order before top-k (LMBR, token masks): see scorers/base.py
        self.scorer = ScorerStack(scorers) if scorers else None
        self.counters = Counters()

    def start_call(self, n_sources: int) -> None:
        """Read the models as they are now (they may have been converted, e.g. model.half(), or given
        new parameters) for a generate call over `n_sources` sources, or an online decoder (sys.maxsize)."""
        self._choose_steps()
        for block in self.blocks:
            block.start_call(n_sources)
        self.encoders.start_call(n_sources if self.blocks else 0)

    def _choose_steps(self) -> None:
        """Lean block steps where the layers allow them, for fixed beams only with models in full
        precision; the block step for rows at different steps (ragged orders) or lean steps; else
        fairseq's step."""
        blocks, ragged, lean = self._steps
        self.lean_steps = lean and (not self.pruning.is_fixed or all(_full_precision(m) for m in self.model.models))
        self.blocks = blocks if ragged or self.lean_steps else []

    @torch.no_grad()
    def _generate(self, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                  constraints: Optional[Tensor] = None, bos_token: Optional[int] = None):
        if constraints is not None:
            raise NotImplementedError("fairseq_streambeam does not support lexical constraints; "
                                      "use --decoding fairseq")
        t0 = time.perf_counter()
        srcs = Sources.from_sample(sample, self)
        n_src, lengths = len(srcs), srcs.lengths
        self.start_call(n_src)
        results: List[List[Dict[str, Tensor]]] = [[] for _ in range(n_src)]
        engine = self.engine(srcs, results, prefix_tokens, bos_token)
        # streaming admits sources by length (shortest first: cohorts pad little; longest first: long
        # outputs start early); batch modes keep fairseq's batch. Output is per window row either way.
        order = list(range(n_src))
        if self.spec.kind.streaming:
            order.sort(key=lengths.__getitem__, reverse=self.spec.stream_admit == "longest-first")
        self.driver.run(engine, lengths, order)

        out = [self.sorted_hypotheses(r) for r in results]
        if self.print_alignment:
            alignment.add_alignments(out, srcs.net_input["src_tokens"], self.pad, self.eos, self.print_alignment)
        self.counters.sentences += n_src
        self.counters.total_seconds += time.perf_counter() - t0
        return out

    def engine(self, srcs, results, prefix_tokens: Optional[Tensor] = None,
               bos_token: Optional[int] = None) -> Engine[BeamCohort]:
        """The driver's engine over sources `srcs` (a Sources, or an online window), writing each
        window row's hypotheses to `results[row]` (a list per row)."""
        if self.scorer is not None:
            self.scorer.reset()
        # continuous order: one cohort of sources at different steps; prefix tokens are forced per
        # step of a whole cohort, so a call with them steps cohorts of one length (shortest first)
        ragged = self.scheduler.policy in RAGGED and prefix_tokens is None
        bos = self.eos if bos_token is None else bos_token
        return Engine(
            admit=partial(self._admit, srcs, prefix_tokens=prefix_tokens, bos=bos, ragged=ragged),
            step=partial(self._step, results=results),
            mergeable=lambda a, b: self.mergeable and a.steps == b.steps,
            merge=partial(BeamCohort.merge, pad=self.pad),
            joins_live=ragged,
        )

    def _admit(self, srcs: Sources, new: List[int], serial: int, prefix_tokens: Optional[Tensor], bos: int,
               ragged: bool = False) -> BeamCohort:
        """Encode sources `new` (window rows) together and start their beams; `ragged`: cache
        their encoder keys now, so they can join a cohort of sources at other steps."""
        if not self.mergeable:  # fairseq's LSTM encoder packs its input with enforce_sorted: longest first
            new = sorted(new, key=lambda i: -srcs.lengths[i])
        t = time.perf_counter()
        enc = self.encoders(srcs.subset_input(new))
        self.counters.model_seconds += time.perf_counter() - t
        self.counters.encoder_calls += 1
        device, dtype = srcs.device, torch.float32
        state = None
        if self.scorer is not None:
            ids = [srcs.sentence_ids[i] for i in new]
            self.counters.unscored_sources += self.scorer.missing(ids)
            state = self.scorer.start(ids, device)
        beams = Beams.start(len(new), bos, device, dtype, state)
        prefix = None
        if prefix_tokens is not None:
            prefix = prefix_tokens if srcs.is_whole(new) else prefix_tokens.index_select(
                0, torch.tensor(new, device=device))
        cache = KVCache(self.model, len(new), enc, self.keep_encoder_out, per_source=self.lean_steps)
        if ragged or self.lean_steps:
            cache.prime(enc)  # the encoder keys are cached: outputs are no longer read
        src_len = np.array([srcs.lengths[i] for i in new])
        sources = SourceState.start(new, [srcs.max_lens[i] for i in new], src_len, device, ragged, prefix)
        cohort = BeamCohort(sources, beams, cache, serial, ragged)
        if srcs.is_whole(new):  # fairseq's own batch: its padded width
            cohort.src_width = srcs.sample_width
        if self.print_alignment:
            cohort.attn = torch.zeros(len(new), 0, 0, device=device)  # empty histories, widened by the first step
            cohort.sample_width = srcs.sample_width
            cohort.left_pad = srcs.left_pad and not alignment.encoder_repads_right(self.model)
            if cohort.left_pad:
                sources.enc_start = cohort.src_width - src_len
        return cohort

    def _step(self, c: BeamCohort, results: List[List[Dict[str, Tensor]]]) -> List[int]:
        """One decoder step for cohort `c`: score, select, one host copy, emit, advance, evict.
        Returns the window rows of sources that finished."""
        live = self._live_rows(c)
        lprobs, step_attn = self._score(c, live)
        ranked, h = self._select(c, lprobs)
        self._emit(c, ranked, h, step_attn, results)
        self._advance(c, ranked, h, step_attn)
        return self._evict(c, h, results)

    def _live_rows(self, c: BeamCohort) -> LiveRows:
        """The candidate rows the model expands (finished rows carried by the sticky rule are not)."""
        b = c.beams
        if c.live_h.all():
            return LiveRows(b.tokens, b.src, None)
        idx = torch.from_numpy(np.flatnonzero(c.live_h)).to(b.src.device)
        return LiveRows(b.tokens.index_select(0, idx), b.src.index_select(0, idx), idx)

    def _score(self, c: BeamCohort, live: LiveRows) -> Tuple[Tensor, Optional[Tensor]]:
        """Log-probs [live rows, V] of the next token, as fairseq adjusts them (LM fusion, its
        penalties), plus the scorers' terms; and the step's attention (alignment only). Without
        scorers, NaN log-probs are left for ranking to read as -inf (`search.topk`)."""
        t = time.perf_counter()
        step_attn = None
        if c.ragged or self.lean_steps:  # caches primed with their encoder keys at admission
            lprobs = self._block_lprobs(c, live)
        else:
            lprobs, step_attn = self._fairseq_step(c, live)
        if self.lm_model is not None:  # shallow fusion as fairseq does it: the LM reads the whole prefix
            lm_out = self.lm_model(live.tokens)
            lprobs = lprobs + self.lm_weight * self.lm_model.get_normalized_probs(lm_out, log_probs=True)[:, -1, :]
        self.counters.count_step(c.steps, live.tokens.size(0), time.perf_counter() - t, c.src_width,
                                 int(c.src.src_len[c.cache_src_h].sum()))
        c.cache.after_step()
        if c.ragged:
            lprobs = self._ragged_penalties(c, lprobs, live.src, live.tokens)
        else:
            lprobs = self._penalties(c, lprobs, live)
        if self.scorer is not None:
            state = c.beams.state if live.idx is None else c.beams.state.index_select(0, live.idx)
            lprobs = self.scorer.score(lprobs, state)
        return lprobs, step_attn

    def _fairseq_step(self, c: BeamCohort, live: LiveRows) -> Tuple[Tensor, Optional[Tensor]]:
        """fairseq's EnsembleModel.forward_decoder over the live rows. `beam`'s first step runs, as
        fairseq's generator does, on k copies of each source's row and keeps the first: the
        encoder-attention keys cached there serve every later step, and GPU kernels are chosen by
        shape, so in half precision other row counts round them differently from fairseq."""
        k, tokens = self.beam_size, live.tokens
        if c.cache.stepped or k == 1 or not self.rank_like_fairseq or self.spec.kind.streaming:
            return self.model.forward_decoder(tokens, c.cache.decoder_inputs(live.src), c.cache.states,
                                              self.temperature)
        n = tokens.size(0)
        copies = torch.arange(n, device=tokens.device).repeat_interleave(k)
        lprobs, attn = self.model.forward_decoder(tokens.index_select(0, copies),
                                                  c.cache.decoder_inputs(live.src.index_select(0, copies)),
                                                  c.cache.states, self.temperature)
        first = torch.arange(0, n * k, k, device=tokens.device)
        c.cache.reorder(first)
        return lprobs.index_select(0, first), None if attn is None else attn.index_select(0, first)

    def _penalties(self, c: BeamCohort, lprobs: Tensor, live: LiveRows) -> Tensor:
        """fairseq's per-step adjustments for a cohort whose rows are all at step `c.steps`."""
        s, L = c.src, c.steps
        at_max = s.max_len_t.index_select(0, live.src) <= L if L >= s.max_len.min() else None
        prefix = None
        if s.prefix is not None and L < s.prefix.size(1):
            prefix = s.prefix[:, L].index_select(0, live.src)
        lprobs = self.penalties(lprobs, L, at_max, prefix, live.tokens, fix_nan=self.scorer is not None)
        if self.match_source_len:  # each source's limit is its length
            self.penalties.match_length(lprobs, L, s.max_len_t.index_select(0, live.src))
        return lprobs

    def _select(self, c: BeamCohort, lprobs: Tensor) -> Tuple[Ranked, StepHost]:
        """Rank each source's candidates on the device; copy them to the host (the step's one
        sync), and there apply the finalization rule and delta pruning, and find the sources that
        are done and the best EOS candidate lost on each (the backoff)."""
        s, f = c.src, c.src.finish
        # NaN log-probs become -inf in ranking's pass over them, unless a scorer read them first
        ranked = rank_candidates(c.beams, lprobs, len(s), self.pruning, self.finalizer.ranked, self.pad,
                                 self.rank_like_fairseq, fix_nan=self.scorer is None)
        r = RankedHost.of(**to_host(scores=ranked.scores, parent=ranked.parent, token=ranked.token),
                          eos=self.eos, pad=self.pad)
        final, keep = self.finalizer.decide(r, f.count)
        f.best = np.maximum(f.best, np.where(final, r.scores, -np.inf).max(1))
        keep = self.pruning.threshold_keep(r.scores, keep, f.best)
        f.count = f.count + final.sum(1)
        done = (f.count >= self.finalizer.target) | ~keep.any(1) | (s.max_len <= (s.steps.h if c.ragged else c.steps))
        keep &= ~done[:, None]
        lost = np.where(r.is_eos & ~final & ~keep, r.scores, -np.inf)
        lost_best, lost_rank = lost.max(1), lost.argmax(1)
        improved = lost_best > f.lost_best
        f.lost_best = np.maximum(f.lost_best, lost_best)
        return ranked, StepHost(final=final, keep=keep, carried=r.carried, eos=r.is_eos, parent=r.parent, done=done,
                                improved=improved, lost_rank=lost_rank)

    def _emit(self, c: BeamCohort, ranked: Ranked, h: StepHost, step_attn: Optional[Tensor],
              results: List[List[Dict[str, Tensor]]]) -> None:
        """Finished candidates become hypotheses; a better lost EOS candidate becomes a source's backoff."""
        fin_pos = np.flatnonzero(h.final)
        if fin_pos.size:
            for row, hypo in self._hypotheses(c, ranked, fin_pos, h, step_attn):
                results[row].append(hypo)
        better = np.flatnonzero(h.improved)
        if better.size:
            pos = better * h.final.shape[1] + h.lost_rank[better]
            for row, hypo in self._hypotheses(c, ranked, pos, h, step_attn):
                c.backoff[row] = hypo

    def _advance(self, c: BeamCohort, ranked: Ranked, h: StepHost, step_attn: Optional[Tensor]) -> None:
        """The kept candidates become the cohort's rows: beams, scorer state, host mirrors and the
        cache follow their parents; rows of sources that are done are already dropped."""
        b, s, R = c.beams, c.src, h.final.shape[1]
        dev = b.src.device
        kp = np.flatnonzero(h.keep)
        new_src_of = np.cumsum(~h.done) - 1
        parents = h.parent.reshape(-1)[kp]
        carried = h.carried.reshape(-1)[kp]
        new_live = ~carried & ~h.eos.reshape(-1)[kp]
        c.attn = self._child_attn(c, h, step_attn, kp)
        kp_t, par_t = torch.from_numpy(kp).to(dev), torch.from_numpy(parents).to(dev)
        tok = ranked.token.view(-1).index_select(0, kp_t)
        sc = ranked.scores.view(-1).index_select(0, kp_t)
        c.beams = Beams(
            tokens=torch.cat([b.tokens.index_select(0, par_t), tok.unsqueeze(1)], 1),
            cum=torch.cat([b.cum.index_select(0, par_t), sc.unsqueeze(1)], 1),
            src=torch.from_numpy(new_src_of[kp // R]).to(dev),
            live=torch.from_numpy(new_live).to(dev),
            state=None if self.scorer is None else self.scorer.advance(b.state.index_select(0, par_t), tok),
        )
        c.len_h = np.where(carried, c.len_h[parents], s.steps.h[kp // R] + 1)
        cache_row = np.cumsum(c.live_h) - 1  # live (decoder-cache) row of each old candidate row
        row_src_old = (kp // R)[new_live]  # source of each new cache row, old numbering
        moved = not np.array_equal(row_src_old, c.cache_src_h)
        c.cache.reorder(torch.from_numpy(cache_row[parents[new_live]]).to(dev), sources_moved=moved)
        c.cache_src_h = new_src_of[row_src_old]
        c.live_h = new_live

    def _evict(self, c: BeamCohort, h: StepHost, results: List[List[Dict[str, Tensor]]]) -> List[int]:
        """Sources that are done leave the cohort (with their backoff answer if nothing finished)."""
        s = c.src
        done_ids = [s.ids[j] for j in np.flatnonzero(h.done)]
        if done_ids:
            for row in done_ids:
                if not results[row]:
                    self.counters.backoff_hypotheses += row in c.backoff
                    results[row].append(c.backoff.get(row) or empty_hypothesis(self.eos, c.beams.src.device))
                c.backoff.pop(row, None)
            keep_src = np.flatnonzero(~h.done)
            c.src = s = s.select(keep_src)
            c.cache.select_sources(torch.from_numpy(keep_src).to(c.beams.src.device))
        c.steps += 1
        s.steps.h = s.steps.h + 1
        if c.ragged:
            s.steps.t = s.steps.t + 1  # type: ignore[operator]
            if len(s):
                self._tidy_ragged(c)
        return done_ids

    def _child_attn(self, c: BeamCohort, h: StepHost, step_attn: Optional[Tensor], pos: np.ndarray) -> Optional[Tensor]:
        """Attention histories of the ranked candidates at flat positions `pos` (alignment only)."""
        if c.attn is None:
            return None
        if step_attn is None:
            raise ValueError("--print-alignment needs a model whose decoder returns its attention")
        dev = c.beams.src.device
        cache_row = np.cumsum(c.live_h) - 1
        par, stepped = h.parent.reshape(-1)[pos], ~h.carried.reshape(-1)[pos]
        return alignment.extend(c.attn, torch.from_numpy(par).to(dev), step_attn,
                                torch.from_numpy(np.where(stepped, cache_row[par], 0)).to(dev),
                                torch.from_numpy(stepped).to(dev))

    def _block_lprobs(self, c: BeamCohort, live: LiveRows) -> Tensor:
        """Log-probs [N, V] of the live rows through `BlockDecoder`, as one-token blocks over the
        cohort's cache: ragged rows at their own positions (fairseq's incremental decoder takes one
        position for the whole batch) and, with lean layers, over encoder keys cached per source.
        The scores are fairseq's `EnsembleModel.forward_decoder`'s."""
        tokens = live.tokens[:, -1:]
        if c.ragged:
            positions = c.src.steps.t.index_select(0, live.src).unsqueeze(1)  # type: ignore[union-attr]
            top = int(c.src.steps.h.max())
        else:
            positions, top = torch.full_like(tokens, c.steps), c.steps
        groups = SourceGroups.of_rows(live.src, c.cache_src_h, len(c.src)) if c.cache.per_source else None
        encs = stand_in(self.model, tokens.size(0), tokens.device)
        rows = c.cache.take_pending()
        logits = [block(tokens, positions, enc, state, None, max_position=top, groups=groups, rows=rows)
                  for block, state, enc in zip(self.blocks, c.cache.states, encs)]
        return ensemble_lprobs(self.model.models, logits, self.temperature)[:, -1, :]

    def _ragged_penalties(self, c: BeamCohort, lprobs: Tensor, row_src: Tensor, tokens_in: Tensor) -> Tensor:
        """fairseq's per-step adjustments for rows at their sources' own steps: the length limit
        and the minimum length per row. The rows' prefixes are left-padded, which n-gram blocking
        never matches (padding is never a token of a prefix)."""
        s = c.src
        steps = s.steps.t.index_select(0, row_src)  # type: ignore[union-attr]
        at_max = None
        if (s.steps.h >= s.max_len).any():
            at_max = s.max_len_t.index_select(0, row_src) <= steps
        short = int(s.steps.h.min()) < self.min_len
        lprobs = self.penalties(lprobs, max(int(s.steps.h.min()), self.min_len), at_max, None, tokens_in,
                                fix_nan=self.scorer is not None)
        if short:  # no EOS before the minimum length, per row: an -inf write, like the others in any order
            lprobs[:, self.eos] = lprobs[:, self.eos].masked_fill(steps < self.min_len, -math.inf)
        if self.match_source_len:
            self.penalties.match_length(lprobs, steps, s.max_len_t.index_select(0, row_src))
        return lprobs

    def _tidy_ragged(self, c: BeamCohort) -> None:
        """After a ragged step: drop the token columns and cache slots no source reaches any more.
        Every row's slots end at the cache's last slot, so all but the furthest source's `top` last
        slots are masked in every row and are cut off as a view."""
        top = int(c.src.steps.h.max())
        if top < c.steps:
            b = c.beams
            c.beams = replace(b, tokens=b.tokens[:, b.tokens.size(1) - top - 1:], cum=b.cum[:, b.cum.size(1) - top:])
            c.steps = top
        if c.live_h.any() and c.cache.length > top:
            c.cache.truncate(top, last=True)

    def _hypotheses(self, c: BeamCohort, ranked: Ranked, pos: np.ndarray, h: StepHost, step_attn: Optional[Tensor]):
        """fairseq hypothesis dicts (tokens end with EOS) of ranked candidates at flat positions
        `pos`, as (window row, hypothesis) pairs; with --print-alignment, with their attention in
        the sample's layout."""
        attn = self._child_attn(c, h, step_attn, pos)
        b, s, R = c.beams, c.src, h.final.shape[1]
        dev = b.src.device
        parents = h.parent.reshape(-1)[pos]
        par_t = torch.from_numpy(parents).to(dev)
        raw = ranked.scores.view(-1).index_select(0, torch.from_numpy(pos).to(dev))
        toks = torch.cat([b.tokens.index_select(0, par_t)[:, 1:],
                          torch.full((len(pos), 1), self.eos, dtype=torch.long, device=dev)], 1)
        cum = torch.cat([b.cum.index_select(0, par_t), raw.unsqueeze(1)], 1)
        step_lp = torch.diff(cum, dim=1, prepend=cum.new_zeros(len(pos), 1))
        src_of = pos // R
        lens = np.where(h.carried.reshape(-1)[pos], c.len_h[parents], s.steps.h[src_of] + 1)
        start = b.tokens.size(1) - 1 - s.steps.h[src_of]  # 0 unless ragged (right-aligned rows)
        score = raw
        if self.normalize_scores:
            score = raw / torch.tensor([length_norm(n, self.len_penalty) for n in lens], dtype=raw.dtype, device=dev)
        for j, src in enumerate(src_of):
            n, s0 = int(lens[j]), int(start[j])
            yield s.ids[src], hypothesis(
                toks[j, s0:s0 + n], score[j], step_lp[j, s0:s0 + n],
                None if attn is None else alignment.in_sample_layout(
                    attn[j, :n], int(s.enc_start[src]), int(s.src_len[src]), c.sample_width or int(s.src_len[src]),
                    c.left_pad))

    @staticmethod
    def sorted_hypotheses(hypos: List[Dict[str, Tensor]]) -> List[Dict[str, Tensor]]:
        # the same sort as fairseq's SequenceGenerator, so ties break the same way
        scores = torch.tensor([float(h["score"].item()) for h in hypos])
        _, order = torch.sort(scores, descending=True)
        return [hypos[i] for i in order]


def _widen(b: Beams, length: int, pad: int) -> Beams:
    """`b` right-aligned to `length` decoded tokens: tokens [N, length + 1] left-padded with `pad`,
    cum [N, length] with 0 (a row's score before its first token)."""
    extra = length + 1 - b.tokens.size(1)
    if extra == 0:
        return b
    return replace(b, tokens=torch.cat([b.tokens.new_full((b.rows, extra), pad), b.tokens], 1),
                   cum=torch.cat([b.cum.new_zeros(b.rows, extra), b.cum], 1))


def _full_precision(model) -> bool:
    """True when `model`'s weights are float32 or float64 (not fairseq-generate --fp16/--bf16)."""
    p = next(model.parameters(), None)
    return p is None or p.dtype in (torch.float32, torch.float64)


def block_steps(model) -> bool:
    """True when `BlockDecoder` can step every member's decoder over a cache whose rows differ in
    length or read encoder keys cached per source."""
    return transformer_decoders(model) and all(block_decodable(m.decoder) for m in model.models)


def _no_ragged_steps(model, lm_model, print_alignment) -> Optional[str]:
    """Why rows of different lengths cannot step together with this model and these options
    (None: they can)."""
    if not block_steps(model):
        return "it needs fairseq transformer decoders with encoder attention (per-row positions)"
    if lm_model is not None:
        return "shallow fusion's language model reads whole prefixes of one length"
    if print_alignment is not None:
        return "--print-alignment reads each step's attention from fairseq's decoder"
    return None
