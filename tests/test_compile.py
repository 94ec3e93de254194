"""--compile: the lean decoder layers' math through torch.compile (inductor; C++ on the CPU).

In float64 the compiled math equals the eager math up to rounding, so every decoding must return
the same tokens as without --compile (and as fairseq's SequenceGenerator for beam), with scores
(float32, as fairseq returns them) within 1e-6. The number of graphs is bounded, and a second run
on other sources compiles at most a structure or two more.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_hypos, fairseq_generate, make_dict, make_sample, random_sentences, random_transformer

from fairseq_streambeam import Budget, StreamBeamGenerator
from fairseq_streambeam.drafters.input_copy import InputCopyDrafter
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.runtime.compiled import compiled_graphs
from fairseq_streambeam.runtime.lean_layer import RepackedLinears
from fairseq_streambeam.spec import DecodeSpec, UsageError

D = make_dict(30)
# graphs of one decoding over two runs: the call structures of runtime/compiled.py's docstring,
# each also with sizes of 1 (one row, one slot, one cached slot), which torch specializes. A graph
# per cache length or row count would exceed it within a few steps.
GRAPHS_PER_DECODING = 10


@pytest.fixture(scope="module")
def compile_model():
    return random_transformer(D, 7, layers=1, eos_bias=2.0).double()


@pytest.fixture
def inductor_compiles() -> bool:
    """Whether `--compile` runs the layers through inductor where these tests' generators run: on
    the CPU it does; on CUDA (test_cuda.py overrides this) it replays graph steps and runs the rest
    eagerly, compiling nothing."""
    return True


def _graphs_of(run):
    """Run `run` twice (on two sets of sources); return the graphs the first compiled and the
    second's extra graphs."""
    torch._dynamo.reset()
    before = compiled_graphs()
    run(1)
    first = compiled_graphs() - before
    run(2)
    return first, compiled_graphs() - before - first


@pytest.mark.parametrize("decoding,order", [("var-stream", "min-length"), ("beam", "min-length")])
def test_beam_decodings_compiled_equal_eager(compile_model, decoding, order, inductor_compiles, caplog):
    caplog.set_level("INFO", logger="fairseq_streambeam.runtime.compiled")
    model = compile_model
    kw = dict(beam_size=4, decoding=decoding, max_len_b=14)
    if decoding == "var-stream":
        kw["stream_order"] = order

    def run(seed):
        sample = make_sample(D, random_sentences(D, 11, 40 + seed, max_len=14))
        eager = StreamBeamGenerator([model], D, budget=Budget(4), **kw).generate([model], sample)
        got = StreamBeamGenerator([model], D, budget=Budget(4), compile=True, **kw).generate([model], sample)
        assert_same_hypos(eager, got, atol=1e-6)
        if decoding == "beam":
            assert_same_hypos(fairseq_generate([model], D, sample, beam_size=4, max_len_b=14), got, atol=1e-6)

    first, more = _graphs_of(run)
    if not inductor_compiles:
        assert first == more == 0
        return
    assert first >= 1 and first + more <= GRAPHS_PER_DECODING
    assert more <= 2  # structures the first sources did not meet (e.g. a single row)
    # each graph's compile time is logged, so a first run's slow start is explained
    said = [r.getMessage() for r in caplog.records if r.name == "fairseq_streambeam.runtime.compiled"]
    assert 1 <= len(said) <= first + more and all(" compiled in " in m for m in said), said  # a call may add two


def test_compiled_layers_keep_the_repacked_output_projection(compile_model):
    """With --compile on the CPU the output projection multiplies by the generate call's copy of its
    weight (RepackedLinears, over at least MIN_SOURCES sources; for this float64 model a transposed
    copy, for float32 oneDNN's packed one) and the compiled layers by their own products: the
    copies hold the projection's weight only."""
    model = compile_model
    n = RepackedLinears.MIN_SOURCES + 1
    sample = make_sample(D, random_sentences(D, n, 47, max_len=14))
    kw = dict(beam_size=4, decoding="beam", max_len_b=14)
    gen = StreamBeamGenerator([model], D, budget=Budget(4), compile=True, **kw)
    got = gen.generate([model], sample)
    assert [(b.repacked.active, len(b.repacked._copies)) for b in gen.blocks] == [(True, 1)]
    assert_same_hypos(fairseq_generate([model], D, sample, beam_size=4, max_len_b=14), got, atol=1e-6)


def test_caches_crossing_the_small_cache_size_add_no_graph(compile_model, monkeypatch):
    """The eager append's size test (lean_layer.FUSED_APPEND_MIN) is not made while compiling: a
    symbolic size test would guard the graph, and caches growing past it would compile again."""
    from fairseq_streambeam.runtime import lean_layer

    sample = make_sample(D, random_sentences(D, 11, 45, min_len=6, max_len=14))
    kw = dict(beam_size=4, decoding="beam", max_len_b=14, min_len=8, compile=True)
    graphs = []
    for threshold in (1 << 40, 4000):  # never crossed; crossed after a few steps (44 rows, 32 values a slot)
        monkeypatch.setattr(lean_layer, "FUSED_APPEND_MIN", threshold)
        torch._dynamo.reset()
        before = compiled_graphs()
        StreamBeamGenerator([compile_model], D, **kw).generate([compile_model], sample)
        graphs.append(compiled_graphs() - before)
    assert graphs[0] == graphs[1] >= 1


def test_iad_compiled_equals_greedy(compile_model, inductor_compiles):
    model = compile_model
    kw = dict(max_len_b=12, min_len=2)

    def run(seed):
        sample = make_sample(D, random_sentences(D, 10, 60 + seed, max_len=14))
        ref = fairseq_generate([model], D, sample, beam_size=1, **kw)
        gen = AggressiveGenerator([model], D, budget=Budget(3), drafter=InputCopyDrafter(2, 0), compile=True, **kw)
        assert_same_hypos(ref, gen.generate([model], sample), atol=1e-6)

    first, more = _graphs_of(run)
    if not inductor_compiles:
        assert first == more == 0
        return
    assert first >= 1 and first + more <= GRAPHS_PER_DECODING
    assert more <= 2


def test_compile_is_refused_for_fairseq_decoding():
    with pytest.raises(UsageError, match="--compile applies to the beam and draft decodings, not --decoding fairseq"):
        DecodeSpec(decoding="fairseq", compile=True)
