"""Lean inference path of fairseq's transformer decoder layer, for block decoding.

fairseq adapter. In incremental mode, TransformerDecoderLayerBase and MultiheadAttention do
general-purpose bookkeeping on every call (time-major reshapes and asserts, the key padding mask
converted to float and concatenated again, head-averaged cross-attention weights requested by
`need_attn`): a large share of a pass for the small blocks of aggressive decoding at small batch
sizes (docs/benchmarks.md). `lean_layers` computes the same inference math from the layer's own
modules, batch-major, in fairseq's cache layout (so every KVCache method works on either
path), with the attention masks built once per block, and the products F.linear runs and
F.layer_norm on the modules' weights (`plain_linear` over `plain_layer`'s attributes, `linear`
over modules, `norm`: Module.__call__ costs microseconds, tens of calls per pass). Layers with an
option it does not implement (`lean_supported`) keep fairseq's own forward.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import Tensor, nn

from .fused_attention import attention
from .kv_cache import IncState


def plain_attention(mha: Optional[MultiheadAttention]) -> bool:
    if mha is None:
        return True
    return (type(mha).forward is MultiheadAttention.forward
            and type(mha).apply_sparse_mask is MultiheadAttention.apply_sparse_mask
            and mha.bias_k is None and mha.bias_v is None and not mha.add_zero_attn
            and not mha.onnx_trace and mha.beam_size == 1)


def plain_modules(*modules) -> bool:
    """True when each module is exactly torch's Linear or LayerNorm (or None) with no hooks, so
    `linear` and `norm` compute what calling it computes (quant-noise, for one, works by a hook)."""
    return all(m is None or (type(m) in (nn.Linear, nn.LayerNorm) and not m._forward_hooks
                             and not m._forward_pre_hooks) for m in modules)


def linear(module: nn.Linear, x: Tensor) -> Tensor:
    """`module(x)` for a `plain_modules` Linear, without Module.__call__."""
    return F.linear(x, module.weight, module.bias)


def plain_linear(module: SimpleNamespace, x: Tensor) -> Tensor:
    """`linear` for a `plain_projection`: the addmm (mm without bias) F.linear runs, over the weight's
    transposed view taken once per call, so the same product with fewer operators dispatched (F.linear
    transposes the weight at every call; docs/benchmarks.md, "Host work per step")."""
    return _product(x, module.weight_t, module.bias)


def _product(x: Tensor, wt: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x @ wt (+ bias) over the last dimension of `x`, as F.linear(x, wt.t(), bias) computes it: the
    one 2-D addmm (mm) it runs for 2-D and contiguous 3-D input; F.linear itself for other input."""
    if x.dim() == 2:
        return torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)
    if x.dim() != 3 or not x.is_contiguous():
        return F.linear(x, wt.t(), bias)
    y = _product(x.view(-1, x.size(2)), wt, bias)
    return y.view(x.size(0), x.size(1), wt.size(1))


def plain_projection(m: nn.Linear) -> SimpleNamespace:
    """A Linear's parameters as plain attributes, with the weight's transposed view (plain_linear)."""
    return SimpleNamespace(weight=m.weight, bias=m.bias, weight_t=m.weight.t())


