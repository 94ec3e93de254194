"""Block decoder step for aggressive decoding: feed several target tokens per row in one pass over
the cached prefix, and roll rows back by masking cache slots.

fairseq adapter. fairseq's TransformerDecoder in incremental mode only processes the last token
(`prev_output_tokens[:, -1:]`) and builds no causal mask, so verifying a draft block would need one
call per token. `forward_block` runs the same embedding, layers and output projection on a block,
with per-row positions and a causal mask within the block; fairseq's MultiheadAttention appends
the block to its cached keys and keeps a key padding mask, which is how rejected draft slots and
rows of different real lengths are handled: masked slots get exactly zero attention weight.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from .cache import reorder_incremental_state
from .lean_layer import Slots, lean_layers, plain_modules, supports_lean

IncState = Dict[str, Dict[str, Optional[Tensor]]]


def block_decodable(decoder) -> bool:
    """True when rows of different lengths can share `decoder`'s cache: `forward_block` runs it
    (fairseq's transformer decoder without cross-self-attention, whose keys mix the encoder output
    into the self-attention cache) and every layer attends to the encoder, so new rows are primed
    with their encoder keys alone (`prime_encoder_keys`)."""
    from fairseq.models.transformer import TransformerDecoderBase

    return (isinstance(decoder, TransformerDecoderBase) and not getattr(decoder, "cross_self_attention", False)
            and all(getattr(layer, "encoder_attn", None) is not None for layer in decoder.layers))


def check_block_decoder(decoder) -> None:
    from fairseq.models.transformer import TransformerDecoderBase

    if not isinstance(decoder, TransformerDecoderBase):
        raise ValueError("aggressive decoding needs fairseq transformer decoders "
                         f"(TransformerDecoderBase); got {type(decoder).__name__}")
    if getattr(decoder, "cross_self_attention", False):
        raise ValueError("aggressive decoding does not support --cross-self-attention decoders")


_POSITIONS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()  # (table, version)


def _position_table(decoder, length: int, device) -> Optional[Tensor]:
    """[length, C] positional embeddings of target positions 0..length-1 (BOS is position 0).
    At inference the table is kept per decoder and grown by doubling (up to the decoder's
    max_positions), not recomputed on every pass; a learned table is recomputed after its
    weight changes."""
    emb = decoder.embed_positions
    if emb is None:
        return None
    if torch.is_grad_enabled():
        return _probe_positions(decoder, length, device)
    weight = getattr(emb, "weight", None)
    version = None if weight is None else (weight.data_ptr(), weight._version)
    hit = _POSITIONS.get(emb)
    if hit is None or hit[1] != version or hit[0].size(0) < length or hit[0].device != torch.device(device):
        size = length if hit is None else max(length, min(2 * hit[0].size(0), decoder.max_positions()))
        hit = _POSITIONS[emb] = (_probe_positions(decoder, size, device), version)
    return hit[0][:length]


def _probe_positions(decoder, length: int, device) -> Tensor:
    probe = torch.full((1, length), decoder.padding_idx + 1, dtype=torch.long, device=device)
    return decoder.embed_positions(probe)[0]


def block_attn_mask(prev: int, m: int, tail: int, dtype, device) -> Tensor:
    """Additive self-attention mask [m, prev + m] for a block appended to `prev` cached slots: every
    slot sees the whole cache; the first m - tail slots are causal among themselves and do not see
    the tail; the last `tail` slots (a drafter's mask tokens) see the whole block."""
    mask = torch.zeros(m, prev + m, dtype=dtype, device=device)
    head = m - tail
    mask[:head, prev:prev + head] = torch.triu(torch.full((head, head), -math.inf, dtype=dtype, device=device), 1)
    mask[:head, prev + head:] = -math.inf
    return mask


def forward_block(decoder, tokens: Tensor, positions: Tensor, encoder_out, state: Optional[IncState],
                  block_pad: Optional[Tensor], tail: int = 0, logits_for_tail: bool = False,
                  max_position: Optional[int] = None, slots: Optional[Slots] = None) -> Tensor:
    """Logits [N, m, V] for block `tokens` [N, m] at target positions `positions` [N, m]; appends
    the block to the cache in `state` (None: no cache, as in training). `block_pad` [N, m] marks
    padding inside the block (None: none); the last `tail` slots attend bidirectionally (block_attn_mask).
    `logits_for_tail`: project only the tail slots (logits [N, tail, V]; the vocabulary projection
    is the largest matrix product of a small model). `max_position`: the largest of `positions`
    when the caller knows it on the host (saves a device-to-host sync per call on GPUs).
    `slots` (runtime.lean_layer.Slots, the real slots of a padded block): compute only those and
    return their logits packed, [T, V] (not with `logits_for_tail`)."""
    m = tokens.size(1)
    x = decoder.embed_scale * decoder.embed_tokens(tokens)
    if decoder.quant_noise is not None:
        x = decoder.quant_noise(x)
    if decoder.project_in_dim is not None:
        x = decoder.project_in_dim(x)
    top = int(positions.max()) if max_position is None else max_position
    table = _position_table(decoder, top + 1, tokens.device)
    if table is not None:
        x = x + table[positions]
    if decoder.layernorm_embedding is not None:
        x = decoder.layernorm_embedding(x)
    x = decoder.dropout_module(x)

    prev = 0 if state is None else cached_length(decoder, state)
    mask = block_attn_mask(prev, m, tail, x.dtype, x.device) if m > 1 else None  # one slot sees every key
    enc = encoder_out["encoder_out"][0] if len(encoder_out["encoder_out"]) else None
    enc_mask = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) else None
    if slots is not None and logits_for_tail:
        raise ValueError("forward_block: slots and logits_for_tail do not combine")
    if all(supports_lean(layer) for layer in decoder.layers):
        x = lean_layers(decoder.layers, x, enc, enc_mask, state, mask, block_pad, slots)  # same math, batch-major
    else:
        x = x.transpose(0, 1)
        for layer in decoder.layers:
            x, _, _ = layer(x, enc, enc_mask, state, self_attn_mask=mask, self_attn_padding_mask=block_pad)
        x = x.transpose(0, 1)
        if slots is not None:
            x = slots.pack(x)
    if decoder.layer_norm is not None:
        x = decoder.layer_norm(x)
    if logits_for_tail:
        x = x[:, m - tail:]
    if decoder.project_out_dim is not None:
        x = decoder.project_out_dim(x)
    return output_layer(decoder, x)


