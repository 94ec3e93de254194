"""Lean inference path of fairseq's transformer encoder: the same operations, without the wrappers.

fairseq adapter. At inference, TransformerEncoderBase runs each layer through
MultiheadAttention.forward into torch's general `F.multi_head_attention_forward` (shape checks,
mask canonicalisation, bias concatenation and chunking on every call). `encode` calls the products
that path ends in, with the same inputs in the same time-major layout (the key padding as an
additive -inf mask [B, H, 1, S] for `scaled_dot_product_attention`): its output equals fairseq's
bit for bit (tests/test_lean_encoder.py), in less time (docs/benchmarks.md); generators multiply
by repacked weights (`LeanEncoders`). Encoders with an option it does not implement
(`supports_lean_encoder`) keep fairseq's forward.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from fairseq.models.transformer import TransformerEncoderBase
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
from torch import Tensor

from .lean_layer import (
    RepackedLinears,
    applies_dropout,
    feed_forward,
    layer_modules,
    linear,
    plain_attention,
    plain_modules,
    sublayer,
)


def _layer_support(layer) -> bool:
    base = TransformerEncoderLayerBase
    return (isinstance(layer, base) and type(layer).forward is base.forward
            and type(layer).residual_connection is base.residual_connection
            and not layer.return_fc and plain_attention(layer.self_attn)
            and not getattr(layer.self_attn, "use_xformers", False)
            and not getattr(layer.self_attn, "skip_embed_dim_check", False)
            and plain_modules(*layer_modules(layer)))


def supports_lean_encoder(encoder) -> bool:
    """True when `encode` computes what fairseq's forward computes for `encoder`: a standard
    transformer encoder in inference mode, no dropout applied at inference, no quant-noise."""
    base = TransformerEncoderBase
    return (not encoder.training and isinstance(encoder, base)
            and all(getattr(type(encoder), name) is getattr(base, name)
                    for name in ("forward", "forward_scriptable", "forward_embedding"))
            and encoder.quant_noise is None and all(_layer_support(layer) for layer in encoder.layers)
            and not applies_dropout(encoder))


def encode(encoder, net_input: Dict[str, Tensor], lin=linear) -> Dict[str, List[Tensor]]:
    """`encoder.forward_torchscript(net_input)`, through the lean path when it is supported, its
    products by `lin` (`linear`: fairseq's bits; or a RepackedLinears over the modules)."""
    if not supports_lean_encoder(encoder):
        return encoder.forward_torchscript(net_input)
    src_tokens = net_input["src_tokens"]
    pad = src_tokens.eq(encoder.padding_idx)
    has_pads = bool(pad.any())  # fairseq multiplies by 1 - pad * has_pads, and passes no mask without pads
    x = embed = encoder.embed_scale * encoder.embed_tokens(src_tokens)
    if encoder.embed_positions is not None:
        x = embed + encoder.embed_positions(src_tokens)
    if encoder.layernorm_embedding is not None:
        x = encoder.layernorm_embedding(x)
    if has_pads:
        x = x * (1 - pad.unsqueeze(-1).type_as(x))
    x = x.transpose(0, 1)  # [T, B, C], as fairseq
    masks: Dict[int, Optional[Tensor]] = {}
    for layer in encoder.layers:
        heads = layer.self_attn.num_heads
        if heads not in masks:
            masks[heads] = _key_mask(pad, heads, x.dtype) if has_pads else None
        x = _layer(layer, x, masks[heads], lin)
    if encoder.layer_norm is not None:
        x = encoder.layer_norm(x)
    lengths = src_tokens.ne(encoder.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
    return {"encoder_out": [x], "encoder_padding_mask": [pad], "encoder_embedding": [embed],
            "encoder_states": [], "fc_results": [], "src_tokens": [], "src_lengths": [lengths]}


class LeanEncoders:
    """`EnsembleModel.forward_encoder` for a generator: one output per model, each through `encode`,
    its products by copies of the weights in the CPU's fastest layout in generate calls over many
    sources (RepackedLinears), as the decoder step's are."""

    def __init__(self, ensemble):
        self.ensemble = ensemble
        self.lins = [RepackedLinears(linear) for _ in ensemble.models]

    def start_call(self, n_sources: int) -> None:
        """A generate call over `n_sources` sources begins (0: fairseq's products, bit for bit)."""
        for lin in self.lins:
            lin.refresh(n_sources)

    def __call__(self, net_input: Dict[str, Tensor]) -> Optional[List[Dict[str, List[Tensor]]]]:
        if not self.ensemble.has_encoder():
            return None
        return [encode(model.encoder, net_input, lin) for model, lin in zip(self.ensemble.models, self.lins)]


def _key_mask(pad: Tensor, heads: int, dtype) -> Tensor:
    """[B, H, 1, S] additive mask, -inf at padding (what F.multi_head_attention_forward builds)."""
    b, s = pad.shape
    add = torch.zeros(b, 1, 1, s, dtype=dtype, device=pad.device).masked_fill_(pad.view(b, 1, 1, s), -math.inf)
    return add.expand(b, heads, 1, s)


def _layer(layer, x: Tensor, mask: Optional[Tensor], lin) -> Tensor:
    x = sublayer(layer.normalize_before, layer.self_attn_layer_norm, x,
                 lambda y: (_self_attention(layer.self_attn, y, mask, lin),))[0]
    return feed_forward(layer, x, lin)


def _self_attention(mha, x: Tensor, mask: Optional[Tensor], lin) -> Tensor:
    t, b, c = x.shape
    h = mha.num_heads
    d = c // h

    def heads(p: Tensor) -> Tensor:  # [T, B, C] -> [B, H, T, d], the layout torch's path gives SDPA
        return p.view(t, b * h, d).transpose(0, 1).view(b, h, t, d)

    q, k, v = heads(lin(mha.q_proj, x)), heads(lin(mha.k_proj, x)), heads(lin(mha.v_proj, x))
    out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False)
    out = out.permute(2, 0, 1, 3).contiguous().view(b * t, c)
    return lin(mha.out_proj, out).view(t, b, c)
