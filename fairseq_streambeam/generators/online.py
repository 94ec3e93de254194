"""Online decoding: a generator's loop kept open, with sources added between steps.

`OnlineDecoder` wraps a StreamBeamGenerator or an AggressiveGenerator. Sources are added at any
time (`add`); each `step` admits waiting sources when the generator's scheduler refills, steps one
cohort and returns the sources that finished, with their hypotheses. A source's output is the one
offline decoding gives it: every source evolves independently of the others (runtime/driver.py).
This is what a server's decoding loop drives (serve.py); it is not thread-safe, so one thread owns it.
The models are read as they are when it is built (the generator's `start_call`, over sources
without end: on the CPU their weights are copied into the layout it multiplies fastest, once for the
decoder's life): convert them, or change their weights, before building it.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor

from ..adapters import alignment
from ..runtime.driver import Feed, Run
from ..search.penalties import source_max_len


class OnlineSources:
    """The window of an online decoder: sources numbered in arrival order, left-padded when
    encoded together (as fairseq's translation task collates them), forgotten once answered.
    Has the interface of generators.common.Sources that the generators and drafters read."""

    def __init__(self, pad: int, device: torch.device):
        self.pad, self.device, self.left_pad = pad, device, True
        self.lengths: Dict[int, int] = {}
        self.max_lens: Dict[int, int] = {}
        self.sentence_ids: Dict[int, int] = {}
        self._tokens: Dict[int, List[int]] = {}
        self.next_row = 0

    @property
    def sample_width(self) -> int:
        return 0  # no shared batch: each source's attention is returned over its own tokens

    def add(self, tokens: Sequence[int], max_len: int) -> int:
        row, self.next_row = self.next_row, self.next_row + 1
        self._tokens[row] = list(tokens)
        self.lengths[row], self.max_lens[row], self.sentence_ids[row] = len(tokens), max_len, row
        return row

    def forget(self, row: int) -> None:
        for d in (self._tokens, self.lengths, self.max_lens, self.sentence_ids):
            d.pop(row, None)

    def __len__(self) -> int:
        return len(self.lengths)

    def is_whole(self, rows: List[int]) -> bool:
        return False  # never fairseq's own batch

    def tokens(self, row: int) -> List[int]:
        return list(self._tokens[row])

    def subset_input(self, rows: List[int]) -> dict:
        width = max(self.lengths[i] for i in rows)
        toks = torch.full((len(rows), width), self.pad, dtype=torch.long)
        for j, i in enumerate(rows):
            toks[j, width - self.lengths[i]:] = torch.tensor(self._tokens[i])
        toks = toks.to(self.device)
        return {"src_tokens": toks, "src_lengths": toks.ne(self.pad).sum(1)}


class OnlineDecoder:
    """A generator's decoding loop over sources that keep arriving (see the module docstring)."""

    def __init__(self, generator):
        if getattr(generator, "scorer", None) is not None:
            raise ValueError("online decoding takes no per-sentence scorers (LMBR posteriors, token masks): "
                             "they are keyed by sentence ids of a test set")
        self.gen = generator
        generator.start_call(sys.maxsize)  # sources without end: the models read once
        device = next(generator.model.models[0].parameters()).device
        self.srcs = OnlineSources(generator.pad, device)
        self.results: Dict[int, List[Dict[str, Tensor]]] = defaultdict(list)
        self.feed = Feed(self.srcs.lengths)
        self.run = Run(generator.driver, generator.engine(self.srcs, self.results), self.feed)

    def max_len(self, n_tokens: int) -> int:
        """The length limit offline decoding gives a source of `n_tokens` tokens (EOS included)."""
        g = self.gen
        if getattr(g, "match_source_len", False):
            return n_tokens
        return source_max_len(n_tokens, g.max_len_a, g.max_len_b, g.max_len)

    def check(self, tokens: Sequence[int]) -> Optional[str]:
        """Why a source cannot be decoded (None: it can), in one line."""
        n = len(tokens)
        if n > self.gen.max_source_positions:
            return f"{n} source tokens, more than the model's {self.gen.max_source_positions} positions"
        if self.gen.min_len > self.max_len(n):
            return f"--min-len {self.gen.min_len} exceeds this source's maximum length {self.max_len(n)}"
        return None

    def add(self, tokens: Sequence[int]) -> int:
        """Queue a source (token ids with EOS); returns its row, the key of its answer."""
        why = self.check(tokens)
        if why:
            raise ValueError(why)
        row = self.srcs.add(tokens, self.max_len(len(tokens)))
        self.feed.push(row)
        return row

    def drop(self, rows: Iterable[int]) -> List[int]:
        """Rows that have not entered decoding yet leave the queue; returns those that did."""
        gone = self.feed.drop(rows)
        for row in gone:
            self.srcs.forget(row)
        return gone

    @property
    def busy(self) -> bool:
        return self.run.busy

    @property
    def waiting(self) -> int:
        return len(self.feed.waiting)

    @property
    def live_sources(self) -> int:
        return self.run.live_sources

    @property
    def live_candidates(self) -> int:
        return self.run.live_candidates

    @torch.no_grad()
    def step(self) -> Dict[int, List[Dict[str, Tensor]]]:
        """One cohort step (admitting first if the scheduler refills); the rows that finished, each
        with its hypotheses, best first."""
        t0 = time.perf_counter()
        done = self.run.step()
        out = {row: self.gen.sorted_hypotheses(self.results.pop(row)) for row in done}
        kind = getattr(self.gen, "print_alignment", None)
        for row in done:
            if kind:
                src = torch.tensor([self.srcs.tokens(row)])
                alignment.add_alignments([out[row]], src, self.gen.pad, self.gen.eos, kind)
            self.srcs.forget(row)
        c = self.gen.counters
        c.sentences += len(done)
        c.total_seconds += time.perf_counter() - t0
        return out
