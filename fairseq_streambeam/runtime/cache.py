"""Decoder cache: fairseq incremental state (and encoder outputs) for one cohort of candidates.

A *cohort* is a set of live candidates whose target prefixes all have the same length. Keeping
each cohort's cache as one contiguous batch means a decoder step needs no gather/scatter copy of
the KV cache, no position patching and no left padding of self-attention keys: only fairseq's own
per-step reorder. Two cohorts that reach the same length are concatenated once (`DecoderCache.cat`),
padding only the encoder-side keys, which differ in source length.

Everything here that knows fairseq internals is in the "fairseq adapter" functions at the bottom.
"""

from __future__ import annotations

import copy
import weakref
from typing import Dict, List, Optional

import torch
from fairseq.models import FairseqIncrementalDecoder
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import EnsembleModel
from torch import Tensor

IncState = Dict[str, Dict[str, Optional[Tensor]]]
EncOut = Dict[str, List[Tensor]]


class DecoderCache:
    """Incremental decoder state of one cohort; row i belongs to the cohort's i-th live candidate.

    `encoder_outs` holds one encoder output per model with one row per *source* of the cohort;
    `row_src` maps candidate rows to those source rows. Decoders whose encoder-attention keys are
    cached in the incremental state (fairseq's transformer) only need encoder outputs at the first
    step, so they are dropped after it (see `transformer_decoders`).
    """

    def __init__(self, model: EnsembleModel, encoder_outs: Optional[List[EncOut]], keep_encoder_out: bool,
                 n_sources: int):
        self.model = model
        self.states: List[IncState] = [{} for _ in range(model.models_size)]
        self.encoder_outs = encoder_outs
        self.keep_encoder_out = keep_encoder_out
        # counted here, not read off the encoder output: its layout is the encoder's own (fairseq's
        # legacy EncoderOut tuples, LSTM tuples and custom encoders put the batch anywhere)
        self.n_sources = n_sources
        self.stepped = False

    def decoder_inputs(self, row_src: Tensor) -> Optional[List[EncOut]]:
        """Encoder outputs to hand to the decoder for candidate rows whose sources are `row_src`."""
        if self.encoder_outs is None:
            return encoder_out_stand_in(self.model, row_src.numel(), row_src.device)
        if not self.stepped and row_src.numel() == self.n_sources:
            return self.encoder_outs  # first step: one candidate per source, same order
        # a shallow copy each: fairseq's FConvEncoder.reorder_encoder_out writes the reordered
        # tensors into the dict it is given, which would turn the per-source outputs kept here
        # into per-row ones
        return self.model.reorder_encoder_out([copy.copy(e) for e in self.encoder_outs], row_src)

    def after_step(self) -> None:
        """Record that the incremental state now holds the encoder-attention keys."""
        self.stepped = True
        if not self.keep_encoder_out:
            self.encoder_outs = None

    def reorder(self, rows: Tensor, sources_moved: bool = True) -> None:
        """Keep rows `rows` (with repetition) of every buffer: follow beam back-pointers.

        Encoder-attention buffers depend only on a row's source; when every new row i belongs to
        the same source as old row i (`sources_moved=False`, e.g. fixed beams between finishes),
        their copy is skipped: it is most of the reorder cost for wide beams."""
        for m, state in zip(self.model.models, self.states):
            reorder_incremental_state(m.decoder, state, rows, reorder_encoder_attn=sources_moved)

    def select_sources(self, keep: Tensor) -> None:
        """Keep only the source rows `keep` of the stored encoder outputs (finished sources leave)."""
        self.n_sources = keep.numel()
        if self.encoder_outs is not None:
            self.encoder_outs = self.model.reorder_encoder_out(self.encoder_outs, keep)

    @staticmethod
    def cat(caches: List[DecoderCache]) -> DecoderCache:
        """Concatenate cohorts (rows and sources in the given order): of equal target length, or
        of any lengths for decoders stepped with per-row positions (`cat_incremental_states`)."""
        first = caches[0]
        out = DecoderCache(first.model, None, first.keep_encoder_out, sum(c.n_sources for c in caches))
        out.stepped = True
        assert all(c.stepped for c in caches), "only stepped cohorts are merged"
        out.states = [cat_incremental_states([c.states[i] for c in caches]) for i in range(len(first.states))]
        if first.keep_encoder_out:
            out.encoder_outs = [
                cat_encoder_outs([c.encoder_outs[i] for c in caches])  # type: ignore[index]
                for i in range(first.model.models_size)
            ]
        return out


# --------------------------------------------------------------------------------------------
# fairseq adapter: the only code here that depends on how fairseq lays out its decoder state.
# --------------------------------------------------------------------------------------------