# CPU adapter for the vocabulary projection. On a CPU (MKL), x @ W.T for a few rows against
# fairseq's [V, C] weight costs much more than one row, and less against a contiguous [C, V] copy
# (timings in docs/benchmarks.md). A block of 4 or more slots uses the copy; one-token passes keep
# F.linear, which is fairseq's own product. The two kernels round differently in the last bits, as
# a multi-row product already does against fairseq's one row per step.
TRANSPOSED_MIN_ROWS = 4
_TRANSPOSED: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()  # (weight, version, copy)


def output_layer(decoder, x: Tensor) -> Tensor:
    """`decoder.output_layer(x)`; on the CPU, blocks of TRANSPOSED_MIN_ROWS or more rows go through
    a transposed copy of a plain Linear vocabulary projection (see above)."""
    proj = getattr(decoder, "output_projection", None)
    if (x.device.type != "cpu" or x.numel() < TRANSPOSED_MIN_ROWS * x.size(-1) or decoder.adaptive_softmax is not None
            or proj is None or not plain_modules(proj) or torch.is_grad_enabled()):
        return decoder.output_layer(x)
    w = proj.weight
    hit = _TRANSPOSED.get(proj)
    if hit is None or hit[0] is not w or hit[1] != w._version:  # a new or updated weight
        hit = _TRANSPOSED[proj] = (w, w._version, w.detach().t().contiguous())
    flat = x.reshape(-1, x.size(-1))
    out = torch.mm(flat, hit[2]) if proj.bias is None else torch.addmm(proj.bias, flat, hit[2])
    return out.view(*x.shape[:-1], out.size(-1))


def _self_attn_modules(decoder) -> List[MultiheadAttention]:
    return [layer.self_attn for layer in decoder.layers]


def _encoder_attn_modules(decoder) -> List[MultiheadAttention]:
    return [layer.encoder_attn for layer in decoder.layers if layer.encoder_attn is not None]


def trim_encoder_slots(decoder, state: IncState) -> None:
    """Drop cached encoder-attention key columns that every row masks. Merged groups pad these
    keys to their longest source, and rows leaving do not shrink them, so a streaming group would
    attend over the longest source it ever held. One host sync: call it when rows leave."""
    mods = _encoder_attn_modules(decoder)
    buf0 = mods[0]._get_input_buffer(state) if mods else None
    if not buf0 or buf0.get("prev_key") is None or buf0.get("prev_key_padding_mask") is None:
        return
    used = ~buf0["prev_key_padding_mask"].bool().all(0)  # every layer caches the same source mask
    if bool(used.all()):
        return
    cols = used.nonzero().squeeze(1)
    for mha in mods:
        buf = mha._get_input_buffer(state)
        buf["prev_key"] = buf["prev_key"].index_select(2, cols)  # type: ignore[union-attr]
        buf["prev_value"] = buf["prev_value"].index_select(2, cols)  # type: ignore[union-attr]
        buf["prev_key_padding_mask"] = buf["prev_key_padding_mask"].index_select(1, cols)  # type: ignore[union-attr]
        mha._set_input_buffer(state, buf)


def keep_rows(decoder, state: IncState, rows: Tensor) -> None:
    """Keep rows `rows` of a block decoder's cache (rows leaving a streaming group), and the
    encoder keys that some kept row still uses (`trim_encoder_slots`). Keeping no row empties the
    cache (the last row of a group left: nothing to reorder)."""
    if rows.numel() == 0:
        state.clear()
        return
    reorder_incremental_state(decoder, state, rows)
    trim_encoder_slots(decoder, state)


