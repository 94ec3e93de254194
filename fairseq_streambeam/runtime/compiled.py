"""`--compile`: the lean decoder layers' math (runtime.lean_layer.LayerMath) through torch.compile.

The compiled function takes tensors only, with symbolic sizes (`dynamic=True`): rows, cache slots
and source positions change without recompiling. A new graph comes only with a new structure of
call (first block of a cache, full or ragged source groups, packed slots or none, rows to follow
or none): a few per decoding, at most `GRAPH_LIMIT` (beyond it, calls run eagerly: the same math).
Two of torch's compile settings are set around each call, for this function only:
- `use_duck_shape=False`: by default sizes equal at the first call are assumed equal forever, and
  at a cohort's first step every source has one row, so rows would be tied to sources;
- `recompile_limit=GRAPH_LIMIT`: torch's default of 8 is reached by the structures above across a
  run that mixes decodings.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.fx.experimental._config as fx_config

from .lean_layer import LayerMath

GRAPH_LIMIT = 32
logger = logging.getLogger(__name__)


class CompiledLayerMath:
    """`LayerMath(layers)` compiled with inductor. Absent inputs that have a neutral value get it,
    so they make no graph of their own: no cached keys are keys of no slots, no key mask masks
    nothing, no block mask adds zeros (adding 0.0 changes no float). Caches cut as views are copied:
    a graph's strides are fixed functions of its sizes."""

    def __init__(self, layers):
        self.eager = LayerMath(layers)
        self._fn = torch.compile(self.eager.__call__, dynamic=True)

    def __call__(self, x, prev_k, prev_v, key_mask, attn_mask, attends, cross_k, cross_v, cross_mask, enc, *rest):
        n, m = x.size(0), x.size(1)
        if prev_k[0] is None:
            empty = [x.new_zeros(n, layer.self_attn.num_heads, 0, layer.self_attn.head_dim)
                     for layer in self.eager.layers]
            prev_k, prev_v = empty, empty
        elif not all(t.is_contiguous() for t in prev_k + prev_v):  # a view (KVCache.truncate): strides are guarded
            prev_k, prev_v = [k.contiguous() for k in prev_k], [v.contiguous() for v in prev_v]
        length = prev_k[0].size(2) + m
        if key_mask is None:
            key_mask = torch.zeros(n, length, dtype=torch.bool, device=x.device)
        if attn_mask is None:
            attn_mask = x.new_zeros(m, length)
        if attends and cross_mask is None:
            shape = (enc.size(1), enc.size(0)) if cross_k[0] is None else (cross_k[0].size(0), cross_k[0].size(2))
            cross_mask = torch.zeros(shape, dtype=torch.bool, device=x.device)
        graphs, t0 = compiled_graphs(), time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=GRAPH_LIMIT), \
                fx_config.patch(use_duck_shape=False):
            out = self._fn(x, prev_k, prev_v, key_mask, attn_mask, attends, cross_k, cross_v, cross_mask, enc, *rest)
        if compiled_graphs() > graphs:  # compiling takes seconds to a minute on a CPU: say where the time went
            logger.info("--compile: decoder-layer graph %d of this process compiled in %.1f s (inductor caches "
                        "it for later runs)", compiled_graphs(), time.perf_counter() - t0)
        return out


def compiled_graphs() -> int:
    """Graphs compiled so far in this process (torch's dynamo counters)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