class RepackedLinears:
    """`fallback` (`plain_linear` over plain projections, `linear` over modules) computed by copies
    of the weights in the layout a CPU multiplies fastest: oneDNN's packed layout for float32, else
    the weight transposed ([in, out], contiguous, for MKL); faster than fairseq's products for a
    step's rows and an encoder's tokens (docs/benchmarks.md, "What the engine's parts save"). The
    products round otherwise than fairseq's, in a score's last float32 bits.

    The copies are dropped by `refresh`, which generators call at the start of each generate call:
    weights may change between calls in ways a tensor does not record (fairseq's optimizers write
    `param.data`). Copying costs a pass over the weights, which pays back over many sources only,
    so a call over fewer than `MIN_SOURCES` sources (the hub's, a few sentences) keeps `fallback`."""

    MIN_SOURCES = 16

    def __init__(self, fallback=plain_linear):
        self._copies: Dict[int, tuple] = {}
        self.active = False
        self.fallback = fallback
        # float32 copies in oneDNN's layout where this torch build has its linear (else transposed)
        self.onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    def refresh(self, n_sources: int) -> None:
        """Forget the copies; the next call decodes `n_sources` sources."""
        self._copies.clear()
        self.active = n_sources >= self.MIN_SOURCES

    def __call__(self, module, x: Tensor) -> Tensor:
        w = module.weight
        if not self.active or not x.is_cpu or torch.is_grad_enabled():
            return self.fallback(module, x)
        copy = self._copies.get(id(module))
        if copy is None or copy[0] is not w:
            onednn = w.dtype == torch.float32 and self.onednn and torch.backends.mkldnn.enabled
            w_copy = torch.ops.mkldnn._reorder_linear_weight(w.detach()) if onednn else w.detach().t().contiguous()
            copy = self._copies[id(module)] = (w, w_copy)
        if copy[1].is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, copy[1], module.bias, "none", [], "")
        return _product(x, copy[1], module.bias)


def norm(module: nn.LayerNorm, x: Tensor) -> Tensor:
    """`module(x)` for a `plain_modules` LayerNorm, without Module.__call__."""
    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def layer_modules(layer) -> tuple:
    """The projections and layer norms a lean encoder or decoder layer calls."""
    attn = [layer.self_attn]
    if getattr(layer, "encoder_attn", None) is not None:
        attn.append(layer.encoder_attn)
    projections = [getattr(mha, name) for mha in attn for name in ("q_proj", "k_proj", "v_proj", "out_proj")]
    norms = [getattr(layer, name, None) for name in ("self_attn_layer_norm", "encoder_attn_layer_norm",
                                                     "final_layer_norm")]
    return (*projections, layer.fc1, layer.fc2, *norms)