def cached_length(decoder, state: IncState) -> int:
    """Physical length of the self-attention cache (0 before the first block)."""
    buf = _self_attn_modules(decoder)[0]._get_input_buffer(state)
    return 0 if not buf or buf.get("prev_key") is None else buf["prev_key"].size(2)  # type: ignore[union-attr]


def mask_slots(decoder, state: IncState, masked: Tensor) -> None:
    """Mark self-attention cache slots `masked` [N, P] as padding (roll back rejected drafts)."""
    for mha in _self_attn_modules(decoder):
        buf = mha._get_input_buffer(state)
        old = buf.get("prev_key_padding_mask")
        if old is None:
            old = torch.zeros_like(masked)
        buf["prev_key_padding_mask"] = old.bool() | masked  # fairseq stores it as float after appending
        mha._set_input_buffer(state, buf)


def roll_back(decoder, state: IncState, kept: List[int], m: int) -> None:
    """After a block of m slots, keep the first kept[i] of row i's slots and drop the rest from the
    cache. A lone row's dropped slots are the cache's tail, so they are cut off (its cache then
    never holds masked slots, and attention needs no key mask); rows of a batch mask theirs."""
    keys = _self_attn_modules(decoder)[0]._get_input_buffer(state)["prev_key"]
    length = keys.size(2)  # type: ignore[union-attr]
    if len(kept) == 1:
        truncate_slots(decoder, state, length - m + kept[0])
        return
    masked = np.zeros((len(kept), length), dtype=bool)  # built on the host: a few small arrays
    masked[:, length - m:] = np.arange(m)[None, :] >= np.asarray(kept)[:, None]
    mask_slots(decoder, state, torch.from_numpy(masked).to(keys.device))  # type: ignore[union-attr]


def compact(decoder, state: IncState, keep: Optional[int] = None) -> None:
    """Drop masked self-attention slots, keeping each row's valid slots in order (left-aligned).
    `keep`: slots to keep per row when the caller knows, on the host, a bound at least the largest
    count of valid slots of a row (saves a device-to-host sync); None counts them."""
    mods = _self_attn_modules(decoder)
    buf0 = mods[0]._get_input_buffer(state)
    mask = buf0.get("prev_key_padding_mask")
    if mask is None:
        return
    mask = mask.bool()  # fairseq stores it as float after appending a block with padding
    valid = ~mask
    keep = int(valid.sum(1).max()) if keep is None else min(keep, mask.size(1))
    order = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices[:, :keep]  # valid slots first
    new_mask = ~valid.gather(1, order)
    for mha in mods:
        buf = mha._get_input_buffer(state)
        for name in ("prev_key", "prev_value"):
            t = buf[name]
            idx = order[:, None, :, None].expand(t.size(0), t.size(1), keep, t.size(3))
            buf[name] = t.gather(2, idx)
        buf["prev_key_padding_mask"] = new_mask
        mha._set_input_buffer(state, buf)


def prime_encoder_keys(decoder, state: IncState, encoder_out) -> None:
    """Cache the encoder-attention keys and values of new rows in `state` (empty) without a
    decoder step, as fairseq's MultiheadAttention caches them at its first step (static keys,
    `prev_key` [N, H, S, d], `prev_value`, `prev_key_padding_mask` [N, S] or None). The rows have
    no self-attention slots yet, so their state can join a running cache (`cat_incremental_states`
    pads them with masked slots) and take their first step in the same decoder call as rows that
    are further along (`forward_block` with per-row positions)."""
    enc = encoder_out["encoder_out"][0]  # [S, N, C]
    enc_mask = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) else None
    s, n = enc.size(0), enc.size(1)
    for mha in _encoder_attn_modules(decoder):
        h, d = mha.num_heads, mha.head_dim
        k = mha.k_proj(enc).view(s, n, h, d).permute(1, 2, 0, 3).contiguous()
        v = mha.v_proj(enc).view(s, n, h, d).permute(1, 2, 0, 3).contiguous()
        mha._set_input_buffer(state, {"prev_key": k, "prev_value": v, "prev_key_padding_mask": enc_mask})


def truncate_slots(decoder, state: IncState, length: int) -> None:
    """Keep the first `length` self-attention cache slots of every row (drop a block's tail that
    no row keeps, e.g. a drafter's mask slots): a view, no copy."""
    for mha in _self_attn_modules(decoder):
        buf = mha._get_input_buffer(state)
        for name in ("prev_key", "prev_value"):
            buf[name] = buf[name][:, :, :length]
        mask = buf.get("prev_key_padding_mask")
        if mask is not None:
            buf["prev_key_padding_mask"] = mask[:, :length]
        mha._set_input_buffer(state, buf)
