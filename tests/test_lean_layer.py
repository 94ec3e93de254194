"""runtime.lean_layer computes what fairseq's decoder layers compute, on fairseq's cache layout:
block logits and cache buffers equal fairseq's path (float64) over a sequence of cached blocks
with padding, rolled-back slots, a bidirectional tail, dropped rows and compaction; layers it
does not implement fall back to fairseq's forward (and aggressive decoding stays exact)."""

import copy

import pytest
import torch
from helpers import (
    assert_same_hypos,
    fairseq_generate,
    make_dict,
    make_sample,
    random_sentences,
    random_transformer,
)

from fairseq_streambeam import Budget
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.generators.stream_beam import StreamBeamGenerator
from fairseq_streambeam.runtime import block_step
from fairseq_streambeam.runtime.block_step import BlockDecoder
from fairseq_streambeam.runtime.kv_cache import KVCache, cat_states, stand_in, without_padding_mask
from fairseq_streambeam.runtime.lean_layer import (
    RepackedLinears,
    Slots,
    SourceGroups,
    lean_supported,
    linear,
    plain_linear,
    plain_projection,
)


def forward_block(decoder, *args, repacked: bool = False, **kwargs):
    """One uncached block decoder call (nothing reused between calls); `repacked`: as in a
    generate call over many sources."""
    block = BlockDecoder(decoder, repacked=repacked)
    block.start_call(RepackedLinears.MIN_SOURCES)
    return block(*args, **kwargs)


def supports_lean(layer) -> bool:
    """`lean_supported`, and the layer is in inference mode."""
    return not layer.training and lean_supported(layer)

D = make_dict(30)


def _blocks(model, sample, lean: bool, monkeypatch, packed: bool = False, repacked: bool = False):
    """Logits of three cached blocks (the last with a bidirectional tail) and the final cache;
    `packed`: computing only the real slots (logits [T, V], listed with the padding mask);
    `repacked`: through repacked weights (which inference mode, no_grad, takes)."""
    monkeypatch.setattr(block_step, "lean_supported", lean_supported if lean else (lambda layer: False))
    dec = model.decoder
    enc = model.encoder.forward_torchscript(sample["net_input"])
    n = sample["net_input"]["src_tokens"].size(0)
    g = torch.Generator().manual_seed(0)
    cache = KVCache(model, n)
    state = cache.states[0]
    outs = []
    length = torch.zeros(n, dtype=torch.long)
    for i, (m, tail) in enumerate([(4, 0), (3, 0), (5, 2)]):
        tokens = torch.randint(D.nspecial, len(D), (n, m), generator=g)
        pad = torch.zeros(n, m, dtype=torch.bool)
        pad[0, m - 1] = True  # a row whose block is one slot shorter
        steps = length.unsqueeze(1) + torch.arange(m)
        e = enc if i == 0 else stand_in(model, n, tokens.device)[0]
        slots = Slots.real(pad) if packed else None
        with torch.set_grad_enabled(not repacked):
            outs.append((forward_block(dec, tokens, steps, e, state, pad, tail=tail, slots=slots,
                                       repacked=repacked), pad))
        if i == 0:  # roll back the last two slots of row 1, as a rejected draft
            masked = torch.zeros(n, m, dtype=torch.bool)
            masked[1, m - 2:] = True
            cache.mask(masked)
        if i == 1:  # row 2 leaves, then compaction drops the rolled-back slots
            keep = torch.tensor([0, 1, 3])
            cache.reorder(keep)
            cache.compact()
            n, length = 3, length[keep]
        length = length + m
    return outs, state


@pytest.mark.parametrize("options,repacked", [({}, False), ({"decoder_normalize_before": True}, False),
                                              ({}, True)])
def test_lean_blocks_equal_fairseq_layers(options, repacked, monkeypatch):
    model = random_transformer(D, 7, **options).double()
    assert all(supports_lean(layer) for layer in model.decoder.layers)
    sample = make_sample(D, random_sentences(D, 4, 8, min_len=3, max_len=9))
    ref, ref_state = _blocks(model, sample, False, monkeypatch)
    got, got_state = _blocks(model, sample, True, monkeypatch, repacked=repacked)
    for (a, _), (b, _) in zip(ref, got):
        real = torch.isfinite(a)
        assert torch.equal(real, torch.isfinite(b))
        assert torch.allclose(a[real], b[real], atol=1e-10)
    assert ref_state.keys() == got_state.keys()
    for key in ref_state:
        for name, a in ref_state[key].items():
            b = got_state[key][name]
            if name == "prev_key_padding_mask":
                assert torch.equal(a.bool(), b.bool()), (key, name)
            else:
                assert torch.allclose(a, b, atol=1e-10), (key, name)