def lean_supported(layer) -> bool:
    """True when `lean_layers` computes what fairseq's forward computes for `layer` in inference
    mode: a standard decoder layer, with no dropout applied at inference (`--retain-dropout`)."""
    base = TransformerDecoderLayerBase
    return (isinstance(layer, base) and type(layer).forward is base.forward
            and type(layer).residual_connection is base.residual_connection
            and not layer.cross_self_attention
            and all(getattr(layer, name, None) is None for name in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"))
            and layer.self_attn.self_attention and plain_attention(layer.self_attn)
            and (layer.encoder_attn is None or layer.encoder_attn.encoder_decoder_attention)
            and plain_attention(layer.encoder_attn) and plain_modules(*layer_modules(layer))
            and not applies_dropout(layer))


def plain_layer(layer) -> SimpleNamespace:
    """What `LayerMath` reads of a `lean_supported` decoder layer, as plain attributes. nn.Module
    finds submodules and parameters in `__getattr__`: about 150 lookups a step, more host time than
    a small step's math (docs/benchmarks.md, "What the engine's parts save"). It holds the layer's
    own parameter objects and views of their data (`plain_projection`): take it afresh for each
    generate call (BlockDecoder.start_call), as a module may be given a new parameter, or new data
    (model.half(), .to(device)), between calls."""
    def ln(m):
        return None if m is None else SimpleNamespace(normalized_shape=m.normalized_shape, weight=m.weight,
                                                      bias=m.bias, eps=m.eps)

    def attention(m):
        return None if m is None else SimpleNamespace(
            q_proj=plain_projection(m.q_proj), k_proj=plain_projection(m.k_proj),
            v_proj=plain_projection(m.v_proj), out_proj=plain_projection(m.out_proj),
            num_heads=m.num_heads, head_dim=m.head_dim, scaling=m.scaling)

    return SimpleNamespace(
        self_attn=attention(layer.self_attn), encoder_attn=attention(layer.encoder_attn),
        self_attn_layer_norm=ln(layer.self_attn_layer_norm),
        encoder_attn_layer_norm=ln(getattr(layer, "encoder_attn_layer_norm", None)),
        final_layer_norm=ln(layer.final_layer_norm), fc1=plain_projection(layer.fc1), fc2=plain_projection(layer.fc2),
        activation_fn=layer.activation_fn, normalize_before=layer.normalize_before)


def applies_dropout(module: torch.nn.Module) -> bool:
    """True when some FairseqDropout inside `module` drops at inference (`--retain-dropout`)."""
    return any(isinstance(m, FairseqDropout) and m.p > 0 and m.apply_during_inference for m in module.modules())


class Slots:
    """The real (non-padding) slots of a block [N, m], as flat indices `index` [T] into N*m: the
    per-slot products (projections, feed-forward, layer norms) run on these T rows only, and
    attention sees them scattered back into the block, with zeros at padding (masked keys)."""

    def __init__(self, index: Tensor, n: int, m: int):
        self.index, self.n, self.m = index, n, m

    @classmethod
    def real(cls, pad: Tensor, device=None) -> Slots:
        """The slots of a block whose padding mask is `pad` [N, m] (best given on the host, so
        finding them costs no device sync), indices moved to `device`."""
        n, m = pad.shape
        return cls((~pad).view(-1).nonzero().squeeze(1).to(device or pad.device), n, m)

    def pack(self, x: Tensor) -> Tensor:
        """[N, m, C] or [N * m, C] -> [T, C]."""
        return (x if x.dim() == 2 else x.reshape(self.n * self.m, x.size(-1))).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """[T, C] -> [N * m, C], zeros at padding."""
        return x.new_zeros(self.n * self.m, x.size(-1)).index_copy_(0, self.index, x)


class SourceGroups:
    """Rows grouped by source, for cross-attention over keys cached once per source: row i (of N,
    sorted by source, at most `width` rows a source) sits at slot `pos[i]` of an [S, width] grid.
    Each source's rows then attend over its keys in one batched product, and no key or value is
    copied per row (beam rows of one source share them; CTranslate2 does the same).
    `pos` is None when the grid is full and in row order (fixed beams: row i is slot i)."""

    def __init__(self, pos: Optional[Tensor], n_sources: int, width: int):
        self.pos, self.n_sources, self.width = pos, n_sources, width

    @classmethod
    def of_rows(cls, row_src: Tensor, row_src_h, n_sources: int) -> SourceGroups:
        """Groups of rows whose (cohort-local) sources are `row_src` [N] on the device, with the same
        sources on the host in `row_src_h` (a sorted numpy array): the width and whether the grid is
        full are read on the host, and the slots computed on the device (no host sync)."""
        n = len(row_src_h)
        if n and (row_src_h[1:] < row_src_h[:-1]).any():
            raise ValueError("SourceGroups: rows must be sorted by source")
        width = int(np.bincount(row_src_h, minlength=n_sources).max()) if n else 1
        if n == n_sources * width:
            return cls(None, n_sources, width)
        counts = torch.zeros(n_sources, dtype=torch.long, device=row_src.device)
        counts.scatter_add_(0, row_src, torch.ones_like(row_src))
        first = torch.cumsum(counts, 0) - counts  # each source's first row
        rank = torch.arange(n, device=row_src.device) - first.index_select(0, row_src)
        return cls(row_src * width + rank, n_sources, width)

    def spread(self, x: Tensor, m: int) -> Tensor:
        """Rows [N * m, C] (m slots a row) -> [S, width * m, C], zeros at empty slots."""
        c = x.size(-1)
        if self.pos is not None:
            x = x.new_zeros(self.n_sources * self.width, m * c).index_copy_(0, self.pos, x.view(-1, m * c))
        return x.view(self.n_sources, self.width * m, c)

    def collect(self, x: Tensor, m: int) -> Tensor:
        """[S * width * m, C] -> rows [N * m, C]."""
        if self.pos is None:
            return x
        c = x.size(-1)
        return x.view(self.n_sources * self.width, m * c).index_select(0, self.pos).view(-1, c)


def lean_layers(layers, x: Tensor, enc: Optional[Tensor], enc_mask: Optional[Tensor], state: Optional[IncState],
                attn_mask: Optional[Tensor], pad_mask: Optional[Tensor], slots: Optional[Slots] = None,
                groups: Optional[SourceGroups] = None, layer_math=None, rows: Optional[Tensor] = None) -> Tensor:
    """The decoder layers on block `x` [N, m, C] (batch-major). `enc` [S, N, C] and `enc_mask`
    [N, S] are read while the cross-attention keys are not cached yet (`enc` None: no encoder
    output, so no cross-attention, as in fairseq); `attn_mask` [m, L] is additive over cache +
    block slots (None: all zeros); `pad_mask` [N, m] marks padding in the block (None: none).
    With `slots`, only the real slots are computed and the result is packed [T, C] (padding's
    cached keys and values are masked, so left zero). With `groups`, the cached cross-attention
    keys hold one row per source. `rows`: the cached rows the block's rows continue
    (KVCache.take_pending; None: row i continues row i). The cache is read into tensors for
    `layer_math` (default `LayerMath(layers)`; runtime.compiled gives a compiled one) and written
    back; every layer's cache holds the same key padding mask, so the masks are read from the
    first layer's."""
    n = x.size(0)
    if slots is not None and groups is not None:
        raise ValueError("lean_layers: slots and groups do not combine")
    selfs = [layer.self_attn for layer in layers]
    crosses = [layer.encoder_attn for layer in layers]
    bufs = [mha._get_input_buffer(state) if state is not None else {} for mha in selfs]
    cbufs = [{} if mha is None or state is None else mha._get_input_buffer(state) for mha in crosses]
    prev_k = [b.get("prev_key") for b in bufs]
    key_mask = pad_mask
    prev = bufs[0].get("prev_key_padding_mask") if prev_k[0] is not None else None
    if prev is not None or (pad_mask is not None and prev_k[0] is not None):
        if prev is None:
            prev = torch.zeros(n, prev_k[0].size(2), dtype=torch.bool, device=x.device)
        if pad_mask is None:
            pad_mask = torch.zeros(n, x.size(1), dtype=torch.bool, device=x.device)
        key_mask = torch.cat([prev.to(torch.bool), pad_mask], 1)
    cross_k = [b.get("prev_key") for b in cbufs]
    cross_mask = None
    if crosses[0] is not None and enc is not None:
        cross_mask = cbufs[0].get("prev_key_padding_mask") if cross_k[0] is not None else enc_mask
    pos, n_sources, width = (groups.pos, groups.n_sources, groups.width) if groups is not None else (None, 0, 0)
    # `enc` is read only where keys are not cached: otherwise it is a stand-in (kv_cache.stand_in)
    attends = enc is not None
    enc = enc if attends and any(k is None for k, mha in zip(cross_k, crosses) if mha is not None) else None
    x, ks, vs, cks, cvs = (layer_math or LayerMath(layers))(
        x, prev_k, [b.get("prev_value") for b in bufs], key_mask, attn_mask, attends, cross_k,
        [b.get("prev_value") for b in cbufs], cross_mask, enc, None if slots is None else slots.index,
        pos, n_sources, width, rows)
    if state is not None:
        for mha, buf, k, v in zip(selfs, bufs, ks, vs):
            buf["prev_key"], buf["prev_value"], buf["prev_key_padding_mask"] = k, v, key_mask
            mha._set_input_buffer(state, buf)
        for mha, buf, old, k, v in zip(crosses, cbufs, cross_k, cks, cvs):
            if mha is not None and old is None and k is not None:  # computed from `enc` by this block
                buf["prev_key"], buf["prev_value"], buf["prev_key_padding_mask"] = k, v, enc_mask
                mha._set_input_buffer(state, buf)
    return x


class LayerMath:
    """The decoder layers' math on tensors only, so `torch.compile` can trace it whole
    (runtime.compiled). Returns the block's output, each layer's self-attention keys and values
    with the block appended, and its cross-attention keys and values (computed from `enc` where
    not cached). `attends`: an encoder output was given (fairseq skips cross-attention without one);
    `rows`: as for `lean_layers`; `writes`: per layer, SlotWrites of its keys and values (static
    shapes: the block's slot is written into a buffer of fixed capacity, not appended)."""

    def __init__(self, layers, lin=linear, products=attention):
        self.layers = layers
        self.lin = lin  # `linear` (modules), `plain_linear` (plain_layer's), or a RepackedLinears
        self.products = products  # fused_attention.attention, or a FusedAttention

    def __call__(self, x: Tensor, prev_k: List[Optional[Tensor]], prev_v: List[Optional[Tensor]],
                 key_mask: Optional[Tensor], attn_mask: Optional[Tensor], attends: bool,
                 cross_k: List[Optional[Tensor]], cross_v: List[Optional[Tensor]], cross_mask: Optional[Tensor],
                 enc: Optional[Tensor], slot_index: Optional[Tensor], pos: Optional[Tensor], n_sources: int,
                 width: int, rows: Optional[Tensor] = None, writes: Optional[list] = None):
        n, m = x.size(0), x.size(1)
        slots = None if slot_index is None else Slots(slot_index, n, m)
        groups = None if width == 0 else SourceGroups(pos, n_sources, width)
        # per-slot rows [N * m, C] (or the real slots [T, C]): 2-D products dispatch fewer views
        x = x.reshape(n * m, x.size(2)) if slots is None else slots.pack(x)
        masks: Dict[tuple, Optional[Tensor]] = {}  # additive masks by (kind, heads): layers may differ in heads
        ks, vs, cks, cvs = [], [], [], []
        for i, (layer, pk, pv, ck, cv) in enumerate(zip(self.layers, prev_k, prev_v, cross_k, cross_v)):
            heads = layer.self_attn.num_heads
            if ("self", heads) not in masks:
                masks["self", heads] = _additive(key_mask, attn_mask, heads, x.dtype)
            cross_add = None
            if layer.encoder_attn is not None and cross_mask is not None:
                heads = layer.encoder_attn.num_heads
                if ("cross", heads) not in masks:
                    masks["cross", heads] = _additive(cross_mask, None, heads, x.dtype)
                cross_add = masks["cross", heads]
            x, k, v, ck, cv = _layer(layer, x, n, m, attends, enc, pk, pv, rows,
                                     masks["self", layer.self_attn.num_heads], ck, cv, cross_add, slots, groups,
                                     self.lin, None if writes is None else writes[i], self.products)
            ks.append(k)
            vs.append(v)
            cks.append(ck)
            cvs.append(cv)
        return (x.view(n, m, x.size(1)) if slots is None else x), ks, vs, cks, cvs


def _additive(key_mask: Optional[Tensor], attn_mask: Optional[Tensor], heads: int, dtype) -> Optional[Tensor]:
    """[N*H, m or 1, L] additive mask: -inf at masked keys, plus `attn_mask` [m, L]; without key
    mask, `attn_mask` alone as [1, m, L] (broadcast over rows and heads), or None."""
    if key_mask is None:
        return None if attn_mask is None else attn_mask.unsqueeze(0)
    n, length = key_mask.shape
    add = torch.zeros(n, 1, 1, length, dtype=dtype, device=key_mask.device)
    add.masked_fill_(key_mask.to(torch.bool)[:, None, None, :], -math.inf)
    if attn_mask is not None:
        add = add + attn_mask
    return add.expand(n, heads, add.size(2), length).reshape(n * heads, add.size(2), length)


def _layer(layer, x: Tensor, n: int, m: int, attends: bool, enc: Optional[Tensor], prev_k: Optional[Tensor],
           prev_v: Optional[Tensor], rows: Optional[Tensor], self_add: Optional[Tensor], cross_k: Optional[Tensor],
           cross_v: Optional[Tensor], cross_add: Optional[Tensor], slots: Optional[Slots],
           groups: Optional[SourceGroups], lin=linear, write: Optional[tuple] = None, products=attention):
    """One decoder layer on the block's slots `x` [N * m, C] (packed: [T, C])."""
    pre = layer.normalize_before
    x, k, v = sublayer(pre, layer.self_attn_layer_norm, x, lambda y: _self_attention(
        layer.self_attn, y, n, m, prev_k, prev_v, rows, self_add, slots, lin, write, products))
    if layer.encoder_attn is not None and attends:  # as fairseq: no encoder output, no cross-attention
        x, cross_k, cross_v = sublayer(pre, layer.encoder_attn_layer_norm, x, lambda y: _cross_attention(
            layer.encoder_attn, y, n, m, enc, cross_k, cross_v, cross_add, slots, groups, lin, products))
    return feed_forward(layer, x, lin), k, v, cross_k, cross_v


def sublayer(pre: bool, ln: nn.LayerNorm, x: Tensor, f) -> tuple:
    """x plus `f`'s first output, with layer norm `ln` on f's input (`pre`: normalize_before) or
    on the sum, in fairseq's order of operations; then f's other outputs."""
    out, *rest = f(norm(ln, x) if pre else x)
    x = x + out
    return (x if pre else norm(ln, x), *rest)


def feed_forward(layer, x: Tensor, lin=linear) -> Tensor:
    """The feed-forward sublayer of a fairseq encoder or decoder layer, with its residual and its
    layer norm (sublayer)."""
    return sublayer(layer.normalize_before, layer.final_layer_norm, x,
                    lambda y: (lin(layer.fc2, layer.activation_fn(lin(layer.fc1, y))),))[0]


def _attend(q: Tensor, k: Tensor, v: Tensor, add: Optional[Tensor], n: int, m: int, products=attention) -> Tensor:
    """Scaled queries [N * m, H*d] (m slots a row) over cached keys/values [N, H, L, d] by
    `products` (fused_attention.attention or a FusedAttention). Returns [N * m, H*d]; one slot a
    row needs no transposes."""
    h, length, d = k.size(1), k.size(2), k.size(3)
    q3 = q.view(n * h, 1, d) if m == 1 else q.view(n, m, h, d).transpose(1, 2).reshape(n * h, m, d)
    k3 = k.reshape(n * h, length, d)  # a view for the cache layout (heads of a row adjacent)
    v3 = v.reshape(n * h, length, d)
    out = products(q3, k3, v3, add)
    return out.view(n, h * d) if m == 1 else out.view(n, h, m, d).transpose(1, 2).reshape(n * m, h * d)


def _block(x: Tensor, slots: Optional[Slots]) -> Tensor:
    """Per-slot rows [N * m, C] for attention, zeros at padding (unchanged when not packed)."""
    return x if slots is None else slots.unpack(x)


def _self_attention(mha: MultiheadAttention, x: Tensor, n: int, m: int, prev_k: Optional[Tensor],
                    prev_v: Optional[Tensor], rows: Optional[Tensor], add: Optional[Tensor], slots: Optional[Slots],
                    lin=linear, write: Optional[tuple] = None, products=attention):
    """Attention output, and the keys and values with the block appended to `prev_k`/`prev_v`
    (rows `rows` of them, when given), or written at their slot (`write`: two SlotWrites)."""
    h, d = mha.num_heads, mha.head_dim
    q = _block(lin(mha.q_proj, x) * mha.scaling, slots)
    k = _block(lin(mha.k_proj, x), slots).view(n, m, h, d).transpose(1, 2)
    v = _block(lin(mha.v_proj, x), slots).view(n, m, h, d).transpose(1, 2)
    if write is not None:
        k, v = write[0](prev_k, k, rows), write[1](prev_v, v, rows)
    elif prev_k is not None:
        k = _append(prev_k, k, rows)
        v = _append(prev_v, v, rows)  # type: ignore[arg-type]
    return lin(mha.out_proj, _packed(_attend(q, k, v, add, n, m, products), slots)), k, v


FUSED_APPEND_MIN = 1 << 16  # cached elements from which a reorder and an append share one copy (`_append`)


def _append(prev: Tensor, new: Tensor, rows: Optional[Tensor]) -> Tensor:
    """`new` [N, H, m, d] appended to cached slots `prev` [*, H, L, d] (rows `rows` of them): one
    copy of a large cache, where reordering and appending apart would copy it twice. A small
    cache is copied twice: the strided write costs more host time than the second copy saves
    (CPU crossover about 100K elements; docs/benchmarks.md, "Host work per step")."""
    if rows is None:
        return torch.cat([prev, new], dim=2)
    # inductor fuses the pair itself (and a size test would guard its graph); out= has no grad
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or prev.numel() < FUSED_APPEND_MIN:
        return torch.cat([prev.index_select(0, rows), new], dim=2)
    length = prev.size(2)
    out = new.new_empty(new.size(0), new.size(1), length + new.size(2), new.size(3))
    torch.index_select(prev, 0, rows, out=out[:, :, :length])
    out[:, :, length:] = new
    return out


class SlotWrite:
    """A one-slot block's keys (or values) written into `out` [N, H, L, d], a buffer of fixed
    capacity, at slot `slot` (a one-element long tensor), after the cached slots follow `rows`
    (read from `prev`, another buffer, or `out` itself): the static shapes runtime.graph_step
    replays. Slots after `slot` hold stale values, which the key mask hides."""

    def __init__(self, out: Tensor, slot: Tensor):
        self.out, self.slot = out, slot

    def __call__(self, prev: Tensor, new: Tensor, rows: Optional[Tensor]) -> Tensor:
        if rows is not None:
            self.out.copy_(prev.index_select(0, rows))
        elif prev is not self.out:
            self.out.copy_(prev)
        return self.out.index_copy_(2, self.slot, new)


def _packed(x: Tensor, slots: Optional[Slots]) -> Tensor:
    """Attention output back to the packed rows (unchanged when not packed)."""
    return x if slots is None else slots.pack(x)


def _cross_attention(mha: MultiheadAttention, x: Tensor, n: int, m: int, enc: Optional[Tensor], k: Optional[Tensor],
                     v: Optional[Tensor], add: Optional[Tensor], slots: Optional[Slots],
                     groups: Optional[SourceGroups], lin=linear, products=attention):
    """Attention over the cached encoder keys `k`/`v`, else over keys computed from `enc`; with
    `groups`, keys cached per source. Returns the output and the keys and values."""
    q = _block(lin(mha.q_proj, x) * mha.scaling, slots)
    h, d = mha.num_heads, mha.head_dim
    if groups is not None:
        out = _attend(groups.spread(q, m), k, v, add, groups.n_sources, groups.width * m,  # type: ignore[arg-type]
                      products)
        return lin(mha.out_proj, groups.collect(out, m)), k, v
    if k is None:
        assert enc is not None
        s = enc.size(0)
        k = lin(mha.k_proj, enc).view(s, n, h, d).permute(1, 2, 0, 3).contiguous()  # [S, N, C] -> [N, H, S, d]
        v = lin(mha.v_proj, enc).view(s, n, h, d).permute(1, 2, 0, 3).contiguous()
    return lin(mha.out_proj, _packed(_attend(q, k, v, add, n, m, products), slots)), k, v  # type: ignore[arg-type]
