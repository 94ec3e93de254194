"""Aggressive decoding (Ge et al. 2022), batched with a KV cache and streaming refill.

Each pass feeds every live row its last accepted token plus a draft block, verifies the whole
block in one decoder pass over the cached prefix, accepts the draft up to its first mismatch plus
the model's own token there (so every pass yields at least one token), and rolls the cache back
by masking the rejected slots. Acceptance is strict top-1, so the output is greedy decoding's
(fairseq `--beam 1`), token for token. Rows that finish leave; new sources enter when fewer than
eps*n are live, as in VAR-STREAM.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from ..drafters.input_copy import CopyState, InputCopyDrafter
from ..runtime.block_step import cached_length, check_block_decoder, compact, forward_block, mask_slots
from ..runtime.cache import (
    cat_incremental_states,
    check_vocabulary,
    encoder_out_stand_in,
    reorder_incremental_state,
)
from ..runtime.counters import Counters
from ..runtime.scheduler import Budget, Scheduler
from ..scorers.penalties import FairseqPenalties
from .common import Sources
from .stream_beam import _max_source_positions


@dataclass
class Row:
    """One live source: window row, its output so far, and its drafter state."""

    window_row: int
    max_len: int
    draft: CopyState
    out: List[int] = field(default_factory=list)
    lp: List[float] = field(default_factory=list)


class Group:
    """Rows decoded in one batch: their fairseq incremental states (one per model)."""

    def __init__(self, rows: List[Row], n_models: int, encoder_outs):
        self.rows = rows
        self.states = [{} for _ in range(n_models)]
        self.encoder_outs = encoder_outs  # only until the first pass has cached cross-attention keys


class AggressiveGenerator(SequenceGenerator):
    """IAD: `--decoding iad`. Same `generate` signature and output format as fairseq's generator."""

    def __init__(self, models, tgt_dict, max_len_a: float = 0, max_len_b: int = 200, max_len: int = 0,
                 min_len: int = 1, normalize_scores: bool = True, len_penalty: float = 1.0,
                 unk_penalty: float = 0.0, temperature: float = 1.0, eos: Optional[int] = None,
                 symbols_to_strip_from_output=None, drafter: Optional[InputCopyDrafter] = None,
                 budget: Optional[Budget] = None, refill_eps: float = 1 / 6, compact_slack: int = 16, **_):
        super().__init__(models, tgt_dict, beam_size=1, max_len_a=max_len_a, max_len_b=max_len_b, max_len=max_len,
                         min_len=min_len, normalize_scores=normalize_scores, len_penalty=len_penalty,
                         unk_penalty=unk_penalty, temperature=temperature, eos=eos,
                         symbols_to_strip_from_output=symbols_to_strip_from_output)
        for m in self.model.models:
            check_block_decoder(m.decoder)
        check_vocabulary(self.model, tgt_dict)
        self.drafter = drafter or InputCopyDrafter()
        self.penalties = FairseqPenalties(pad=self.pad, unk=self.unk, eos=self.eos, unk_penalty=unk_penalty,
                                          min_len=min_len, suppress=self.token_indices_to_suppress)
        self.scheduler = Scheduler("min-length", budget or Budget(), refill_eps)
        self.max_source_positions = _max_source_positions(self.model)
        self.compact_slack = compact_slack
        self.counters = Counters()

    @torch.no_grad()
    def _generate(self, sample, prefix_tokens: Optional[Tensor] = None, constraints: Optional[Tensor] = None,
                  bos_token: Optional[int] = None):
        if constraints is not None or prefix_tokens is not None:
            raise NotImplementedError("aggressive decoding supports neither constraints nor prefix tokens")
        t0 = time.perf_counter()
        srcs = Sources.from_sample(sample, self.pad, self.max_len_a, self.max_len_b, self.max_len, self.min_len,
                                   self.max_source_positions)
        self.bos = self.eos if bos_token is None else bos_token
        results: List[List[Dict[str, Tensor]]] = [[] for _ in range(len(srcs))]
        main: Optional[Group] = None
        next_src, live_tokens = 0, 0
        while next_src < len(srcs) or (main is not None and main.rows):
            live = 0 if main is None else len(main.rows)
            if next_src < len(srcs) and self.scheduler.should_refill(live, live_tokens):
                take = self.scheduler.admit(live, live_tokens, srcs.lengths[next_src:])
                new = list(range(next_src, next_src + take))
                next_src += take
                live_tokens += sum(srcs.lengths[i] for i in new)
                group = self._admit(srcs, new)
                live_tokens -= self._pass(group, results, srcs)  # the first pass fills its cache
                if main is None or not main.rows:
                    main = group
                elif group.rows:
                    main = self._merge(main, group)
                continue
            assert main is not None
            live_tokens -= self._pass(main, results, srcs)
        self.counters.sentences += len(srcs)
        self.counters.total_seconds += time.perf_counter() - t0
        return results

    def _admit(self, srcs: Sources, new: List[int]) -> Group:
        t = time.perf_counter()
        enc = self.model.forward_encoder(srcs.subset_input(new))
        self.counters.model_seconds += time.perf_counter() - t
        self.counters.encoder_calls += 1
        rows = [Row(i, srcs.max_lens[i], self.drafter.start(srcs.tokens(i))) for i in new]
        return Group(rows, self.model.models_size, enc)

    def _merge(self, a: Group, b: Group) -> Group:
        a.states = [cat_incremental_states([sa, sb]) for sa, sb in zip(a.states, b.states)]
        a.rows = a.rows + b.rows
        return a

    def _pass(self, g: Group, results, srcs: Sources) -> int:
        """One verification pass over every row of `g`. Returns source tokens of finished rows."""
        dev = srcs.net_input["src_tokens"].device
        drafts = [self.drafter.draft(r.draft, batched=len(g.rows) > 1) for r in g.rows]
        m = 1 + max(len(d) for d in drafts)
        n = len(g.rows)
        block = torch.full((n, m), self.pad, dtype=torch.long)
        pos = torch.zeros((n, m), dtype=torch.long)
        for i, (r, d) in enumerate(zip(g.rows, drafts)):
            block[i, 0] = r.out[-1] if r.out else self.bos
            block[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
            pos[i] = len(r.out) + torch.arange(m)
        block, pos = block.to(dev), pos.to(dev)
        block_pad = block.eq(self.pad)
        enc = g.encoder_outs if g.encoder_outs is not None else encoder_out_stand_in(self.model, n, dev)

        t = time.perf_counter()
        lprobs = self._verify_lprobs(block, pos, block_pad, enc, g)
        self.counters.model_seconds += time.perf_counter() - t
        self.counters.decoder_steps += 1
        self.counters.expansions += int(n * m)
        g.encoder_outs = None

        steps = torch.tensor([len(r.out) for r in g.rows], device=dev).unsqueeze(1) + torch.arange(m, device=dev)
        lprobs = self._penalties(lprobs, steps, torch.tensor([r.max_len for r in g.rows], device=dev))
        best_lp, best = lprobs.max(dim=2)
        # the one host sync of the pass (token ids are exact in float32 below 2**24)
        best_h, lp_h = torch.stack([best.to(best_lp.dtype), best_lp]).cpu().numpy()
        best_h = best_h.astype("int64")

        rejected = torch.zeros(n, m, dtype=torch.bool)
        done_rows, finished_tokens = [], 0
        for i, (r, d) in enumerate(zip(g.rows, drafts)):
            j = 0
            while j < len(d) and d[j] == best_h[i, j]:
                j += 1
            new = [int(x) for x in best_h[i, : j + 1]]
            new_lp = [float(x) for x in lp_h[i, : j + 1]]
            if self.eos in new:
                k = new.index(self.eos) + 1
                new, new_lp = new[:k], new_lp[:k]
            r.out += new
            r.lp += new_lp
            self.counters.accepted_tokens += len(new)
            rejected[i, j + 1:] = True
            if r.out[-1] == self.eos:
                done_rows.append(i)
                results[r.window_row] = [self._hypo(r, dev)]
                finished_tokens += srcs.lengths[r.window_row]
            else:
                self.drafter.update(r.draft, d, j, r.out)
        prev = cached_length(self.model.models[0].decoder, g.states[0]) - m
        masked = torch.cat([torch.zeros(n, prev, dtype=torch.bool), rejected], 1).to(dev)
        for mdl, st in zip(self.model.models, g.states):
            mask_slots(mdl.decoder, st, masked)
        if done_rows:
            done_set = set(done_rows)
            keep = [i for i in range(n) if i not in done_set]
            idx = torch.tensor(keep, dtype=torch.long, device=dev)
            for mdl, st in zip(self.model.models, g.states):
                reorder_incremental_state(mdl.decoder, st, idx)
            g.rows = [g.rows[i] for i in keep]
        if g.rows:
            real = max(len(r.out) for r in g.rows)
            if cached_length(self.model.models[0].decoder, g.states[0]) > 2 * real + self.compact_slack:
                for mdl, st in zip(self.model.models, g.states):
                    compact(mdl.decoder, st)
        return finished_tokens

    def _verify_lprobs(self, block, pos, block_pad, enc, g: Group) -> Tensor:
        """Log-probs [N, m, V] at every block position, averaged over the ensemble like fairseq."""
        outs = []
        for i, mdl in enumerate(self.model.models):
            logits = forward_block(mdl.decoder, block, pos, enc[i], g.states[i], block_pad)
            logits = logits.div_(self.temperature) if self.temperature != 1.0 else logits
            outs.append(mdl.get_normalized_probs((logits, None), log_probs=True))
        if len(outs) == 1:
            return outs[0]
        return torch.logsumexp(torch.stack(outs, dim=0), dim=0) - math.log(len(outs))

    def _penalties(self, lprobs: Tensor, steps: Tensor, max_len: Tensor) -> Tensor:
        """fairseq's greedy adjustments, each block position at its own step (FairseqPenalties)."""
        n, m, v = lprobs.shape
        flat = self.penalties(lprobs.view(n * m, v), 0, (steps >= max_len.unsqueeze(1)).view(-1), None,
                              before_min_len=(steps < self.min_len).view(-1))
        return flat.view(n, m, v)

    def _hypo(self, r: Row, dev) -> Dict[str, Tensor]:
        pos = torch.tensor(r.lp, dtype=torch.float32)
        total = pos.sum()
        score = total / (len(r.out) ** self.len_penalty) if self.normalize_scores else total
        return {"tokens": torch.tensor(r.out, device=dev), "score": score, "attention": torch.empty(0),
                "alignment": torch.empty(0), "positional_scores": pos}

