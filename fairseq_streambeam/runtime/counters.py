"""Run counters (the paper's Table 5 columns) accumulated by a generator across calls."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import List, Optional, Tuple


@dataclass
class Counters:
    sentences: int = 0
    decoder_steps: int = 0  # model calls of the incremental decoder
    expansions: int = 0  # candidate rows expanded by the decoder (aggressive: block slots computed), summed over steps
    encoder_calls: int = 0
    backoff_hypotheses: int = 0  # sources that ended with no finished hypothesis and took the backoff stack's
    unscored_sources: int = 0  # sources an LMBR posteriors or token masks file has no record for
    # wall-clock seconds: model (encoder and decoder calls), of which draft (the drafter proposing
    # blocks, aggressive decoding), and total (whole generate calls)
    model_seconds: float = 0.0
    draft_seconds: float = 0.0
    total_seconds: float = 0.0
    # aggressive decoding, summed over verification passes: output tokens accepted, rows verified
    # (= passes at batch 1), and real (non-padding) block slots verified
    accepted_tokens: int = 0
    verified_rows: int = 0
    block_slots: int = 0
    # source positions the decoder rows attend to, summed over steps: real ones, and all of them
    # including padding (rows x cohort source width)
    source_positions: int = 0
    padded_positions: int = 0
    # (target length, rows, model seconds) per decoder step, kept only when set to a list
    trace: Optional[List[Tuple[int, int, float]]] = field(default=None, init=False, repr=False)

    def count_step(self, steps: int, rows: int, seconds: float, src_width: int, source_positions: int) -> None:
        """One beam step: `rows` candidates expanded in `seconds` by a cohort that had taken `steps`
        steps, over cohort source width `src_width` of which `source_positions` are real."""
        self.model_seconds += seconds
        self.decoder_steps += 1
        self.expansions += rows
        self.padded_positions += rows * src_width
        self.source_positions += source_positions
        if self.trace is not None:
            self.trace.append((steps, rows, seconds))

    @property
    def padding_share(self) -> float:
        """Beam modes: share of padding in the source positions the decoder attends to; aggressive
        decoding: share of padding among the block slots computed (rows with shorter drafts; top-1
        verification computes only the real slots, GAD++ every slot of the widest draft)."""
        if self.verified_rows:
            return 1 - self.block_slots / self.expansions if self.expansions else 0.0
        return 1 - self.source_positions / self.padded_positions if self.padded_positions else 0.0

    @property
    def expansions_per_step(self) -> float:
        return self.expansions / self.decoder_steps if self.decoder_steps else 0.0

    @property
    def accepted_per_pass(self) -> float:
        """Tokens one row gains per verification pass (the paper's tokens per iteration)."""
        return self.accepted_tokens / self.verified_rows if self.verified_rows else 0.0

    def add(self, other: Counters) -> Counters:
        """`other`'s counts added to these (e.g. the server's lanes); returns self."""
        for f in fields(self):
            if f.init:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> dict:
        """Every count under one flat name (the JSON of bench, decode_corpus and the server)."""
        d = asdict(self)
        d.pop("trace")
        d["padding_share"] = round(self.padding_share, 4)
        d["expansions_per_step"] = round(self.expansions_per_step, 2)
        d["accepted_per_pass"] = round(self.accepted_per_pass, 2)
        d["bookkeeping_seconds"] = round(max(0.0, self.total_seconds - self.model_seconds), 3)
        d["sentences_per_second"] = round(self.sentences / self.total_seconds, 2) if self.total_seconds else 0.0
        return d

    def summary(self) -> str:
        d = self.as_dict()
        if not self.decoder_steps:  # fairseq's own generator: only sentences and time are counted
            return f"{d['sentences']} sentences, {d['sentences_per_second']} sentences/s"
        accepted = f", {d['accepted_per_pass']} tokens accepted per row and pass" if d["accepted_tokens"] else ""
        unscored = f", {self.unscored_sources} without a scorer record" if self.unscored_sources else ""
        return (
            f"{d['sentences']} sentences, {d['decoder_steps']} decoder steps, {d['expansions']} expansions "
            f"({d['expansions_per_step']} per step){accepted}, {d['sentences_per_second']} sentences/s, "
            f"model {self.model_seconds:.2f}s + bookkeeping {d['bookkeeping_seconds']:.2f}s{unscored}"
        )
