"""What the generators share: a window's sources, the spec they decode with, hypothesis dicts, the host copy."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import Tensor

from ..search.penalties import source_max_len
from ..spec import DecodeSpec, UsageError, unknown_problem


@dataclass
class Sources:
    """One window (fairseq batch) of sources, with per-source facts known on the host."""

    net_input: dict
    lengths: List[int]  # tokens incl. EOS: fairseq's width of a lone source
    max_lens: List[int]
    sentence_ids: List[int]
    left_pad: bool
    pad: int

    @staticmethod
    def from_sample(sample, gen) -> Sources:
        """The window's sources, with generator `gen`'s length limits (SequenceGenerator's attributes;
        --match-source-len: each source's own length, where fairseq takes the batch's longest)."""
        net_input, pad = sample["net_input"], gen.pad
        src_tokens = net_input["src_tokens"]
        if src_tokens.dim() != 2 or src_tokens.is_floating_point():  # e.g. speech features [B, T, F]
            raise UsageError("the plugin's decodings need sources of token ids [batch, length]; "
                             "use --decoding fairseq for this model")
        n_src = src_tokens.size(0)
        lengths = src_tokens.ne(pad).sum(1).tolist()
        ids = sample.get("id")
        sentence_ids = ids.tolist() if isinstance(ids, Tensor) else list(range(n_src))
        for sid, n in zip(sentence_ids, lengths):
            if n > gen.max_source_positions:
                raise UsageError(f"source {sid} has {n} tokens, more than the model's "
                                 f"{gen.max_source_positions} source positions")
        if gen.match_source_len:
            max_lens = list(lengths)  # fairseq reads net_input's src_lengths, EOS included
        else:
            max_lens = [source_max_len(n, gen.max_len_a, gen.max_len_b, gen.max_len) for n in lengths]
        if max_lens and gen.min_len > min(max_lens):
            raise UsageError(f"--min-len {gen.min_len} exceeds the maximum length {min(max_lens)} allowed by "
                             + ("--match-source-len" if gen.match_source_len else
                                "--max-len-a/--max-len-b and the model's positions"))
        left_pad = bool(src_tokens[:, 0].eq(pad).any()) if n_src else False
        return Sources(net_input, lengths, max_lens, sentence_ids, left_pad, pad)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.net_input["src_tokens"].device

    @property
    def sample_width(self) -> int:
        """Width of the batch fairseq handed over: hypotheses' attention is returned in its layout."""
        return self.net_input["src_tokens"].size(1)

    def subset_input(self, rows: List[int]) -> dict:
        """Encoder input for window rows `rows`, re-collated without the window's extra padding
        (the whole window is passed through untouched, as fairseq would encode it)."""
        if self.is_whole(rows):
            return self.net_input
        src = self.net_input["src_tokens"]
        idx = torch.tensor(rows, device=src.device)
        width = max(self.lengths[i] for i in rows)
        toks = src.index_select(0, idx)
        toks = toks[:, -width:] if self.left_pad else toks[:, :width]
        return {"src_tokens": toks, "src_lengths": toks.ne(self.pad).sum(1)}

    def is_whole(self, rows: List[int]) -> bool:
        """`rows` is the whole window in its own order (fairseq's batch as it came)."""
        return len(rows) == len(self) and all(i == r for i, r in enumerate(rows))

    def tokens(self, row: int) -> List[int]:
        """Source tokens of window row `row` (without padding, with EOS)."""
        t = self.net_input["src_tokens"][row]
        return t[t.ne(self.pad)].tolist()


def family_spec(spec: Optional[DecodeSpec], options: dict, family: str, default: str) -> DecodeSpec:
    """A generator's spec: `spec`, or one built from keyword `options` (decoding `default` unless
    given); its decoding must be of the generator's `family` (spec.DECODINGS). `stream_window` is
    refused: windows are the task's batching, and a generator decodes each sample as one window."""
    if "stream_window" in options:
        raise UsageError("stream_window= is the task's option (fairseq batches per window); a generator "
                         "decodes each sample it is given as one window: pass more sources per sample")
    if spec is None:
        problem = unknown_problem(list(options), [f.name for f in dataclasses.fields(DecodeSpec)], "a generator")
        if problem:
            raise UsageError(problem)
        spec = DecodeSpec(**{"decoding": default, **options})
    elif options:
        raise TypeError(f"pass a spec or options, not both (got {sorted(options)})")
    if spec.kind.family != family:
        raise UsageError(f"--decoding {spec.decoding} is not a {family} decoding")
    return spec


def sequence_generator_args(spec: DecodeSpec, tgt_dict) -> dict:
    """fairseq SequenceGenerator's arguments from a spec (the generators keep its attributes);
    a token to suppress that the dictionary lacks is a UsageError (fairseq's generator asserts)."""
    unknown = [w for w in spec.tokens_to_suppress if tgt_dict.index(w) == tgt_dict.unk()]
    if unknown:
        raise UsageError(f"tokens_to_suppress: {', '.join(map(repr, unknown))} not a word of the target dictionary "
                         "(or its unknown token)")
    names = ("max_len_a", "max_len_b", "max_len", "min_len", "normalize_scores", "len_penalty", "unk_penalty",
             "temperature", "eos", "symbols_to_strip_from_output", "tokens_to_suppress", "lm_weight",
             "match_source_len")
    return {"beam_size": spec.beam, **{n: getattr(spec, n) for n in names}}


def hypothesis(tokens: Tensor, score: Tensor, positional_scores: Tensor,
               attention: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """A hypothesis as fairseq's generator returns it (tokens end with EOS)."""
    return {"tokens": tokens, "score": score, "attention": torch.empty(0) if attention is None else attention,
            "alignment": torch.empty(0), "positional_scores": positional_scores}


def empty_hypothesis(eos: int, device) -> Dict[str, Tensor]:
    """Defined output for a source whose every candidate was invalid (e.g. all -inf)."""
    return hypothesis(torch.tensor([eos], device=device), torch.tensor(-math.inf, device=device),
                      torch.tensor([-math.inf], device=device))


def to_host(**parts: Tensor) -> Dict[str, np.ndarray]:
    """Several tensors brought to the host in one copy (one synchronization on CUDA), by name, in
    their own shapes: bools and integers travel as int64, floats as the bits of their float32 or
    float64 value (exact; half precision comes back as float32)."""
    parts = {k: t.float() if t.is_floating_point() and t.dtype not in _BITS else t for k, t in parts.items()}
    flat = [(t.contiguous().view(_BITS[t.dtype][0]) if t.is_floating_point() else t).reshape(-1).long()
            for t in parts.values()]
    host = torch.cat(flat).cpu().numpy()
    out, i = {}, 0
    for name, t in parts.items():
        chunk, i = host[i:i + t.numel()], i + t.numel()
        if t.is_floating_point():
            chunk = chunk.astype(_BITS[t.dtype][1]).view(_BITS[t.dtype][2])
        elif t.dtype == torch.bool:
            chunk = chunk.astype(bool)
        out[name] = chunk.reshape(tuple(t.shape))
    return out


_BITS = {torch.float32: (torch.int32, np.int32, np.float32), torch.float64: (torch.int64, np.int64, np.float64)}
