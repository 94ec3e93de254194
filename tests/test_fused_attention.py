"""runtime.fused_attention: the C++ kernel computes torch's attention products (scores, float32
softmax, weighted values) within float32 rounding, a row's result does not depend on the rows
beside it, masked keys get exactly zero weight, and every input it does not take runs torch's
products. Generate calls over many sources take it, with fairseq's output."""

import math

import pytest
import torch
from helpers import assert_same_hypos, fairseq_generate, make_dict, make_sample, random_sentences, random_transformer

from fairseq_streambeam.generators.stream_beam import StreamBeamGenerator
from fairseq_streambeam.runtime.fused_attention import FusedAttention, attention
from fairseq_streambeam.runtime.lean_layer import RepackedLinears

FUSED = FusedAttention.load()
needs_kernel = pytest.mark.skipif(FUSED is None, reason="no C++ compiler to build the fused attention kernel")


@pytest.fixture(autouse=True)
def _inference():
    """As generate calls run: the kernel takes no autograd inputs."""
    with torch.no_grad():
        yield


def _inputs(b, m, length, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, d, generator=g, dtype=dtype) / math.sqrt(d)
    k = torch.randn(b, length, d, generator=g, dtype=dtype)
    v = torch.randn(b, length, d, generator=g, dtype=dtype)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("b,m,length", [(3, 1, 1), (8, 1, 13), (20, 5, 30), (6, 3, 69), (4, 2, 8)])
@pytest.mark.parametrize("mask", ["none", "keys", "block"])
def test_kernel_matches_torch_products(b, m, length, mask):
    q, k, v = _inputs(b, m, length, seed=b * 100 + length)
    add = None
    if mask == "keys":  # key padding, one row per (row, head) broadcast over the queries
        add = torch.zeros(b, 1, length)
        add[::2, 0, : length // 2] = -math.inf
    elif mask == "block":  # a block mask broadcast over rows, as lean_layer._additive without key mask
        add = torch.randn(1, m, length)
        add[0, :, length - 1:] = -math.inf if length > 1 else 0.0
    assert FUSED.applies(q, k, v, add)
    want, got = attention(q, k, v, add), FUSED(q, k, v, add)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-6), (got - want).abs().max()


@needs_kernel
def test_masked_keys_get_zero_weight_and_rows_are_independent_of_the_batch_and_threads():
    q, k, v = _inputs(12, 4, 21)
    add = torch.zeros(12, 1, 21)
    add[:, 0, 15:] = -math.inf
    v[:, 15:] = 1e30  # any weight above zero on these would show
    out = FUSED(q, k, v, add)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, attention(q[:, :, :], k[:, :15], v[:, :15], None), rtol=1e-5, atol=2e-6)
    # each (row, head) alone, or among other rows: the same bits
    parts = torch.cat([FUSED(q[i:i + 3], k[i:i + 3], v[i:i + 3], add[i:i + 3]) for i in range(0, 12, 3)])
    assert torch.equal(out, parts)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # rows split across OpenMP threads: the same bits
    try:
        assert torch.equal(FUSED(q, k, v, add), out)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_inputs_the_kernel_does_not_take_run_torch_products():
    q, k, v = _inputs(4, 2, 9, dtype=torch.float64)
    assert not FUSED.applies(q, k, v, None) and torch.equal(FUSED(q, k, v, None), attention(q, k, v, None))
    q, k, v = _inputs(4, 2, 9, d=32)
    assert not FUSED.applies(q, k, v, None) and torch.equal(FUSED(q, k, v, None), attention(q, k, v, None))
    q, k, v = _inputs(4, 2, 9)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
    assert not FUSED.applies(q, kt, v, None) and torch.equal(FUSED(q, kt, v, None), attention(q, kt, v, None))
    with torch.enable_grad():
        qg = q.clone().requires_grad_()
        assert not FUSED.applies(qg, k, v, None)
    qv = q.transpose(0, 1).contiguous().transpose(0, 1)  # a strided view of queries is taken (copied)
    assert FUSED.applies(qv, k, v, None) and torch.equal(FUSED(qv, k, v, None), FUSED(q, k, v, None))


@needs_kernel
def test_load_builds_into_an_empty_cache_and_reuses_it(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = FusedAttention.load()
    libs = list((tmp_path / "fairseq_streambeam").glob("fused_attention-*.so"))
    assert built is not None and len(libs) == 1
    stamp = libs[0].stat().st_mtime_ns
    q, k, v = _inputs(5, 2, 11)
    assert torch.equal(built(q, k, v, None), FUSED(q, k, v, None))
    assert FusedAttention.load() is not None and libs[0].stat().st_mtime_ns == stamp  # not built again


def test_load_reports_a_failed_build_once_and_the_switch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'error: no OpenMP' >&2\nexit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with caplog.at_level("WARNING"):
        assert FusedAttention.load() is None
        assert FusedAttention.load() is None  # the failure is remembered: the compiler is not run again
    assert "fused attention unavailable (cxx failed: error: no OpenMP)" in caplog.text, caplog.text
    assert calls.read_text() == "run\n" and not list(tmp_path.rglob("*.so"))
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("STREAMBEAM_FUSED_ATTENTION", "0")
    assert FusedAttention.load() is None


@needs_kernel
def test_generate_over_many_sources_takes_the_kernel_with_fairseqs_output(monkeypatch):
    """A float32 random transformer with head dim 64: a call over MIN_SOURCES sources attends by the
    kernel (a smaller call by torch's products), and both give fairseq's hypotheses."""
    d = make_dict(40)
    model = random_transformer(d, seed=3, dim=128)
    n = RepackedLinears.MIN_SOURCES + 2
    s = make_sample(d, random_sentences(d, n, seed=5, max_len=20))
    ref = fairseq_generate([model], d, s, beam_size=4)
    gen = StreamBeamGenerator([model], d, beam_size=4)
    hyps = gen.generate([model], s)
    assert isinstance(gen.blocks[0].call_math.products, FusedAttention)
    assert_same_hypos(ref, hyps, atol=1e-4)
    small = make_sample(d, random_sentences(d, 4, seed=6, max_len=20))
    assert_same_hypos(fairseq_generate([model], d, small, beam_size=4), gen.generate([model], small))
    assert gen.blocks[0].call_math.products is attention
    monkeypatch.setenv("STREAMBEAM_FUSED_ATTENTION", "0")
    off = StreamBeamGenerator([model], d, beam_size=4)
    assert_same_hypos(hyps, off.generate([model], s), atol=1e-4)
    assert off.blocks[0].call_math.products is attention
