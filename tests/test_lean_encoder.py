"""runtime.lean_encoder computes fairseq's transformer encoder output bit for bit (float32, the
dtype models run in), with and without padding, pre- and post-norm, learned positions and an
embedding layer norm; encoders it does not implement fall back to fairseq's forward."""

import pytest
import torch
from helpers import (
    gec_tiny,
    make_dict,
    make_sample,
    random_drafter,
    random_sentences,
    random_transformer,
)

from fairseq_streambeam.runtime.lean_encoder import encode, supports_lean_encoder

D = make_dict(30)


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert len(a[key]) == len(b[key]), key
        for x, y in zip(a[key], b[key]):
            assert x.shape == y.shape and x.dtype == y.dtype, key
            assert torch.equal(x, y), f"{key}: max diff {(x.double() - y.double()).abs().max()}"


@pytest.mark.parametrize("options", [
    {},
    {"encoder_normalize_before": True},
    {"encoder_learned_pos": True, "layernorm_embedding": True},
    {"no_token_positional_embeddings": True, "encoder_attention_heads": 4},
])
@pytest.mark.parametrize("lengths", [(1, 12), (7, 7)])  # padded batch; one without padding
def test_lean_encoder_equals_fairseq_bitwise(options, lengths):
    model = random_transformer(D, 3, **options)
    assert supports_lean_encoder(model.encoder)
    sentences = random_sentences(D, 6, seed=1, min_len=lengths[0], max_len=lengths[1])
    net = make_sample(D, sentences)["net_input"]
    with torch.no_grad():
        _assert_same(encode(model.encoder, net), model.encoder.forward_torchscript(net))


def test_block_drafter_encoder_takes_the_lean_path():
    drafter = random_drafter(D, 2)
    assert supports_lean_encoder(drafter.encoder)
    net = make_sample(D, random_sentences(D, 4, seed=5))["net_input"]
    with torch.no_grad():
        _assert_same(encode(drafter.encoder, net), drafter.encoder.forward_torchscript(net))


def test_unsupported_encoders_fall_back_to_fairseq():
    model = random_transformer(D, 4)
    model.encoder.train()
    assert not supports_lean_encoder(model.encoder)
    retained = random_transformer(D, 5, dropout=0.1)
    retained.encoder.layers[0].dropout_module.apply_during_inference = True  # fairseq --retain-dropout
    assert not supports_lean_encoder(retained.encoder)
    hooked = random_transformer(D, 6)
    hooked.encoder.layers[1].self_attn.k_proj.register_forward_hook(lambda module, args, out: None)
    assert not supports_lean_encoder(hooked.encoder)
    net = make_sample(D, random_sentences(D, 3, seed=2))["net_input"]
    torch.manual_seed(0)
    with torch.no_grad():
        ours = encode(retained.encoder, net)["encoder_out"][0]
    torch.manual_seed(0)
    with torch.no_grad():
        ref = retained.encoder.forward_torchscript(net)["encoder_out"][0]
    assert torch.equal(ours, ref)  # the same dropout draws: fairseq's own forward ran


def test_lean_encoder_equals_fairseq_on_the_gec_checkpoint():
    models, task = gec_tiny()
    ds = task.dataset("test")
    encoder = models[0].encoder
    assert supports_lean_encoder(encoder)
    for start in (0, 500):
        net = ds.collater([ds[i] for i in range(start, start + 24)])["net_input"]
        with torch.no_grad():
            _assert_same(encode(encoder, net), encoder.forward_torchscript(net))
