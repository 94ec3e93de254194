"""Static-shape steps (runtime/graph_step.py), which `--compile` replays as CUDA graphs, run here
eagerly on the CPU: rows, block slots, cached slots and sources padded to buckets and masked, keys
and values in two buffers of fixed capacity. In float64 the output must be the dynamic step's: beam
equals fairseq's SequenceGenerator, var-stream equals var-batch under schedules whose cohorts
alternate, merge and are cut while sharing the buffers, and IAD and GAD (draft blocks rolled back,
masked and compacted) equal greedy decoding. In float32, deen-tiny's beam and gec-tiny's IAD keep
their top-1, and so does var-stream with half-precision models. On the CPU the steps run as
`Replayed`, which plays what a graph does that an eager step does not: the region a step must not
read holds garbage, a shape's first step runs twice (warm-up and capture), and other shapes'
outputs are overwritten (one memory pool). tests/test_cuda.py collects these tests again on a GPU,
where the steps are graphs.
"""

from __future__ import annotations

import pytest
import test_half as half
import torch
from helpers import (
    assert_same_hypos,
    fairseq_generate,
    gec_sample,
    gec_tiny,
    make_dict,
    make_sample,
    random_drafter,
    random_sentences,
    random_transformer,
)
from test_aggressive import OracleDrafter
from test_exact_fairseq import _deen_sample, deen  # noqa: F401

from fairseq_streambeam import Budget, StreamBeamGenerator
from fairseq_streambeam.drafters.block_model import ModelDrafter
from fairseq_streambeam.drafters.input_copy import InputCopyDrafter
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.runtime.block_step import BlockDecoder
from fairseq_streambeam.runtime.graph_step import GraphStep
from fairseq_streambeam.runtime.kv_cache import KVCache

D = make_dict(30)
MODELS = [random_transformer(D, 21).double(), random_transformer(D, 22, eos_bias=3.0).double()]
SAMPLE = make_sample(D, random_sentences(D, 14, 23, min_len=1, max_len=15))
KW = dict(beam_size=6, max_len_b=14, len_penalty=0.8)
VAR = dict(KW, prune_abs_threshold=1.2, prune_max_cands=3)


def _garbage(t: torch.Tensor) -> None:
    """Large finite values where a step must read nothing (a masked or padded place)."""
    if t.numel():
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel()), dtype=t.dtype) * 30)


class Replayed(GraphStep):
    """GraphStep with a CUDA graph's hazards played on the CPU (see the module doc); on CUDA, the
    real graphs."""

    def __init__(self, decoder, max_bytes=None):
        super().__init__(decoder, on_cpu=True, max_bytes=max_bytes)
        self.outs: dict = {}
        self.replays = 0  # graph steps taken
        self.peak = 0  # the largest buffers' bytes
        self.in_place = 0  # steps over a cache cut back in the buffers (a rolled-back draft), not copied in
        self.widths: set = set()  # block widths stepped

    def _allocate(self, x, *shape):
        super()._allocate(x, *shape)
        self.peak = max(self.peak, self._bytes(x, *shape))
        self.outs.clear()
        b = self.buf
        for t in b.k[0] + b.k[1] + b.v[0] + b.v[1] + b.ck + b.cv + [b.x]:
            _garbage(t)

    def _stage(self, x, state, groups, rows, block_pad, n, length, nb, lb, sb, lsb):
        super()._stage(x, state, groups, rows, block_pad, n, length, nb, lb, sb, lsb)
        b, rd = self.buf, self.cur
        pk = self._self_kv(state, "prev_key")[0]
        cached = n if pk is None else pk.size(0)
        _garbage(b.x[n:])
        _garbage(b.x[:, x.size(1):])
        for t in b.k[rd] + b.v[rd]:
            _garbage(t[:, :, length:])
            _garbage(t[cached:])
        for t in b.k[1 - rd] + b.v[1 - rd]:
            _garbage(t)
        for layer, t in zip(self.decoder.layers, b.ck):
            s, ls = layer.encoder_attn._get_input_buffer(state)["prev_key"].shape[::2]
            _garbage(t[s:])
            _garbage(t[:, :, ls:])
        if rows is not None:
            b.rows[n:nb].random_(0, cached, generator=torch.Generator(b.rows.device).manual_seed(n))

    def _ours(self, state, kv):
        ours = super()._ours(state, kv)
        self.in_place += ours and kv[0] is not self.last[1][0]
        return ours

    def _run(self, key, fn):
        self.replays += 1
        self.widths.add(key[1])
        if self.buf.x.is_cuda:
            return super()._run(key, fn)
        self.graphs.setdefault(key, None)
        if key not in self.outs:
            self.captures += 1
            fn()
            self.outs[key] = fn().clone()
        else:
            self.outs[key].copy_(fn())
        for other, out in self.outs.items():
            if other != key:
                out.fill_(float("nan"))
        return self.outs[key]