def check_incremental(model: EnsembleModel) -> None:
    """Refuse models whose decoder cannot decode incrementally, and undo beamable attention.

    fairseq's "beamable" encoder-decoder attention (`set_beam_size(k>1)`) stores encoder keys once
    per sentence assuming exactly k rows each; variable-width beams break that assumption, so every
    attention module is reset to beam_size 1 (the default).
    """
    for m in model.models:
        if not isinstance(getattr(m, "decoder", None), FairseqIncrementalDecoder):
            raise ValueError(
                f"fairseq_streambeam needs models with an incremental decoder; got {type(m).__name__}"
            )
        for mod in m.modules():
            if isinstance(mod, MultiheadAttention) and mod.beam_size != 1:
                mod.set_beam_size(1)


def check_vocabulary(model: EnsembleModel, tgt_dict) -> None:
    """A dictionary that does not match the checkpoint's output layer gives wrong ids silently."""
    for m in model.models:
        proj = getattr(m.decoder, "output_projection", None)
        n_out = getattr(proj, "out_features", None)
        if n_out is not None and n_out != len(tgt_dict):
            raise ValueError(
                f"target dictionary has {len(tgt_dict)} entries but the model predicts {n_out}: "
                "the dictionary does not match the checkpoint"
            )


def transformer_decoders(model: EnsembleModel) -> bool:
    """True when every decoder is fairseq's transformer decoder (TransformerDecoderBase). Its
    incremental state is MultiheadAttention buffers that cache the encoder-attention keys, so
    encoder outputs are needed at the first step only, and two cohorts' caches can be merged by
    `DecoderCache.cat`. Other decoders (LSTM, fconv, custom) get their encoder outputs reordered
    every step through the model's own `reorder_encoder_out`, and their cohorts are never merged:
    streaming steps them separately, with the same output and more steps."""
    from fairseq.models.transformer import TransformerDecoderBase

    return all(isinstance(m.decoder, TransformerDecoderBase) for m in model.models)


def without_padding_mask(outs: List[EncOut]) -> List[EncOut]:
    """Encoder outputs of sources without padding, minus their (all-False) padding mask: fairseq's
    attention then builds no key mask, which is the same attention (zero is added to no score)."""
    return [{**o, "encoder_padding_mask": []} for o in outs]


def encoder_out_stand_in(model, rows: int, device: torch.device) -> List[EncOut]:
    """Zero-copy encoder outputs for a transformer decoder whose cross-attention keys are cached.

    fairseq's TransformerDecoder skips cross-attention when `encoder_out` is empty, so it must get
    a tensor; once `prev_key` is in the incremental state, MultiheadAttention(static_kv=True)
    ignores that tensor and its padding mask and uses the cached keys and mask. A stride-0 view of
    the right batch size avoids re-gathering [src_len, rows, dim] encoder states every step.
    `model` is an EnsembleModel (one output per member) or a single fairseq model. Made once per
    model, row count and device and shared (callers only read it): building it costs a few
    tensor ops per decoder step otherwise.
    """
    per_model = _STAND_INS.setdefault(model, {})
    key = (rows, str(device))
    outs = per_model.get(key)
    if outs is None:
        outs = per_model[key] = []
        for m in getattr(model, "models", [model]):
            dim = m.decoder.embed_dim if hasattr(m.decoder, "embed_dim") else 1
            dummy = torch.zeros(1, 1, dim, device=device).expand(1, rows, dim)
            outs.append({"encoder_out": [dummy], "encoder_padding_mask": [], "encoder_embedding": [],
                         "encoder_states": [], "src_tokens": [], "src_lengths": []})
    return outs


_STAND_INS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(rows, device): outputs}


def reorder_incremental_state(decoder: FairseqIncrementalDecoder, state: IncState, rows: Tensor,
                              reorder_encoder_attn: bool = True) -> None:
    """Like fairseq's `reorder_incremental_state_scripting`, but correct for variable-width beams.

    fairseq's MultiheadAttention.reorder_incremental_state returns early for encoder-decoder
    attention when the row count is unchanged (it assumes fixed beams where those rows are
    identical copies); with variable widths rows of different sources move, so its buffers are
    index-selected here (or left alone when the caller knows no row changed source). Other
    modules keep their own reorder.
    """
    for module in decoder.modules():
        if isinstance(module, MultiheadAttention):
            if module.encoder_decoder_attention and not reorder_encoder_attn:
                continue
            buf = module._get_input_buffer(state)
            if buf:
                for key, val in buf.items():
                    if val is not None:
                        buf[key] = val.index_select(0, rows)
                module._set_input_buffer(state, buf)
        elif hasattr(module, "reorder_incremental_state"):
            module.reorder_incremental_state(state, rows)