@pytest.mark.parametrize("lean", [True, False])
def test_packed_real_slots_equal_the_padded_block(lean, monkeypatch):
    """Computing only a block's real slots gives their logits, and the cache's unmasked slots,
    of the whole padded block; on fairseq's layers too (packed after the layers)."""
    model = random_transformer(D, 9).double()
    sample = make_sample(D, random_sentences(D, 4, 10, min_len=3, max_len=9))
    ref, ref_state = _blocks(model, sample, lean, monkeypatch)
    got, got_state = _blocks(model, sample, lean, monkeypatch, packed=True)
    for (a, pad), (b, _) in zip(ref, got):
        assert b.shape == (int((~pad).sum()), len(D))
        assert torch.allclose(a[~pad], b, atol=1e-10)
    for key in ref_state:
        mask = ref_state[key].get("prev_key_padding_mask")
        assert torch.equal(mask.bool(), got_state[key]["prev_key_padding_mask"].bool())
        for name in ("prev_key", "prev_value"):
            a, b = ref_state[key][name], got_state[key][name]
            if a.size(2) == mask.size(1):  # masked slots (padding) are never read: packing leaves them zero
                a, b = a.masked_fill(mask.bool()[:, None, :, None], 0), b.masked_fill(mask.bool()[:, None, :, None], 0)
            assert torch.allclose(a, b, atol=1e-10), (key, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_plain_linear_is_f_linear_bit_for_bit(dtype):
    """plain_linear is F.linear's own product on every input layout the layers and the output
    projection meet (2-D rows, contiguous blocks, a non-lean decoder's transposed blocks), with and
    without bias: fixed beams keep fairseq's bits."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 7).to(dtype)
    inputs = [torch.randn(4, 5, dtype=dtype), torch.randn(3, 4, 5, dtype=dtype),
              torch.randn(4, 3, 5, dtype=dtype).transpose(0, 1), torch.randn(5, 4, dtype=dtype).t(),
              torch.randn(2, 3, 4, 5, dtype=dtype)]
    with torch.no_grad():
        for bias in (layer.bias, None):
            layer.bias = bias
            for x in inputs:
                assert torch.equal(plain_linear(plain_projection(layer), x), layer(x)), (x.shape, x.stride(), bias)


def test_repacked_weights_are_copied_per_call_for_calls_over_many_sources():
    """RepackedLinears computes `linear` (float64: transposed copies); its copies are made again in
    each generate call (a write to `.data` or a dtype change between calls is seen), only in calls
    over many sources, for the decoder step and the encoder of every decoding whose step is the
    lean one; fixed beams in half precision (fairseq's step, fairseq's bits) make none."""
    lin, layer = RepackedLinears(), torch.nn.Linear(6, 5).double()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    with torch.no_grad():  # generators take the plain projections afresh in each call, as here
        lin.refresh(RepackedLinears.MIN_SOURCES)
        assert torch.allclose(lin(plain_projection(layer), x), layer(x), atol=1e-12) and lin._copies
        layer.weight.data.add_(1.0)  # as fairseq's optimizers write
        lin.refresh(RepackedLinears.MIN_SOURCES)
        assert torch.allclose(lin(plain_projection(layer), x), layer(x), atol=1e-12)
        layer.float()
        lin.refresh(RepackedLinears.MIN_SOURCES)
        assert torch.allclose(lin(plain_projection(layer), x.float()), layer(x.float()), atol=1e-5)
        lin.refresh(1)
        assert torch.equal(lin(plain_projection(layer), x.float()), layer(x.float()))  # plain_linear: F.linear's bits
        assert not lin._copies
        modules = RepackedLinears(linear)  # the encoder's: over the modules themselves
        modules.refresh(1)
        assert torch.equal(modules(layer, x.float()), layer(x.float()))
    model = random_transformer(D, 3)
    for decoding in ("beam", "fixed-stream", "var-stream"):
        gen = StreamBeamGenerator([model], D, beam_size=3, decoding=decoding)
        for n, copied in ((2, False), (RepackedLinears.MIN_SOURCES, True)):
            gen.generate([model], make_sample(D, random_sentences(D, n, 5, min_len=2, max_len=6)))
            assert bool(gen.blocks[0].repacked._copies) == copied, (decoding, n)
            assert bool(gen.encoders.lins[0]._copies) == copied, (decoding, n)
    gen = AggressiveGenerator([model], D)
    for n, copied in ((2, False), (RepackedLinears.MIN_SOURCES, True)):
        gen.generate([model], make_sample(D, random_sentences(D, n, 5, min_len=2, max_len=6)))
        assert bool(gen.blocks[0].repacked._copies) == copied, n
        assert bool(gen.encoders.lins[0]._copies) == copied, n
    half = copy.deepcopy(model).to(torch.bfloat16)
    gen = StreamBeamGenerator([half], D, beam_size=3)
    gen.generate([half], make_sample(D, random_sentences(D, RepackedLinears.MIN_SOURCES, 5, min_len=2, max_len=6)))
    assert not gen.blocks and not gen.encoders.lins[0]._copies


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                    reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("shape", [(256, 8008), (256, 256), (1024, 256), (7, 5)])
def test_onednn_copies_compute_linear_and_are_made_again_after_refresh(shape):
    """float32 copies are in oneDNN's layout and compute `linear` to rounding, for 2-D rows of any
    count and a block's non-contiguous 3-D input; `refresh` drops them, so a write to `.data`
    between calls is seen through the same plain projection."""
    g = torch.Generator().manual_seed(0)
    lin, layer = RepackedLinears(), torch.nn.Linear(*shape)
    x = torch.randn(300, shape[0], generator=g)
    tol = dict(rtol=1e-4, atol=1e-4 * shape[0] ** 0.5)
    with torch.no_grad():
        lin.refresh(RepackedLinears.MIN_SOURCES)
        proj = plain_projection(layer)
        assert torch.allclose(lin(proj, x), layer(x), **tol)
        assert lin._copies[id(proj)][1].is_mkldnn  # the oneDNN copy, not the transposed one
        for m in (0, 1, 5, 33, 299):
            assert torch.allclose(lin(proj, x[:m]), layer(x[:m]), **tol), m
        block = x[:60].view(6, 10, shape[0]).transpose(0, 1)  # [10, 6, in], not contiguous
        assert torch.allclose(lin(proj, block), layer(block), **tol)
        layer.weight.data.mul_(2.0)  # in place, as fairseq's optimizers write: the tensor records nothing
        lin.refresh(RepackedLinears.MIN_SOURCES)
        assert torch.allclose(lin(proj, x), layer(x), **tol)


@pytest.mark.parametrize("decoding", ["beam", "var-stream", "iad"])
def test_a_parameter_replaced_between_calls_is_read(decoding):
    """The lean math reads the layers' parameters through plain attributes taken at the start of
    each generate call (plain_layer): a parameter object replaced after one call (an in-place
    write needs nothing) is what the next call decodes with, as fairseq's generator would."""
    model = random_transformer(D, 4).double()
    sample = make_sample(D, random_sentences(D, 5, 9, min_len=2, max_len=8))
    gen = (AggressiveGenerator([model], D) if decoding == "iad"
           else StreamBeamGenerator([model], D, beam_size=3, decoding=decoding))
    gen.generate([model], sample)
    fc1 = model.decoder.layers[0].fc1
    fc1.weight = torch.nn.Parameter(torch.randn_like(fc1.weight) * 3)  # a new object
    kw = dict(beam_size=1) if decoding == "iad" else dict(beam_size=3)
    fresh = (AggressiveGenerator([model], D) if decoding == "iad"
             else StreamBeamGenerator([model], D, decoding=decoding, **kw))
    assert_same_hypos(gen.generate([model], sample), fresh.generate([model], sample), atol=1e-9)
    if decoding == "beam":
        assert_same_hypos(gen.generate([model], sample), fairseq_generate([model], D, sample, beam_size=3), atol=1e-9)


def test_unsupported_layers_fall_back_to_fairseq():
    assert not supports_lean(random_transformer(D, 1, scale_attn=True).decoder.layers[0])
    assert not supports_lean(random_transformer(D, 1, scale_heads=True).decoder.layers[0])
    assert not supports_lean(random_transformer(D, 1).train().decoder.layers[0])
    retained = random_transformer(D, 1, dropout=0.1)
    retained.decoder.layers[0].dropout_module.apply_during_inference = True  # fairseq --retain-dropout
    assert not supports_lean(retained.decoder.layers[0])
    hooked = random_transformer(D, 1)  # quant-noise works by a forward pre-hook on its Linear
    hooked.decoder.layers[0].fc1.register_forward_pre_hook(lambda module, args: None)
    assert not supports_lean(hooked.decoder.layers[0])
    assert supports_lean(hooked.decoder.layers[1])


@pytest.mark.parametrize("learned", [False, True])
def test_position_table_is_kept_and_follows_its_weights(learned):
    """The block step's cached positional table equals a fresh probe at every length, grows past
    what it holds, and a learned table is recomputed after its weight changes in place."""
    dec = random_transformer(D, 14, decoder_learned_pos=learned).double().decoder
    block = block_step.BlockDecoder(dec)
    with torch.no_grad():
        for length in (3, 2, 9, 40):
            assert torch.equal(block.positions(length, "cpu"), block_step._probe_positions(dec, length, "cpu"))
        assert block._table.size(0) >= 40
        if learned:
            dec.embed_positions.weight.add_(1.0)
            assert torch.equal(block.positions(5, "cpu"), block_step._probe_positions(dec, 5, "cpu"))


@pytest.mark.parametrize("options", [{"scale_attn": True}, {"decoder_normalize_before": True}])
def test_iad_equals_greedy_on_either_path(options):
    m = random_transformer(D, 11, eos_bias=2.0, **options).double()
    s = make_sample(D, random_sentences(D, 8, 12, max_len=12))
    kw = dict(max_len_b=10, min_len=2)
    ref = fairseq_generate([m], D, s, beam_size=1, **kw)
    got = AggressiveGenerator([m], D, budget=Budget(3), **kw).generate([m], s)
    assert_same_hypos(ref, got)


def test_no_encoder_output_means_no_cross_attention_on_both_paths(monkeypatch):
    model = random_transformer(D, 3).double()
    tokens = torch.randint(D.nspecial, len(D), (2, 3), generator=torch.Generator().manual_seed(1))
    steps = torch.arange(3).expand(2, 3)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    empty = {"encoder_out": [], "encoder_padding_mask": []}
    got = []
    for lean in (False, True):
        monkeypatch.setattr(block_step, "lean_supported", lean_supported if lean else (lambda layer: False))
        got.append(forward_block(model.decoder, tokens, steps, empty, {}, pad))
    assert torch.allclose(got[0], got[1], atol=1e-10)


@pytest.mark.parametrize("lean", [True, False])
def test_lone_row_without_masks_equals_masked_blocks(lean, monkeypatch):
    """A lone row's cache cut back after a rejected draft, with no key masks anywhere (no block
    padding, no encoder padding mask, one-slot passes without a causal mask), gives the logits of
    the masked rollback with all-False masks (float64)."""
    monkeypatch.setattr(block_step, "lean_supported", lean_supported if lean else (lambda layer: False))
    model = random_transformer(D, 11).double()
    dec = model.decoder
    sample = make_sample(D, random_sentences(D, 1, 12, min_len=6, max_len=6))
    enc = model.encoder.forward_torchscript(sample["net_input"])
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randint(D.nspecial, len(D), (1, m), generator=g) for m in (4, 1, 3, 1)]
    kept = [2, 1, 3, 1]  # slots each block keeps (the rest is a rejected draft)
    logits = {}
    for masked_path in (True, False):
        cache = KVCache(model, 1)
        state = cache.states[0]
        e = enc if masked_path else without_padding_mask([enc])[0]
        length, out = 0, []
        for i, (tokens, keep) in enumerate(zip(blocks, kept)):
            m = tokens.size(1)
            steps = length + torch.arange(m).unsqueeze(0)
            ee = e if i == 0 else stand_in(model, 1, tokens.device)[0]
            pad = torch.zeros(1, m, dtype=torch.bool) if masked_path else None
            out.append(forward_block(dec, tokens, steps, ee, state, pad))
            total = cache.length
            if masked_path:
                mask = torch.zeros(1, total, dtype=torch.bool)
                mask[0, total - m + keep:] = True
                cache.mask(mask)
            else:
                cache.truncate(total - m + keep)
            length += keep
        logits[masked_path] = out
        buf = dec.layers[0].self_attn._get_input_buffer(state)
        assert (buf.get("prev_key_padding_mask") is None) == (not masked_path)  # no mask was ever made
    for a, b in zip(logits[True], logits[False]):
        assert torch.allclose(a, b, atol=1e-10)