def with_graph_steps(models, d, max_bytes=None, **kw):
    """A StreamBeamGenerator whose one-slot steps are graph steps (`Replayed` on the CPU)."""
    gen = StreamBeamGenerator(models, d, **kw)
    assert gen.blocks, "the lean block steps apply to these models"
    for block in gen.blocks:
        block.graph = Replayed(block.decoder, max_bytes)
    return gen


def iad_with_graph_steps(models, d, **kw):
    """An AggressiveGenerator whose draft blocks are graph steps (`Replayed` on the CPU)."""
    gen = AggressiveGenerator(models, d, **kw)
    for block in gen.blocks:
        assert block.draft_blocks and block.lean
        block.graph = Replayed(block.decoder)
    return gen


def static_shapes(gen) -> int:
    """Static shapes the run met: the graphs it would capture on CUDA."""
    return sum(block.graph.captures for block in gen.blocks)


def test_beam_on_static_steps_equals_fairseq():
    gen = with_graph_steps(MODELS, D, **KW)
    got = gen.generate(MODELS, SAMPLE)
    assert static_shapes(gen) > 0
    assert_same_hypos(fairseq_generate(MODELS, D, SAMPLE, **KW), got, atol=1e-6)


def test_buffers_past_the_memory_budget_leave_the_steps_to_the_eager_path():
    """Buffers that would outgrow `max_bytes` are not allocated: those steps run eagerly, steps
    whose buffers fit (the first ones, and those after enough sources finished) on static shapes,
    and beam still equals fairseq's generator."""
    free = with_graph_steps(MODELS, D, **KW)
    free.generate(MODELS, SAMPLE)
    peak = max(block.graph.peak for block in free.blocks)
    gen = with_graph_steps(MODELS, D, max_bytes=peak // 2, **KW)
    got = gen.generate(MODELS, SAMPLE)
    assert_same_hypos(fairseq_generate(MODELS, D, SAMPLE, **KW), got, atol=1e-6)
    for capped, whole in zip(gen.blocks, free.blocks):
        assert 0 < capped.graph.replays < whole.graph.replays
        assert capped.graph.peak <= peak // 2


# (live sources, refill eps, order, max wait): cohorts that wait while others step, merge, and
# (continuous) a ragged cohort whose cache is cut after steps
SCHEDULES = [(3, 1.0, "min-length", 0), (5, 0.5, "min-length", 2), (4, 1.0, "continuous", 0), (2, 0.0, "fifo", 0),
             (20, 0.0, "min-length", 0)]


@pytest.mark.parametrize("n,eps,order,wait", SCHEDULES)
def test_var_stream_on_static_steps_equals_var_batch(n, eps, order, wait):
    batch = StreamBeamGenerator(MODELS, D, decoding="var-batch", **VAR).generate(MODELS, SAMPLE)
    gen = with_graph_steps(MODELS, D, decoding="var-stream", budget=Budget(n), refill_eps=eps, stream_order=order,
                           max_wait_steps=wait, **VAR)
    assert_same_hypos(batch, gen.generate(MODELS, SAMPLE), atol=1e-5, msg=f"n={n} eps={eps} {order}")


@pytest.mark.parametrize("dtype", half.DTYPES)
def test_half_var_stream_on_static_steps(dtype):
    """Half-precision models: variable-width beams take the static-shape steps too. Padded products
    round otherwise in half, so the bar is top-1 against the eager lean step (measured on the CPU:
    72/72 in float16 and in bfloat16; GPU kernels round otherwise, which the bar leaves room for)."""
    same, kw = 0, dict(half.KW, decoding="var-stream", refill_eps=0.9)
    for m, s in half.cases(dtype):
        eager = StreamBeamGenerator([m], half.D, budget=Budget(3), **kw)
        gen = with_graph_steps([m], half.D, budget=Budget(3), **kw)
        same += half.same_top1(eager.generate([m], s), gen.generate([m], s))
        assert gen.lean_steps and static_shapes(gen) > 0
    assert same >= half.N - 4, f"{dtype}: static steps == eager steps for {same}/{half.N}"


def test_deen_tiny_float32_beam_on_static_steps(deen):  # noqa: F811
    """float32: padded products and attention round differently, so the issue's bar is top-1 and
    scores within 1e-4; shapes come in buckets, so a run has few of them (a graph each on CUDA)."""
    _, models, task = deen
    d = task.target_dictionary
    s = _deen_sample(task, 24, 3004 // 24)
    ref = StreamBeamGenerator(models, d, beam_size=5).generate(models, s)
    gen = with_graph_steps(models, d, beam_size=5)
    got = gen.generate(models, s)
    same = [a[0]["tokens"].tolist() == b[0]["tokens"].tolist() for a, b in zip(ref, got)]
    assert sum(same) >= len(same) - 1
    assert all(abs(float(a[0]["score"]) - float(b[0]["score"])) <= 1e-4 for a, b, ok in zip(ref, got, same) if ok)
    assert 0 < static_shapes(gen) <= 32 < gen.counters.decoder_steps


def _truth(sample, ref):
    rows = sample["net_input"]["src_tokens"]
    return {tuple(r[r.ne(D.pad())].tolist()): h[0]["tokens"].tolist() for r, h in zip(rows, ref)}


@torch.no_grad()
def test_a_padded_draft_block_leaves_the_eager_steps_logits_and_cache():
    """One block of drafts of different lengths over a cache with masked slots: the static step's
    logits at the real slots, and the cache it leaves (keys, values, key mask), are the eager step's."""
    dec = MODELS[0].decoder
    src = SAMPLE["net_input"]["src_tokens"][:3]
    enc = MODELS[0].encoder(src, src.ne(D.pad()).sum(1))
    first = torch.tensor([[D.eos(), 5, 6, 7]] * 3)
    pad = torch.tensor([[False, False, False, False, True, True], [False] * 6, [False, False, True, True, True, True]])
    block = torch.tensor([[7, 8, 9, 10, 1, 1], [7, 9, 9, 9, 9, 11], [8, 5, 1, 1, 1, 1]])
    logits, states = [], []
    for graph in (False, True):
        step = BlockDecoder(dec, draft_blocks=True)
        step.start_call(3)
        if graph:
            step.graph = Replayed(dec)
            step.graph.start_call()
        state: dict = {}
        step(first, torch.arange(4).expand(3, 4), enc, state, None)
        for layer in dec.layers:  # row 1's second slot rolled back
            buf = layer.self_attn._get_input_buffer(state)
            buf["prev_key_padding_mask"] = torch.tensor([[False] * 4, [False, True, False, False], [False] * 4])
            layer.self_attn._set_input_buffer(state, buf)
        logits.append(step(block, torch.arange(4, 10).expand(3, 6), enc, state, pad))
        states.append(state)
        assert step.graph.replays == 1 if graph else step.graph is None
    assert torch.allclose(logits[0][~pad], logits[1][~pad], atol=1e-6)  # attention's softmax is float32
    assert states[0].keys() == states[1].keys()
    for key, buf in states[0].items():
        for name, t in buf.items():
            u = states[1][key][name]
            assert (t is None) == (u is None) and (t is None or torch.allclose(t.double(), u.double(), atol=1e-6)), name


@pytest.mark.parametrize("n", [1, 3, 14])
def test_iad_on_static_blocks_equals_greedy(n, monkeypatch):
    """Drafts of the greedy output with every 5th token wrong: long blocks, rejected tails cut off
    (one row) or masked (a batch) and compacted, rows that finish and cohorts that merge."""
    monkeypatch.setattr(KVCache, "compact_slack", 0)
    kw = dict(max_len_b=14, min_len=2, unk_penalty=0.3, len_penalty=0.8)
    ref = fairseq_generate(MODELS, D, SAMPLE, beam_size=1, **kw)
    gen = iad_with_graph_steps(MODELS, D, budget=Budget(n), drafter=OracleDrafter(_truth(SAMPLE, ref)), **kw)
    assert_same_hypos(ref, gen.generate(MODELS, SAMPLE), atol=1e-6)
    graphs = [block.graph for block in gen.blocks]
    assert gen.counters.accepted_per_pass > 2 and all(max(g.widths) >= 4 and g.replays > 0 for g in graphs)
    if n == 1:  # a lone row's cache is cut back after each rejection and read in place
        assert all(g.in_place > 0 for g in graphs)
    plain = iad_with_graph_steps(MODELS, D, budget=Budget(n), drafter=InputCopyDrafter(2, 2), **kw)
    assert_same_hypos(ref, plain.generate(MODELS, SAMPLE), atol=1e-6)


@pytest.mark.parametrize("beta", [1, 2])
def test_gad_on_static_blocks_equals_eager_gad(beta):
    """GAD with a random drafter; with beta 1 greedy's output, with GAD++'s beta 2 the eager
    step's (its verdict reads every slot of a padded block)."""
    kw = dict(decoding="gad", draft_min_reach=0.0, draft_switch=False, gad_beta=beta, max_len_b=14,
              budget=Budget(4))
    drafter = random_drafter(D, 11, k=4).double()
    eager = AggressiveGenerator(MODELS, D, drafter=ModelDrafter(drafter, D, 3), **kw)
    ref = eager.generate(MODELS, SAMPLE)
    if beta == 1:
        assert_same_hypos(fairseq_generate(MODELS, D, SAMPLE, beam_size=1, max_len_b=14), ref, atol=1e-6)
    gen = iad_with_graph_steps(MODELS, D, drafter=ModelDrafter(drafter, D, 3), **kw)
    assert_same_hypos(ref, gen.generate(MODELS, SAMPLE), atol=1e-6)
    assert all(block.graph.replays > 0 for block in gen.blocks)


def test_gec_tiny_float32_iad_on_static_blocks():
    """float32: padded products round differently, so top-1 agreement with the eager step (all but
    one sentence) and few static shapes (a graph each on CUDA)."""
    models, task = gec_tiny()
    d, s = task.target_dictionary, gec_sample(task, 40)
    for n in (1, 8):
        ref = AggressiveGenerator(models, d, budget=Budget(n)).generate(models, s)
        gen = iad_with_graph_steps(models, d, budget=Budget(n))
        got = gen.generate(models, s)
        same = sum(a[0]["tokens"].tolist() == b[0]["tokens"].tolist() for a, b in zip(ref, got))
        assert same >= len(ref) - 1, f"batch {n}: {same}/{len(ref)}"
        assert 0 < static_shapes(gen) <= 64, static_shapes(gen)
