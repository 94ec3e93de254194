"""Decoder steps on static shapes, replayed as CUDA graphs (`--compile` on CUDA).

On a GPU a small model's eager step is host work: over a hundred kernel launches and the Python
around them, whatever the row count (docs/benchmarks.md, "GPU"). A CUDA graph launches them as one, but
only for fixed shapes and fixed memory. `GraphStep` gives both to the beam decodings' one-slot steps
and to aggressive decoding's draft blocks:
- rows, block slots, cached slots, sources and source positions are padded up to powers of two
  (buckets);
- self-attention keys and values live in two buffers of fixed capacity per layer: a step reads
  one, follows the back-pointers into the other and writes its block there at slot indices held
  in a tensor (lean_layer.SlotWrite); slots after each query's own are masked;
- encoder keys are copied in once per cohort change, one row per source plus a spare source that
  padded rows attend to.
A graph is captured per bucket and replayed; what changes between steps (the block's embeddings,
back-pointers, grid positions, slot index and key mask) is copied into its inputs first. The
cache's incremental state holds views of the buffers: at the next step of another cache, or of
one reordered or compacted, they are first copied out (`_release`), so no state sees its slots
overwritten; a cache cut back to its first slots (a rolled-back draft) still reads them in place.
Buffers past a memory budget are not allocated: those steps are declined and run eagerly.
`on_cpu` runs the same static step eagerly on the CPU, where no graph is captured (tests).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .kv_cache import IncState
from .lean_layer import LayerMath, SlotWrite, SourceGroups, linear, norm, plain_layer, plain_linear, plain_projection


def _bucket(n: int, least: int) -> int:
    """The smallest power of two that is at least `n` and `least`."""
    return max(least, 1 << max(0, n - 1).bit_length())


def _row_bucket(n: int) -> int:
    """Rows padded for a graph: powers of two (one name, so a measurement can time other paddings)."""
    return _bucket(n, 8)


class GraphStep:
    """Static-shape steps (beams' one-slot steps, draft blocks) of one fairseq transformer decoder
    whose layers take the lean path, with its final layer norm and plain output projections
    (BlockDecoder.graph)."""

    def __init__(self, decoder, on_cpu: bool = False, max_bytes: Optional[int] = None):
        self.decoder = decoder
        self.on_cpu = on_cpu
        # the most the buffers may take (None: on CUDA half the memory free or held by them and the
        # allocator's cache, else no limit); past it steps are declined (the eager step takes them)
        self.max_bytes = max_bytes
        self.math: Optional[LayerMath] = None
        self.projection: Optional[SimpleNamespace] = None
        self.captures = 0  # graphs captured over the step's life (on the CPU: new static shapes met)
        self._weights: Optional[tuple] = None
        self._reset()

    def _reset(self) -> None:
        self.buf: Optional[SimpleNamespace] = None
        self.graphs: Dict[tuple, tuple] = {}
        self.pool = None
        self.last: Optional[tuple] = None  # (state, keys, values) whose views the buffers hold
        self.cross: Optional[tuple] = None  # the encoder keys copied in, as the state held them
        self.clean: Optional[tuple] = None  # (rows, slots) of the key mask known to be all False
        self.cur = 0  # the buffer the next step reads

    def start_call(self) -> None:
        """A generate call (or an online decoder) begins: take the layers' plain attributes afresh;
        graphs and buffers are dropped when a parameter moved (captured kernels read fixed
        addresses), else kept for the next calls."""
        dec = self.decoder
        self._release()  # a cache still stepping (an online decoder's) keeps its keys and values
        self.cross = None
        weights = tuple((p.data_ptr(), p.dtype, p.device) for p in dec.parameters())
        if weights != self._weights:
            self._reset()
            self._weights = weights
        self.math = LayerMath([plain_layer(layer) for layer in dec.layers], plain_linear)
        self.projection = plain_projection(dec.output_projection)

    def step(self, x: Tensor, state: IncState, groups: Optional[SourceGroups], rows: Optional[Tensor],
             block_pad: Optional[Tensor] = None) -> Optional[Tensor]:
        """Logits [N, m, V] for the block `x` [N, m, C] (embedded) over the cache in `state`, whose
        encoder keys are cached per source (`groups`), or one source a row (None: draft blocks,
        also over a cache with no slot yet); `rows`: KVCache.take_pending; `block_pad` [N, m]:
        padding slots of the block. The state's keys and values become views of the buffers.
        None: the caller takes the dynamic step (encoder keys not cached, a beam cohort's first
        step, buffers past the memory budget)."""
        layers = self.decoder.layers
        pk = self._self_kv(state, "prev_key")
        ck = [layer.encoder_attn._get_input_buffer(state).get("prev_key") for layer in layers]
        n, m = x.size(0), x.size(1)
        if any(k is None for k in ck) or (pk[0] is None and groups is not None):
            return None
        if groups is None:
            if ck[0].size(0) != n:
                return None
            groups = SourceGroups(None, n, 1)
        pv = self._self_kv(state, "prev_value")
        length, cached = (0, n) if pk[0] is None else (pk[0].size(2), pk[0].size(0))
        s, ls = ck[0].size(0), ck[0].size(2)
        # the cached rows are in their order before `rows`: as many as the rows they continue
        nb, mb, wb = _row_bucket(max(n, cached)), _bucket(m, 1), _bucket(groups.width, 1)
        lb, sb, lsb = _bucket(length + mb, 16), _bucket(s, 1), _bucket(ls, 16)
        fits = self._fits(x, nb, mb, lb, sb, lsb)
        if not (fits and self._ours(state, pk + pv)):
            self._release()  # also copies out this state's views of the buffers
            pk, pv = self._self_kv(state, "prev_key"), self._self_kv(state, "prev_value")
            if not fits:
                shape = self._capacity(x, nb, mb, lb, sb, lsb)
                if self._bytes(x, *shape) > self._budget(x):
                    self._reset()  # frees the buffers and graphs: wide beams' caches decode eagerly
                    return None
                self._allocate(x, *shape)
            self.cur = 0
            for i, (k, v) in enumerate(zip(pk, pv)):
                if k is not None:
                    self.buf.k[0][i][:k.size(0), :, :length].copy_(k)  # type: ignore[union-attr]
                    self.buf.v[0][i][:v.size(0), :, :length].copy_(v)  # type: ignore[union-attr]
        self._stage(x, state, groups, rows, block_pad, n, length, nb, lb, sb, lsb)
        rd = self.cur
        wr = 1 - rd if rows is not None else rd
        key = (nb, mb, lb, sb, lsb, wb, rd, wr)
        logits = self._run(key, lambda: self._static(nb, mb, lb, sb, lsb, wb, rd, wr))
        self.cur = wr
        self._write_back(state, block_pad, n, m, length, wr)
        return logits[:n, :m]

    def _ours(self, state: IncState, kv: List[Optional[Tensor]]) -> bool:
        """The state's keys and values are the views the last step left in the buffer it wrote, or
        those views cut back to their first slots (KVCache.truncate: a rolled-back draft)."""
        if self.last is None or self.last[0] is not state:
            return False
        for t, u in zip(kv, self.last[1] + self.last[2]):
            if t is not u and (t is None or t.untyped_storage().data_ptr() != u.untyped_storage().data_ptr()
                               or t.storage_offset() != u.storage_offset() or t.stride() != u.stride()
                               or t.shape[:2] != u.shape[:2] or t.size(2) > u.size(2)):
                return False
        return True

    def _fits(self, x: Tensor, nb: int, mb: int, lb: int, sb: int, lsb: int) -> bool:
        """The buffers hold these shapes, for `x`'s dtype, device and width."""
        b = self.buf
        return (b is not None and (b.x.dtype, b.x.device, b.x.size(2)) == (x.dtype, x.device, x.size(2))
                and nb <= b.rows.numel() and mb <= b.x.size(1) and lb <= b.mask.size(1)
                and sb + 1 <= b.cmask.size(0) and lsb <= b.cmask.size(1))

    def _self_kv(self, state: IncState, name: str) -> List[Optional[Tensor]]:
        return [layer.self_attn._get_input_buffer(state).get(name) for layer in self.decoder.layers]

    def _stage(self, x, state, groups, rows, block_pad, n, length, nb, lb, sb, lsb) -> None:
        """Copy what changes between steps into the graphs' inputs."""
        b = self.buf
        assert b is not None
        m = x.size(1)
        b.x[:n, :m].copy_(x)
        if rows is not None:
            b.rows[:n].copy_(rows)
        if rows is not None and n < nb:
            b.rows[n:nb].zero_()  # padded rows follow row 0 (any index below nb)
        b.pos[:n].copy_(b.iota[:n] if groups.pos is None else groups.pos)
        if n < nb:
            b.pos[n:nb].fill_(-1)  # the spare source
        b.width.fill_(groups.width)
        b.slot.fill_(length)
        mask = self.decoder.layers[0].self_attn._get_input_buffer(state).get("prev_key_padding_mask")
        if (mask is not None or block_pad is not None or self.clean is None or self.clean[0] < nb
                or self.clean[1] < lb):
            b.mask[:nb, :lb].zero_()
            self.clean = (nb, lb)
        if mask is not None:
            b.mask[:n, :length].copy_(mask)
            self.clean = None
        if block_pad is not None:
            b.mask[:n, length:length + m].copy_(block_pad)
            self.clean = None
        self._stage_cross(state, sb, lsb)

    def _stage_cross(self, state: IncState, sb: int, lsb: int) -> None:
        """Copy the encoder keys in when the state holds others than those last copied; positions
        past a source's length are masked, padded sources and the spare one are not (no row of
        theirs is read)."""
        bufs = [layer.encoder_attn._get_input_buffer(state) for layer in self.decoder.layers]
        now = tuple(t for buf in bufs for t in (buf["prev_key"], buf["prev_value"], buf.get("prev_key_padding_mask")))
        if self.cross is not None and self.cross[0] == (sb, lsb) and all(a is c for a, c in zip(now, self.cross[1])):
            return
        b = self.buf
        assert b is not None
        s, ls = bufs[0]["prev_key"].size(0), bufs[0]["prev_key"].size(2)
        for i, buf in enumerate(bufs):
            b.ck[i][:s, :, :ls].copy_(buf["prev_key"])
            b.cv[i][:s, :, :ls].copy_(buf["prev_value"])
        b.cmask[:sb + 1, :lsb].zero_()
        b.cmask[:s, ls:lsb] = True
        if now[2] is not None:
            b.cmask[:s, :ls].copy_(now[2])
        self.cross = ((sb, lsb), now)

    def _static(self, nb: int, mb: int, lb: int, sb: int, lsb: int, wb: int, rd: int, wr: int) -> Tensor:
        """The step on static shapes: what a graph captures. Reads buffer `rd`, writes buffer `wr`
        (the same one when no row follows another)."""
        b = self.buf
        assert b is not None and self.math is not None
        if mb == 1:  # one query: the slots after it are masked keys
            at, key_mask, attn_mask = b.slot, b.mask[:nb, :lb] | (b.iota[:lb] > b.slot), None
        else:  # each query sees the slots up to its own
            at, key_mask = b.slot + b.iota[:mb], b.mask[:nb, :lb]
            attn_mask = torch.zeros(mb, lb, dtype=b.x.dtype, device=b.x.device).masked_fill_(
                b.iota[:lb] > at[:, None], float("-inf"))
        raw = b.pos[:nb]
        spare = torch.full_like(raw, sb * wb)
        grid = torch.where(raw < 0, spare, torch.div(raw, b.width, rounding_mode="floor") * wb + raw % b.width)
        writes = [(SlotWrite(k[:nb, :, :lb], at), SlotWrite(v[:nb, :, :lb], at)) for k, v in zip(b.k[wr], b.v[wr])]
        if rd == wr:
            prev_k, prev_v, rows = [w[0].out for w in writes], [w[1].out for w in writes], None
        else:
            prev_k, prev_v, rows = [k[:nb, :, :lb] for k in b.k[rd]], [v[:nb, :, :lb] for v in b.v[rd]], b.rows[:nb]
        ns = sb + 1
        x, *_ = self.math(b.x[:nb, :mb], prev_k, prev_v, key_mask, attn_mask, True, [k[:ns, :, :lsb] for k in b.ck],
                          [v[:ns, :, :lsb] for v in b.cv], b.cmask[:ns, :lsb], None, None, grid, ns, wb, rows, writes)
        dec = self.decoder
        if dec.layer_norm is not None:
            x = norm(dec.layer_norm, x)
        if dec.project_out_dim is not None:
            x = linear(dec.project_out_dim, x)
        return plain_linear(self.projection, x)

    def _run(self, key: tuple, fn: Callable[[], Tensor]) -> Tensor:
        """`fn()`: eagerly on the CPU (`graphs` then records the shapes a GPU would capture); on
        CUDA, its graph for `key`, captured at the first call after a warm-up run on a side stream.
        Graphs share one memory pool: a graph's output is read before the next replay."""
        if not self.buf.x.is_cuda:  # type: ignore[union-attr]
            self.captures += key not in self.graphs
            self.graphs.setdefault(key, None)
            return fn()
        with torch.cuda.device(self.buf.x.device):  # streams and captures are the current device's
            entry = self.graphs.get(key)
            if entry is None:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: fairseq's batch prefetch thread, or a server's, may touch CUDA meanwhile
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = fn()
                self.pool = graph.pool()
                entry = self.graphs[key] = (graph, out)
                self.captures += 1
            entry[0].replay()
        return entry[1]

    def _write_back(self, state: IncState, block_pad: Optional[Tensor], n: int, m: int, length: int, wr: int) -> None:
        """The state's self-attention keys and values become views of buffer `wr` (the block
        appended), and its key mask gains the block's slots."""
        b = self.buf
        assert b is not None
        mask = self.decoder.layers[0].self_attn._get_input_buffer(state).get("prev_key_padding_mask")
        if block_pad is not None:
            prev = mask.bool() if mask is not None else block_pad.new_zeros(n, length)
            mask = torch.cat([prev, block_pad], 1)
        elif mask is not None:
            mask = F.pad(mask.bool(), (0, m), value=False)
        ks, vs = [], []
        for layer, k, v in zip(self.decoder.layers, b.k[wr], b.v[wr]):
            buf = layer.self_attn._get_input_buffer(state)
            buf["prev_key"], buf["prev_value"] = k[:n, :, :length + m], v[:n, :, :length + m]
            buf["prev_key_padding_mask"] = mask
            layer.self_attn._set_input_buffer(state, buf)
            ks.append(buf["prev_key"])
            vs.append(buf["prev_value"])
        self.last = (state, ks, vs)

    def _release(self) -> None:
        """Copy out every self-attention key and value of the last stepped state that is a view
        of the buffers (the step's own, or cut from them), so the next step may overwrite them."""
        if self.last is None or self.buf is None:
            self.last = None
            return
        state, self.last = self.last[0], None
        ours = {t.untyped_storage().data_ptr() for t in self.buf.k[0] + self.buf.k[1] + self.buf.v[0] + self.buf.v[1]}
        for layer in self.decoder.layers:
            buf = layer.self_attn._get_input_buffer(state)
            for name in ("prev_key", "prev_value"):
                t = buf.get(name)
                if t is not None and t.untyped_storage().data_ptr() in ours:
                    buf[name] = t.clone()
            layer.self_attn._set_input_buffer(state, buf)

    def _capacity(self, x: Tensor, nb: int, mb: int, lb: int, sb: int, lsb: int) -> tuple:
        """The buffers' shapes for these: at least this large, and as large as the last ones."""
        old = self.buf
        if old is not None and old.x.dtype == x.dtype and old.x.device == x.device:
            nb, mb, lb = max(nb, old.rows.numel()), max(mb, old.x.size(1)), max(lb, old.mask.size(1))
            sb, lsb = max(sb + 1, old.cmask.size(0)) - 1, max(lsb, old.cmask.size(1))
        return nb, mb, lb, sb, lsb

    def _bytes(self, x: Tensor, nb: int, mb: int, lb: int, sb: int, lsb: int) -> int:
        """What the keys and values of buffers of these shapes take: two self-attention buffers,
        keys and values, per layer, and the encoder keys and values."""
        dims = [(layer.self_attn.num_heads * layer.self_attn.head_dim,
                 layer.encoder_attn.num_heads * layer.encoder_attn.head_dim) for layer in self.decoder.layers]
        return x.element_size() * sum(4 * nb * lb * d + 2 * (sb + 1) * lsb * c for d, c in dims)

    def _budget(self, x: Tensor) -> float:
        if self.max_bytes is not None:
            return self.max_bytes
        if not x.is_cuda:
            return float("inf")
        free, _ = torch.cuda.mem_get_info(x.device)
        cached = torch.cuda.memory_reserved(x.device) - torch.cuda.memory_allocated(x.device)
        held = 0 if self.buf is None else self._bytes(self.buf.x, *self._capacity(self.buf.x, 0, 0, 0, 0, 0))
        return (free + cached + held) / 2

    def _allocate(self, x: Tensor, nb: int, mb: int, lb: int, sb: int, lsb: int) -> None:
        """Buffers of these shapes (`_capacity`); graphs are captured anew."""
        dev, dt = x.device, x.dtype
        selfs = [layer.self_attn for layer in self.decoder.layers]
        crosses = [layer.encoder_attn for layer in self.decoder.layers]

        def kv(rows, slots, mods):
            return [torch.zeros(rows, m.num_heads, slots, m.head_dim, dtype=dt, device=dev) for m in mods]

        self.buf = SimpleNamespace(
            k=[kv(nb, lb, selfs), kv(nb, lb, selfs)], v=[kv(nb, lb, selfs), kv(nb, lb, selfs)],
            ck=kv(sb + 1, lsb, crosses), cv=kv(sb + 1, lsb, crosses),
            mask=torch.zeros(nb, lb, dtype=torch.bool, device=dev),
            cmask=torch.zeros(sb + 1, lsb, dtype=torch.bool, device=dev),
            x=torch.zeros(nb, mb, x.size(2), dtype=dt, device=dev),
            rows=torch.zeros(nb, dtype=torch.long, device=dev), pos=torch.zeros(nb, dtype=torch.long, device=dev),
            iota=torch.arange(max(nb, lb), device=dev), slot=torch.zeros(1, dtype=torch.long, device=dev),
            width=torch.ones(1, dtype=torch.long, device=dev))
        self.graphs.clear()
        self.pool, self.cross, self.clean = None, None, (nb, lb)