def test_merging_a_cache_without_masks_masks_its_padding():
    """A cohort whose cache has no key mask, merged with one of longer keys: its padded slots
    are masked (they hold zero keys, which would otherwise get attention weight)."""
    short = {"a": {"prev_key": torch.ones(1, 2, 3, 4), "prev_value": torch.ones(1, 2, 3, 4),
                   "prev_key_padding_mask": None}}
    long = {"a": {"prev_key": torch.ones(2, 2, 5, 4), "prev_value": torch.ones(2, 2, 5, 4),
                  "prev_key_padding_mask": torch.tensor([[False] * 5, [False] * 4 + [True]])}}
    merged = cat_states([short, long])["a"]
    assert merged["prev_key"].shape == (3, 2, 5, 4)
    assert merged["prev_key_padding_mask"].tolist() == [[False] * 3 + [True] * 2, [False] * 5,
                                                        [False] * 4 + [True]]


@torch.no_grad()  # as generators decode: the reorder-and-append writes into one buffer (no autograd)
def test_rows_read_encoder_keys_cached_per_source():
    """Rows reading their sources' encoder keys through SourceGroups (one cached row per source,
    sources with 0 to 3 rows, in any grid shape) get the logits of rows with their own copies, over
    three steps with reorders between them that move rows across sources, which the per-source
    cache's self-attention keys follow only in the next step's append (float64)."""
    model = random_transformer(D, 12).double()
    sample = make_sample(D, random_sentences(D, 4, 13, min_len=2, max_len=9))
    enc = model.encoder.forward_torchscript(sample["net_input"])
    row_src = torch.tensor([0, 0, 2, 2, 2, 3])  # source 1 has no live row
    per_row = KVCache(model, 4)
    per_row.prime([model.encoder.reorder_encoder_out(enc, row_src)])
    per_src = KVCache(model, 4, per_source=True)
    per_src.prime([enc])
    block = BlockDecoder(model.decoder)
    g = torch.Generator().manual_seed(1)
    for step, parents in enumerate([[1, 0, 4, 4, 3, 5], [1, 1, 2, 4, 3, 5], None]):
        tokens = torch.randint(D.nspecial, len(D), (len(row_src), 1), generator=g)
        positions = torch.full_like(tokens, step)
        ref = block(tokens, positions, stand_in(model, len(row_src), tokens.device)[0], per_row.states[0], None)
        groups = SourceGroups.of_rows(row_src, row_src.numpy(), 4)
        assert groups.width == 3 and groups.pos is not None
        got = block(tokens, positions, stand_in(model, len(row_src), tokens.device)[0], per_src.states[0], None,
                    groups=groups, rows=per_src.take_pending())
        assert torch.allclose(ref, got, atol=1e-10), step
        if parents is not None:  # rows follow back-pointers within their sources
            per_row.reorder(torch.tensor(parents))
            per_src.reorder(torch.tensor(parents))
            assert per_src.pending is not None and per_src.length == per_row.length
    per_row.reorder(torch.tensor([5, 4, 3, 2, 1, 0]))  # two reorders in a row, then applied at once
    per_row.reorder(torch.tensor([0, 0, 2, 2, 4, 4]))
    per_src.reorder(torch.tensor([5, 4, 3, 2, 1, 0]))
    per_src.reorder(torch.tensor([0, 0, 2, 2, 4, 4]))
    per_src.flush()
    assert per_src.pending is None
    for layer in model.decoder.layers:
        a, b = (layer.self_attn._get_input_buffer(c.states[0]) for c in (per_row, per_src))
        for name in ("prev_key", "prev_value"):  # equal to rounding: the layers below attended in other shapes
            assert torch.allclose(a[name], b[name], atol=1e-10)
    full = torch.tensor([0, 0, 1, 1])
    assert SourceGroups.of_rows(full, full.numpy(), 2).pos is None  # a full grid in row order: no copies
    with pytest.raises(ValueError, match="sorted by source"):
        SourceGroups.of_rows(torch.tensor([1, 0]), torch.tensor([1, 0]).numpy(), 2)


def test_per_source_cache_keeps_encoder_keys_on_reorder_and_drops_sources():
    model = random_transformer(D, 14).double()
    sample = make_sample(D, random_sentences(D, 3, 15, min_len=2, max_len=9))
    enc = model.encoder.forward_torchscript(sample["net_input"])
    cache = KVCache(model, 3, per_source=True)
    cache.prime([enc])
    cross = model.decoder.layers[0].encoder_attn
    keys = cross._get_input_buffer(cache.states[0])["prev_key"]
    cache.reorder(torch.tensor([0, 0, 1, 2, 2]))
    assert cross._get_input_buffer(cache.states[0])["prev_key"] is keys  # one row per source still
    cache.select_sources(torch.tensor([0, 2]))
    assert torch.equal(cross._get_input_buffer(cache.states[0])["prev_key"], keys[[0, 2]])
    with pytest.raises(ValueError, match="per-source"):
        cache.select(torch.tensor([0]))
