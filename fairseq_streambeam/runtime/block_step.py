"""Block decoder step: several target tokens per row, each row at its own positions, in one pass
over the cached prefix (draft verification, drafters, and beam rows at different steps).

fairseq adapter. fairseq's TransformerDecoder in incremental mode only processes the last token
(`prev_output_tokens[:, -1:]`) and builds no causal mask, so a draft block would take one call per
token. `BlockDecoder` runs the same embedding, layers and output projection on a block, with per-row
positions and a causal mask within it; rejected draft slots and rows of different lengths are masked
in the key padding mask (exactly zero attention weight).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from .compiled import CompiledLayerMath
from .fused_attention import FusedAttention, attention
from .graph_step import GraphStep
from .kv_cache import IncState, cached_length
from .lean_layer import (
    LayerMath,
    RepackedLinears,
    Slots,
    SourceGroups,
    lean_layers,
    lean_supported,
    plain_layer,
    plain_linear,
    plain_modules,
    plain_projection,
)


def block_decodable(decoder) -> bool:
    """True when rows of different lengths can share `decoder`'s cache: `BlockDecoder` runs it
    (fairseq's transformer decoder without cross-self-attention, whose keys mix the encoder output
    into the self-attention cache) and every layer attends to the encoder, so new rows are primed
    with their encoder keys alone (`KVCache.prime`)."""
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


class BlockDecoder:
    """A block of tokens per row through one fairseq transformer decoder. It keeps the positional
    embeddings of target positions 0..n-1 (grown by doubling up to max_positions; recomputed after
    a learned table's weight changes), and whether its layers take the lean path (runtime.lean_layer)
    and, with `compile`, run compiled on the CPU (runtime.compiled) or replay one-slot steps as
    CUDA graphs on CUDA (runtime.graph_step; with `draft_blocks`, blocks of any width over caches
    of one row per source, as draft verification's, too). `repacked`: the lean layers and the
    output projection multiply by copies of the weights in the CPU's fastest layout in generate
    calls over many sources (RepackedLinears; with `compile` the output projection only: the
    compiled layers take inductor's products), and attend by the fused kernel in those calls
    (runtime.fused_attention)."""

    def __init__(self, decoder, compile: bool = False, repacked: bool = False, draft_blocks: bool = False):
        from fairseq.models.transformer import TransformerDecoderBase

        self.decoder = decoder
        self.lean = all(lean_supported(layer) for layer in decoder.layers)
        lin = RepackedLinears() if repacked and self.lean else None
        self.repacked = lin
        # the CPU attention kernel (built on first use), for a decoder on the CPU when it is built
        self.fused = FusedAttention.load() if lin is not None and decoder.embed_tokens.weight.is_cpu else None
        self.compiled = CompiledLayerMath(decoder.layers) if compile and self.lean else None
        self.call_math: Optional[LayerMath] = None  # the eager lean math of this generate call (start_call)
        # the output projection through `lin` (plain_linear without it), where fairseq's output_layer
        # is the plain projection; its plain_projection is taken in each generate call (start_call)
        self.plain_output = (type(decoder).output_layer is TransformerDecoderBase.output_layer
                             and decoder.adaptive_softmax is None and plain_modules(decoder.output_projection))
        self.project = lin or plain_linear
        self.call_projection = None
        # with `compile`, one-slot steps over per-source caches replay CUDA graphs on CUDA devices
        self.graph = (GraphStep(decoder) if compile and self.lean and self.plain_output
                      and plain_modules(decoder.project_out_dim) else None)
        self.draft_blocks = draft_blocks
        self._table: Optional[Tensor] = None
        self._version: Optional[tuple] = None

    def start_call(self, n_sources: int) -> None:
        """A generate call over `n_sources` sources begins: RepackedLinears.refresh, and the eager
        lean math over the layers' plain attributes (lean_layer.plain_layer), taken afresh."""
        if self.repacked is not None:
            self.repacked.refresh(n_sources)
        if self.lean:
            fused = self.fused if self.repacked is not None and self.repacked.active else None
            self.call_math = LayerMath([plain_layer(layer) for layer in self.decoder.layers],
                                       self.repacked or plain_linear, fused or attention)
        if self.plain_output:
            self.call_projection = plain_projection(self.decoder.output_projection)
        if self.graph is not None:
            self.graph.start_call()

    def graph_steps(self, device: torch.device) -> bool:
        """Blocks on `device` may take static-shape steps (runtime.graph_step): on CUDA with
        `compile`, or a step built to run on the CPU (tests)."""
        return self.graph is not None and (device.type == "cuda" or self.graph.on_cpu)

    def _math(self, x: Tensor) -> Optional[LayerMath]:
        """The layers' math for `x`: compiled on the CPU. On CUDA eager: there `--compile` is the
        graph steps, and inductor's kernels measured no faster than eager on an H100 (IAD 1.04x to
        1.19x eager's time, beams 1.01x to 1.06x; docs/benchmarks.md) at a compile of 20 to 35 s."""
        return self.compiled if self.compiled is not None and not x.is_cuda else self.call_math

    def positions(self, length: int, device) -> Optional[Tensor]:
        """[length, C] positional embeddings of target positions 0..length-1 (BOS is position 0)."""
        dec = self.decoder
        emb = dec.embed_positions
        if emb is None:
            return None
        if torch.is_grad_enabled():
            return _probe_positions(dec, length, device)
        weight = getattr(emb, "weight", None)
        # learned positions change with their weight; sinusoidal ones with the model's dtype (model.half())
        version = (dec.embed_tokens.weight.dtype, None if weight is None else (weight.data_ptr(), weight._version))
        table = self._table
        if table is None or self._version != version or table.size(0) < length or table.device != torch.device(device):
            size = length if table is None else max(length, min(2 * table.size(0), dec.max_positions()))
            self._table, self._version = _probe_positions(dec, size, device), version
        return self._table[:length]  # type: ignore[index]

    def _embed(self, tokens: Tensor, positions: Tensor, max_position: Optional[int]) -> Tensor:
        """The decoder's input embedding of block `tokens` at `positions`, as fairseq's
        TransformerDecoder.extract_features computes it (positions from the kept table)."""
        decoder = self.decoder
        x = decoder.embed_scale * decoder.embed_tokens(tokens)
        if decoder.quant_noise is not None:
            x = decoder.quant_noise(x)
        if decoder.project_in_dim is not None:
            x = decoder.project_in_dim(x)
        top = int(positions.max()) if max_position is None else max_position
        table = self.positions(top + 1, tokens.device)
        if table is not None:
            x = x + table[positions]
        if decoder.layernorm_embedding is not None:
            x = decoder.layernorm_embedding(x)
        return decoder.dropout_module(x)

    def __call__(self, tokens: Tensor, positions: Tensor, encoder_out, state: Optional[IncState],
                 block_pad: Optional[Tensor], tail: int = 0, logits_for_tail: bool = False,
                 max_position: Optional[int] = None, slots: Optional[Slots] = None,
                 groups: Optional[SourceGroups] = None, rows: Optional[Tensor] = None) -> Tensor:
        """Logits [N, m, V] for block `tokens` [N, m] at target positions `positions` [N, m]; appends
        the block to the cache in `state` (None: no cache, as in training). `block_pad` [N, m] marks
        padding inside the block (None: none); the last `tail` slots attend bidirectionally
        (block_attn_mask). `logits_for_tail`: project only the tail slots (logits [N, tail, V]).
        `max_position`: the largest of `positions`, known on the host (saves a device sync).
        `slots` (lean_layer.Slots): compute only the real slots, logits packed [T, V]. `groups`
        (lean_layer.SourceGroups, lean layers only): cross-attention keys cached per source. `rows`
        (lean layers only): the cached rows the block's rows continue (KVCache.take_pending)."""
        decoder = self.decoder
        m = tokens.size(1)
        x = self._embed(tokens, positions, max_position)
        if (self.graph is not None and state is not None and tail == 0 and not logits_for_tail
                and not decoder.training and not torch.is_grad_enabled() and self.graph_steps(x.device)
                and (m == 1 and groups is not None and block_pad is None and slots is None  # a beam step
                     or self.draft_blocks and groups is None and rows is None)):  # a draft block
            logits = self.graph.step(x, state, groups, rows, block_pad)
            if logits is not None:
                return logits if slots is None else slots.pack(logits)

        prev = 0 if state is None else cached_length(decoder, state)
        mask = block_attn_mask(prev, m, tail, x.dtype, x.device) if m > 1 else None  # one slot sees every key
        enc = encoder_out["encoder_out"][0] if len(encoder_out["encoder_out"]) else None
        enc_mask = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) else None
        if slots is not None and logits_for_tail:
            raise ValueError("forward_block: slots and logits_for_tail do not combine")
        if self.lean and not decoder.training:
            x = lean_layers(decoder.layers, x, enc, enc_mask, state, mask, block_pad, slots, groups,  # batch-major
                            self._math(x), rows)
        else:
            if groups is not None or rows is not None:
                raise ValueError("forward_block: caches with keys per source or pending rows need lean layers")
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
        if self.call_projection is not None and not decoder.training:
            return self.project(self.call_projection, x)
        return decoder.output_layer(x)


def ensemble_lprobs(models, logits: List[Tensor], temperature: float) -> Tensor:
    """fairseq EnsembleModel.forward_decoder's scores from each model's logits (as block decoders
    return them): temperature, normalized log-probs, then the log-mean-exp over the models."""
    outs = []
    for m, x in zip(models, logits):
        if temperature != 1.0:
            x = x.div_(temperature)
        packed = x.dim() == 2  # real slots only [T, V]: fairseq's adaptive softmax reads [B, T, C]
        lp = m.get_normalized_probs((x.unsqueeze(0) if packed else x, None), log_probs=True)
        outs.append(lp.squeeze(0) if packed else lp)
    if len(outs) == 1:
        return outs[0]
    return torch.logsumexp(torch.stack(outs, dim=0), dim=0) - math.log(len(outs))
