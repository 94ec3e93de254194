"""KV cache: fairseq's incremental decoder state for a set of rows, one state per ensemble member.

Rows may be at different lengths: a row's real prefix is its unmasked self-attention slots, and
masked slots get exactly zero attention weight (fairseq's key padding mask). Rows are reordered,
selected and merged (`cat` pads shorter buffers with masked slots); slots are primed, rolled back,
truncated and compacted; encoder outputs are kept for decoders that read them every step.

fairseq adapter: this module and the lean step (lean_layer.lean_layers) read and write fairseq's
incremental-state dicts (MultiheadAttention buffers `prev_key`/`prev_value` [N, H, L, d],
`prev_key_padding_mask` [N, L]); each fairseq behaviour worked around is named where it is.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from fairseq.models import FairseqIncrementalDecoder
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

IncState = Dict[str, Dict[str, Optional[Tensor]]]
EncOut = Dict[str, List[Tensor]]


class KVCache:
    """Decoder state of a set of rows for `model` (a fairseq EnsembleModel, or one fairseq model).

    `encoder_outs` holds one encoder output per member, one row per source (rows map to sources
    through the caller's `row_src`); with `per_source`, so do the cached encoder-attention keys, which
    the rows read through lean_layer.SourceGroups (row reorders leave them alone). fairseq's
    transformer decoder caches its encoder-attention keys at the first step, so `after_step` drops the
    outputs unless `keep_encoder_out` (other decoders, e.g. LSTM and fconv, read them every step).
    Between a reorder and the next step, a per-source cache's `states` hold the self-attention keys
    and values in the old row order (`pending`): only the lean step reads them as they are.
    """

    def __init__(self, model, n_sources: int, encoder_outs: Optional[List[EncOut]] = None,
                 keep_encoder_out: bool = False, per_source: bool = False):
        self.model = model
        self.per_source = per_source
        self.decoders = [m.decoder for m in getattr(model, "models", [model])]
        self.reorderers: Optional[list] = None  # per decoder, found at the first reorder (_reorderers)
        self.states: List[IncState] = [{} for _ in self.decoders]
        self.encoder_outs = encoder_outs
        self.keep_encoder_out = keep_encoder_out
        # counted here, not read off the encoder output: its layout is the encoder's own (fairseq's
        # legacy EncoderOut tuples, LSTM tuples and custom encoders put the batch anywhere)
        self.n_sources = n_sources
        self.stepped = False
        # per-source caches: the rows their self-attention keys and values have yet to follow, which
        # the next (lean) step applies in the same copy that appends its slot (`take_pending`)
        self.pending: Optional[Tensor] = None

    # ---- encoder side ----

    def decoder_inputs(self, row_src: Tensor) -> List[EncOut]:
        """Encoder outputs to hand the decoder for rows whose sources are `row_src`."""
        if self.encoder_outs is None:
            return stand_in(self.model, row_src.numel(), row_src.device)
        if not self.stepped and row_src.numel() == self.n_sources:
            return self.encoder_outs  # first step: one row per source, same order
        # a shallow copy each: fairseq's FConvEncoder.reorder_encoder_out writes the reordered
        # tensors into the dict it is given, which would turn the per-source outputs kept here
        # into per-row ones
        return self.model.reorder_encoder_out([copy.copy(e) for e in self.encoder_outs], row_src)

    def source_inputs(self, device: torch.device) -> List[EncOut]:
        """Encoder outputs for one row per source, in order (draft-and-verify's rows)."""
        return self.encoder_outs if self.encoder_outs is not None else stand_in(self.model, self.n_sources, device)

    def after_step(self) -> None:
        """The state now holds the encoder-attention keys: outputs are no longer needed."""
        self.stepped = True
        if not self.keep_encoder_out:
            self.encoder_outs = None

    def select_sources(self, keep: Tensor) -> None:
        """Keep only source rows `keep` of the stored encoder outputs, and of the encoder-attention
        keys when they are cached per source (finished sources leave)."""
        self.n_sources = keep.numel()
        if self.per_source:
            for buf in self._buffers(_encoder_attn):
                buf.update({name: None if t is None else t.index_select(0, keep) for name, t in buf.items()})
        if self.encoder_outs is not None:
            self.encoder_outs = self.model.reorder_encoder_out(self.encoder_outs, keep)

    def _buffers(self, attn=None):
        """Every non-empty MultiheadAttention buffer of the self-attention modules (`attn`: another
        module list, e.g. `_encoder_attn`), written back after the caller has changed it."""
        for dec, state in zip(self.decoders, self.states):
            for mha in (attn or _self_attn)(dec):
                buf = mha._get_input_buffer(state)
                if buf:
                    yield buf
                    mha._set_input_buffer(state, buf)

    # ---- rows ----

    def reorder(self, rows: Tensor, sources_moved: bool = True) -> None:
        """Keep rows `rows` (with repetition) of every buffer: follow beam back-pointers. With
        `sources_moved=False` (new row i has old row i's source, e.g. fixed beams between finishes)
        encoder-attention buffers are not copied, most of the reorder cost for wide beams; keys
        cached per source never are, and self-attention keys and values of such a cache wait for the
        next step (`pending`, which keeps `rows`: not to be written to afterwards)."""
        if self.per_source:
            self.pending = rows if self.pending is None else self.pending.index_select(0, rows)
        if self.reorderers is None:
            self.reorderers = [_reorderers(d) for d in self.decoders]
        for modules, state in zip(self.reorderers, self.states):
            _reorder(modules, state, rows, sources_moved and not self.per_source, not self.per_source)

    def take_pending(self) -> Optional[Tensor]:
        """The rows the self-attention keys and values still have to follow (None: none), handed to
        a step that applies them (lean_layer.lean_layers)."""
        rows, self.pending = self.pending, None
        return rows

    def flush(self) -> None:
        """Apply the pending rows to the self-attention keys and values now."""
        rows = self.take_pending()
        if rows is None:
            return
        for buf in self._buffers():
            for name in ("prev_key", "prev_value"):
                buf[name] = buf[name].index_select(0, rows)  # type: ignore[union-attr]

    def select(self, rows: Tensor) -> None:
        """Keep rows `rows` (others leave), and the encoder keys some kept row still uses
        (`trim_encoder`); no row empties the cache. For caches whose rows are their sources
        (draft-and-verify), not `per_source` ones."""
        if self.per_source:
            raise ValueError("KVCache.select: rows of a per-source cache leave by reorder and select_sources")
        if rows.numel() == 0:
            for state in self.states:
                state.clear()
            return
        self.reorder(rows)
        self.trim_encoder()

    @staticmethod
    def cat(caches: Sequence[KVCache]) -> KVCache:
        """Rows of each cache in turn. Encoder keys are padded to the longest source, and
        self-attention buffers of different lengths to the longest, with masked slots."""
        first = caches[0]
        if any(c.per_source != first.per_source for c in caches):
            raise ValueError("KVCache.cat: encoder keys cached per source and per row do not merge")
        if any(c.keep_encoder_out for c in caches):  # generators merge transformer decoders' caches only
            raise ValueError("KVCache.cat: caches of decoders that read their encoder outputs every step do not merge")
        for c in caches:
            c.flush()
        out = KVCache(first.model, sum(c.n_sources for c in caches), None, False, first.per_source)
        out.stepped = all(c.stepped for c in caches)
        out.states = [cat_states([c.states[i] for c in caches]) for i in range(len(first.states))]
        return out

    # ---- slots (transformer decoders) ----

    @property
    def built(self) -> bool:
        """Some decoder step (or `prime`) has filled the cache."""
        return bool(self.states[0])

    @property
    def length(self) -> int:
        """Physical length of the self-attention cache (0 before the first step)."""
        return cached_length(self.decoders[0], self.states[0])

    def prime(self, encoder_outs: List[EncOut]) -> None:
        """Cache new rows' encoder-attention keys without a decoder step, as fairseq's
        MultiheadAttention does at its first step. With no self-attention slots yet, this cache can
        join one whose rows are further along (`cat` pads it) and step with it (per-row positions)."""
        for dec, state, out in zip(self.decoders, self.states, encoder_outs):
            enc = out["encoder_out"][0]  # [S, N, C]
            enc_mask = out["encoder_padding_mask"][0] if len(out["encoder_padding_mask"]) else None
            s, n = enc.size(0), enc.size(1)
            for mha in _encoder_attn(dec):
                h, d = mha.num_heads, mha.head_dim
                k = mha.k_proj(enc).view(s, n, h, d).permute(1, 2, 0, 3).contiguous()
                v = mha.v_proj(enc).view(s, n, h, d).permute(1, 2, 0, 3).contiguous()
                mha._set_input_buffer(state, {"prev_key": k, "prev_value": v, "prev_key_padding_mask": enc_mask})
        self.after_step()

    def rollback(self, kept: List[int], m: int) -> None:
        """After a block of m slots, keep the first kept[i] of row i's slots: rows of a batch mask the
        others; a lone row cuts them off (its cache then never needs a key mask)."""
        length = self.length
        if len(kept) == 1:
            self.truncate(length - m + kept[0])
            return
        masked = np.zeros((len(kept), length), dtype=bool)  # built on the host: a few small arrays
        masked[:, length - m:] = np.arange(m)[None, :] >= np.asarray(kept)[:, None]
        device = _self_attn(self.decoders[0])[0]._get_input_buffer(self.states[0])["prev_key"].device  # type: ignore[union-attr]
        self.mask(torch.from_numpy(masked).to(device))

    def mask(self, masked: Tensor) -> None:
        """Mark self-attention slots `masked` [N, L] as padding."""
        for buf in self._buffers():
            old = buf.get("prev_key_padding_mask")  # fairseq stores it as float after appending
            buf["prev_key_padding_mask"] = masked if old is None else old.bool() | masked

    def truncate(self, length: int, last: bool = False) -> None:
        """Keep the first (`last`: the last) `length` self-attention slots of every row (a view)."""
        keep = slice(self.length - length, None) if last else slice(0, length)
        for buf in self._buffers():
            for name in ("prev_key", "prev_value"):
                buf[name] = buf[name][:, :, keep]
            mask = buf.get("prev_key_padding_mask")
            if mask is not None:
                buf["prev_key_padding_mask"] = mask[:, keep]

    compact_slack = 16  # masked slots tolerated beyond twice the longest row before `compact_if_sparse` compacts

    def compact_if_sparse(self, longest: int) -> None:
        """Compact once the cache holds more than twice `longest` (the longest row's real slots) plus
        `compact_slack` slots: rolled-back draft slots stay behind as masked slots until then."""
        if self.length > 2 * longest + self.compact_slack:
            self.compact()

    def compact(self) -> None:
        """Drop masked self-attention slots, keeping each row's valid slots in order (left-aligned).
        One host sync: the largest count of a row's valid slots."""
        self.flush()
        for dec, state in zip(self.decoders, self.states):
            mods = _self_attn(dec)
            mask = mods[0]._get_input_buffer(state).get("prev_key_padding_mask")
            if mask is None:
                continue
            mask = mask.bool()  # fairseq stores it as float after appending a block with padding
            n_keep = int((~mask).sum(1).max())
            order = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices[:, :n_keep]  # valid slots first
            new_mask = mask.gather(1, order)
            for mha in mods:
                buf = mha._get_input_buffer(state)
                for name in ("prev_key", "prev_value"):
                    t = buf[name]
                    buf[name] = t.gather(2, order[:, None, :, None].expand(t.size(0), t.size(1), n_keep, t.size(3)))
                buf["prev_key_padding_mask"] = new_mask
                mha._set_input_buffer(state, buf)

    def trim_encoder(self) -> None:
        """Drop cached encoder-attention key columns that every row masks. Merged cohorts pad these
        keys to their longest source, and rows leaving do not shrink them, so a streaming cohort
        would attend over the longest source it ever held. One host sync: call it when rows leave."""
        for dec, state in zip(self.decoders, self.states):
            mods = _encoder_attn(dec)
            buf0 = mods[0]._get_input_buffer(state) if mods else None
            if not buf0 or buf0.get("prev_key") is None or buf0.get("prev_key_padding_mask") is None:
                continue
            used = ~buf0["prev_key_padding_mask"].bool().all(0)  # every layer caches the same source mask
            if bool(used.all()):
                continue
            cols = used.nonzero().squeeze(1)
            for mha in mods:
                buf = mha._get_input_buffer(state)
                for name in ("prev_key", "prev_value"):
                    buf[name] = buf[name].index_select(2, cols)  # type: ignore[union-attr]
                buf["prev_key_padding_mask"] = buf["prev_key_padding_mask"].index_select(1, cols)  # type: ignore[union-attr]
                mha._set_input_buffer(state, buf)


# ---- fairseq adapter functions ----


def max_positions(models, side: int) -> int:
    """The fewest positions any of `models` takes on `side` (0: source, 1: target); 10**9 if none says."""
    best = 10**9
    for m in models:
        mp = m.max_positions() if hasattr(m, "max_positions") else None
        mp = mp[side] if isinstance(mp, tuple) else mp
        if isinstance(mp, int):
            best = min(best, mp)
    return best


def check_incremental(model) -> None:
    """Refuse models whose decoder cannot decode incrementally, and undo beamable attention:
    fairseq's "beamable" encoder-decoder attention (`set_beam_size(k>1)`) stores encoder keys once
    per sentence assuming k rows each, and fconv's BeamableMM (set by fairseq-generate unless
    --no-beamable-mm) multiplies as if every source had k rows; variable-width beams and streamed
    cohorts break that, so both are reset to their plain products."""
    from fairseq.modules import BeamableMM

    for m in model.models:
        if not isinstance(getattr(m, "decoder", None), FairseqIncrementalDecoder):
            raise ValueError(f"fairseq_streambeam needs models with an incremental decoder; got {type(m).__name__}")
        for mod in m.modules():
            if isinstance(mod, MultiheadAttention) and mod.beam_size != 1:
                mod.set_beam_size(1)
            elif isinstance(mod, BeamableMM) and mod.beam_size is not None:
                mod.set_beam_size(None)


def check_vocabulary(model, tgt_dict) -> None:
    """A dictionary that does not match the checkpoint's output layer gives wrong ids silently."""
    for m in model.models:
        proj = getattr(m.decoder, "output_projection", None)
        n_out = getattr(proj, "out_features", None)
        if n_out is not None and n_out != len(tgt_dict):
            raise ValueError(f"target dictionary has {len(tgt_dict)} entries but the model predicts {n_out}: "
                             "the dictionary does not match the checkpoint")


def transformer_decoders(model) -> bool:
    """True when every decoder is fairseq's TransformerDecoderBase: its state is MultiheadAttention
    buffers that cache the encoder-attention keys, so encoder outputs are needed at the first step
    only and caches merge by `KVCache.cat`. Other decoders get their encoder outputs reordered every
    step (the model's `reorder_encoder_out`) and their cohorts never merge (same output, more steps)."""
    from fairseq.models.transformer import TransformerDecoderBase

    return all(isinstance(m.decoder, TransformerDecoderBase) for m in model.models)


def without_padding_mask(outs: List[EncOut]) -> List[EncOut]:
    """Encoder outputs of sources without padding, minus their (all-False) padding mask: fairseq's
    attention then builds no key mask, which is the same attention (zero is added to no score)."""
    return [{**o, "encoder_padding_mask": []} for o in outs]


def stand_in(model, rows: int, device: torch.device) -> List[EncOut]:
    """Encoder outputs for transformer decoders whose cross-attention keys are cached.

    fairseq's TransformerDecoder skips cross-attention when `encoder_out` is empty, so it must get
    a tensor; once `prev_key` is in the incremental state, MultiheadAttention(static_kv=True)
    ignores that tensor and its padding mask. A stride-0 view of the right batch size avoids
    re-gathering [src_len, rows, dim] encoder states every step. `model`: as for `KVCache`."""
    outs = []
    for m in getattr(model, "models", [model]):
        dim = getattr(m.decoder, "embed_dim", 1)
        dummy = torch.zeros(1, 1, dim, device=device).expand(1, rows, dim)
        outs.append({"encoder_out": [dummy], "encoder_padding_mask": [], "encoder_embedding": [],
                     "encoder_states": [], "src_tokens": [], "src_lengths": []})
    return outs


def cached_length(decoder, state: IncState) -> int:
    """Physical length of `decoder`'s self-attention cache in `state` (0 before the first step)."""
    buf = _self_attn(decoder)[0]._get_input_buffer(state)
    return 0 if not buf or buf.get("prev_key") is None else buf["prev_key"].size(2)  # type: ignore[union-attr]


def _self_attn(decoder) -> List[MultiheadAttention]:
    return [layer.self_attn for layer in decoder.layers]


def _encoder_attn(decoder) -> List[MultiheadAttention]:
    return [layer.encoder_attn for layer in decoder.layers if getattr(layer, "encoder_attn", None) is not None]


def _reorderers(decoder: FairseqIncrementalDecoder) -> list:
    """The modules of `decoder` that hold or reorder incremental state, found once per cache: walking
    `decoder.modules()` at every step costs more host time than a small step's copies."""
    return [m for m in decoder.modules()
            if isinstance(m, MultiheadAttention) or hasattr(m, "reorder_incremental_state")]


def _reorder(modules: list, state: IncState, rows: Tensor, encoder_attn: bool, self_kv: bool) -> None:
    """Like fairseq's `reorder_incremental_state_scripting`, but correct for variable-width beams.

    fairseq's MultiheadAttention.reorder_incremental_state returns early for encoder-decoder
    attention when the row count is unchanged (assuming fixed beams of identical rows); here rows
    of different sources move, so its buffers are index-selected (unless `encoder_attn` is False;
    self-attention keys and values unless `self_kv` is False). Other modules keep their own reorder."""
    for module in modules:
        if isinstance(module, MultiheadAttention):
            if module.encoder_decoder_attention and not encoder_attn:
                continue
            buf = module._get_input_buffer(state)
            if buf:
                skip = () if self_kv or module.encoder_decoder_attention else ("prev_key", "prev_value")
                for key, val in buf.items():
                    if val is not None and key not in skip:
                        buf[key] = val.index_select(0, rows)
                module._set_input_buffer(state, buf)
        elif hasattr(module, "reorder_incremental_state"):
            module.reorder_incremental_state(state, rows)


def cat_states(states: List[IncState]) -> IncState:
    """MultiheadAttention buffers of several states, concatenated along the batch and right-padded
    to the longest (source length, or slots of rows at different steps): keys/values with zeros, the
    padding mask with True, so padded positions get exactly zero attention weight. An entry missing
    from a state (rows primed with their encoder keys only) counts as no slots of its rows."""
    out: IncState = {}
    for key in dict.fromkeys(key for s in states for key in s):
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
        for name in bufs[0]:
            ts = [b[name] for b in bufs]
            if name == "prev_key_padding_mask":
                if all(t is None for t in ts) and all(k.size(2) == length for k in kv):  # type: ignore[union-attr]
                    merged[name] = None
                    continue
                ts = [  # no mask: none of that state's own keys is masked (its padding up to `length` is)
                    torch.zeros(k.size(0), k.size(2), dtype=torch.bool, device=k.device) if t is None else t  # type: ignore[union-attr]
                    for t, k in zip(ts, kv)
                ]
                merged[name] = torch.cat([_pad(t.bool(), 1, length, True) for t in ts], 0)
            elif all(isinstance(t, Tensor) and t.dim() == 4 for t in ts):
                merged[name] = torch.cat([_pad(t, 2, length, 0) for t in ts], 0)  # type: ignore[arg-type]
            else:
                raise NotImplementedError(f"cannot merge incremental state field {name!r}")
        out[key] = merged
    return out


def _no_slots(state: IncState, states: List[IncState], key: str) -> Dict[str, Optional[Tensor]]:
    """A buffer `key` with no slots for the rows of `state` (which lacks it), shaped like others'."""
    like = next(s[key]["prev_key"] for s in states if key in s)
    rows = {b["prev_key"].size(0) for b in state.values() if isinstance(b.get("prev_key"), Tensor)}
    if len(rows) != 1:
        raise NotImplementedError(f"incremental state entry {key!r} is missing from a state whose rows are unknown")
    empty = like.new_zeros(rows.pop(), like.size(1), 0, like.size(3))  # type: ignore[union-attr]
    return {"prev_key": empty, "prev_value": empty, "prev_key_padding_mask": None}


def _pad(t: Tensor, dim: int, length: int, value) -> Tensor:
    if t.size(dim) == length:
        return t
    shape = list(t.shape)
    shape[dim] = length - t.size(dim)
    return torch.cat([t, t.new_full(shape, value)], dim)