def cat_incremental_states(states: List[IncState]) -> IncState:
    """Concatenate MultiheadAttention buffers of several cohorts along the batch dimension.

    Buffers are right-padded to the longest: keys/values with zeros, the padding mask with True,
    so padded positions get exactly zero attention weight. Encoder-attention buffers differ in
    source length; self-attention buffers are equal for cohorts of one target length, and differ
    for rows at different steps (continuous order), whose attention is masked per row. An entry
    missing from a state (rows primed with their encoder keys only, `prime_encoder_keys`, have no
    self-attention slots yet) counts as no slots of that state's rows.
    """
    out: IncState = {}
    keys = list(dict.fromkeys(key for s in states for key in s))
    for key in keys:
        bufs = [s[key] if key in s else _no_slots(s, states, key) for s in states]
        if any(set(b) != set(bufs[0]) for b in bufs):
            raise ValueError(f"incremental state entry {key!r} differs between cohorts")
        merged: Dict[str, Optional[Tensor]] = {}
        kv = [b.get("prev_key") for b in bufs]
        if any(not isinstance(t, Tensor) or t.dim() != 4 for t in kv):
            raise NotImplementedError(
                "streaming needs decoders whose incremental state is fairseq MultiheadAttention "
                f"buffers; entry {key!r} is not (use --decoding beam or var-batch)"
            )
        length = max(t.size(2) for t in kv)  # type: ignore[union-attr]
        rows = [t.size(0) for t in kv]  # type: ignore[union-attr]
        for name in bufs[0]:
            ts = [b[name] for b in bufs]
            if name == "prev_key_padding_mask":
                if all(t is None for t in ts) and all(k.size(2) == length for k in kv):  # type: ignore[union-attr]
                    merged[name] = None
                    continue
                ts = [  # no mask: none of that cohort's own keys is masked (its padding up to `length` is)
                    torch.zeros(n, k.size(2), dtype=torch.bool, device=k.device) if t is None else t  # type: ignore[union-attr]
                    for n, t, k in zip(rows, ts, kv)
                ]
                merged[name] = torch.cat([_pad(t.bool(), 1, length, True) for t in ts], 0)
            elif all(isinstance(t, Tensor) and t.dim() == 4 for t in ts):
                merged[name] = torch.cat([_pad(t, 2, length, 0) for t in ts], 0)  # type: ignore[arg-type]
            else:
                raise NotImplementedError(f"cannot merge incremental state field {name!r}")
        out[key] = merged
    return out


def _no_slots(state: IncState, states: List[IncState], key: str) -> Dict[str, Optional[Tensor]]:
    """A buffer `key` with no slots for the rows of `state` (which lacks it), shaped like the
    other states' `key` buffers."""
    like = next(s[key]["prev_key"] for s in states if key in s)
    rows = {b["prev_key"].size(0) for b in state.values() if isinstance(b.get("prev_key"), Tensor)}
    if len(rows) != 1:
        raise NotImplementedError(f"incremental state entry {key!r} is missing from a state whose rows are unknown")
    empty = like.new_zeros(rows.pop(), like.size(1), 0, like.size(3))  # type: ignore[union-attr]
    return {"prev_key": empty, "prev_value": empty, "prev_key_padding_mask": None}


def cat_encoder_outs(outs: List[EncOut]) -> EncOut:
    """Concatenate fairseq transformer-style encoder outputs along the batch, padding the time axis."""
    length = max(o["encoder_out"][0].size(0) for o in outs)
    merged: EncOut = {}
    for key in outs[0]:
        items = [o[key] for o in outs]
        if all(len(x) == 0 for x in items):
            merged[key] = []
        elif key in ("encoder_out", "encoder_states"):  # [T, B, C]
            merged[key] = [torch.cat([_pad(x[j], 0, length, 0) for x in items], 1) for j in range(len(items[0]))]
        elif key == "encoder_padding_mask":  # [B, T]
            merged[key] = [torch.cat([_pad(x[0], 1, length, True) for x in items], 0)]
        elif key == "encoder_embedding":  # [B, T, C]
            merged[key] = [torch.cat([_pad(x[0], 1, length, 0) for x in items], 0)]
        elif key == "src_lengths":
            merged[key] = [torch.cat([x[0] for x in items], 0)]
        else:
            merged[key] = []  # src_tokens etc. are not read by the decoder
    return merged


def _pad(t: Tensor, dim: int, length: int, value) -> Tensor:
    if t.size(dim) == length:
        return t
    shape = list(t.shape)
    shape[dim] = length - t.size(dim)
    return torch.cat([t, t.new_full(shape, value)], dim)
