"""Beam modes on fairseq encoder-decoders other than the transformer: LSTM, fconv, and a custom
model whose encoder returns fairseq's legacy `EncoderOut` namedtuple (batch-first, as fairseq's own
test models). Their state goes through the model's own reorder methods; cohorts are never merged.
`beam` == fairseq's SequenceGenerator, var-stream == var-batch (float64), any budget. Also
transformer variants a differential fuzz found broken: adaptive softmax, learned positions up to
the table's end, and feature inputs (refused)."""

from __future__ import annotations

import argparse

import pytest
import torch
from fairseq import utils
from fairseq.models import FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder
from fairseq.models.fairseq_encoder import EncoderOut
from fairseq.models.fconv import FConvModel
from fairseq.models.fconv import base_architecture as fconv_architecture
from fairseq.models.lstm import LSTMModel
from fairseq.models.lstm import base_architecture as lstm_architecture
from helpers import assert_same_hypos, fairseq_generate, make_dict, make_sample, ours, random_sentences

from fairseq_streambeam import Budget

D = make_dict(30)


class _Task:
    source_dictionary = D
    target_dictionary = D


class TupleEncoder(FairseqEncoder):
    """Embeds the source and returns the legacy EncoderOut namedtuple, batch first [B, T, C]."""

    def __init__(self, dim: int):
        super().__init__(D)
        self.embed = torch.nn.Embedding(len(D), dim, padding_idx=D.pad())

    def forward(self, src_tokens, src_lengths=None, **kwargs):
        return EncoderOut(encoder_out=self.embed(src_tokens), encoder_padding_mask=src_tokens.eq(D.pad()),
                          encoder_embedding=None, encoder_states=None, src_tokens=None, src_lengths=None)

    def reorder_encoder_out(self, encoder_out, new_order):
        return encoder_out._replace(encoder_out=encoder_out.encoder_out.index_select(0, new_order),
                                    encoder_padding_mask=encoder_out.encoder_padding_mask.index_select(0, new_order))


class GRUDecoder(FairseqIncrementalDecoder):
    """A GRU cell with dot-product attention over the EncoderOut; its hidden state lives in the
    incremental state and is reordered by `reorder_incremental_state`."""

    def __init__(self, dim: int):
        super().__init__(D)
        self.embed = torch.nn.Embedding(len(D), dim, padding_idx=D.pad())
        self.cell = torch.nn.GRUCell(2 * dim, dim)
        self.out = torch.nn.Linear(dim, len(D))
        self.dim = dim

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        if incremental_state is None:
            raise NotImplementedError("this test decoder runs incrementally only")
        h = utils.get_incremental_state(self, incremental_state, "hidden")
        x = self.embed(prev_output_tokens[:, -1])
        if h is None:
            h = x.new_zeros(x.size(0), self.dim)
        mem = encoder_out.encoder_out  # [B, T, C]
        att = torch.bmm(mem, h.unsqueeze(2)).squeeze(2).masked_fill(encoder_out.encoder_padding_mask, -torch.inf)
        ctx = torch.bmm(att.softmax(1).unsqueeze(1), mem).squeeze(1)
        h = self.cell(torch.cat([x, ctx], 1), h)
        utils.set_incremental_state(self, incremental_state, "hidden", h)
        return 3 * self.out(h).unsqueeze(1), {"attn": [None]}

    def reorder_incremental_state(self, incremental_state, new_order):
        h = utils.get_incremental_state(self, incremental_state, "hidden")
        if h is not None:
            utils.set_incremental_state(self, incremental_state, "hidden", h.index_select(0, new_order))

    def max_positions(self):
        return 256


def tuple_model(seed: int, dim: int = 16):
    torch.manual_seed(seed)
    return FairseqEncoderDecoderModel(TupleEncoder(dim), GRUDecoder(dim)).eval()


def lstm_model(seed: int, dim: int = 16):
    torch.manual_seed(seed)
    args = argparse.Namespace(encoder_embed_dim=dim, decoder_embed_dim=dim, decoder_out_embed_dim=dim,
                              encoder_hidden_size=dim, decoder_hidden_size=dim, encoder_layers=1,
                              decoder_layers=1, dropout=0.0, max_source_positions=256, max_target_positions=256,
                              criterion="cross_entropy")
    lstm_architecture(args)
    model = LSTMModel.build_model(args, _Task())
    with torch.no_grad():  # sharper distributions than the default initialisation, as trained models have
        model.decoder.fc_out.weight.mul_(20)
    return model.eval()


def fconv_model(seed: int, dim: int = 16):
    torch.manual_seed(seed)
    args = argparse.Namespace(encoder_embed_dim=dim, decoder_embed_dim=dim, decoder_out_embed_dim=dim,
                              encoder_layers=f"[({dim}, 3)] * 2", decoder_layers=f"[({dim}, 3)] * 2",
                              decoder_attention="True", dropout=0.0, max_source_positions=256,
                              max_target_positions=256, share_input_output_embed=False)
    fconv_architecture(args)
    model = FConvModel.build_model(args, _Task())
    with torch.no_grad():
        model.decoder.fc3.weight_v.mul_(4)
    return model.eval()


BUILDERS = {"tuple-encoder-out": tuple_model, "lstm": lstm_model, "fconv": fconv_model}


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("beam", [1, 4])
def test_beam_matches_fairseq_for_each_type(kind, beam):
    models = [BUILDERS[kind](0)]
    s = make_sample(D, random_sentences(D, 7, 3, max_len=9))
    kw = dict(beam_size=beam, max_len_b=12)
    ref = fairseq_generate(models, D, s, **kw)
    assert any(len(h[0]["tokens"]) > 2 for h in ref), "degenerate model: every output is empty"
    assert_same_hypos(ref, ours(models, D, s, **kw)[0])
    assert_same_hypos(ref, ours(models, D, s, decoding="fixed-stream", budget=Budget(2), **kw)[0])


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_var_stream_equals_var_batch_for_each_type(kind):
    models = [BUILDERS[kind](1).double()]
    s = make_sample(D, random_sentences(D, 9, 4, max_len=10))
    kw = dict(beam_size=5, max_len_b=12)
    ref, _ = ours(models, D, s, decoding="var-batch", **kw)
    for n in (1, 3):
        got, gen = ours(models, D, s, decoding="var-stream", budget=Budget(n), **kw)
        assert_same_hypos(ref, got, atol=1e-5, msg=f"budget {n}")
        assert not gen.mergeable


def test_ensemble_of_two_model_types():
    models = [lstm_model(2), tuple_model(3)]
    s = make_sample(D, random_sentences(D, 6, 5, max_len=8))
    kw = dict(beam_size=3, max_len_b=10)
    assert_same_hypos(fairseq_generate(models, D, s, **kw), ours(models, D, s, **kw)[0])


def test_fconv_prepared_with_beamable_mm():
    """fairseq-generate prepares fconv models with BeamableMM for --beam rows per source (unless
    --no-beamable-mm); beams of any width must not use it."""
    s = make_sample(D, random_sentences(D, 7, 6, max_len=9))
    kw = dict(beam_size=4, max_len_b=12)
    plain = [fconv_model(4)]
    ref = fairseq_generate(plain, D, s, **kw)
    var = ours(plain, D, s, decoding="var-batch", **kw)[0]
    for decoding, want in (("beam", ref), ("fixed-stream", ref), ("var-stream", var)):
        prepared = fconv_model(4)
        prepared.make_generation_fast_(beamable_mm_beam_size=4)
        assert_same_hypos(want, ours([prepared], D, s, decoding=decoding, budget=Budget(3), **kw)[0], msg=decoding)


def _transformer(seed: int, **options):
    """A tiny fairseq transformer built from `options` as given (adaptive softmax, learned positions)."""
    from fairseq.models.transformer import TransformerModel, tiny_architecture

    torch.manual_seed(seed)
    args = argparse.Namespace(**{**dict(encoder_layers=2, decoder_layers=2, encoder_embed_dim=24,
                                        decoder_embed_dim=24, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
                                        encoder_attention_heads=2, decoder_attention_heads=2, dropout=0.0,
                                        max_source_positions=64, max_target_positions=64), **options})
    tiny_architecture(args)
    for name, value in options.items():
        setattr(args, name, value)
    model = TransformerModel.build_model(args, _Task())
    with torch.no_grad():
        for p in getattr(model.decoder.adaptive_softmax, "head", torch.nn.Module()).parameters():
            p.mul_(3)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adaptive_softmax_decodes_in_every_mode(dtype):
    """fairseq's adaptive softmax reads [B, T, C] features (IAD verifies packed real slots [T, C])
    and keeps float64 log-probs (the beam scores are float32)."""
    from fairseq_streambeam.generators.aggressive import AggressiveGenerator

    m = _transformer(0, adaptive_softmax_cutoff="10,18", adaptive_softmax_dropout=0.0).to(dtype)
    s = make_sample(D, random_sentences(D, 7, 100, max_len=9))
    kw = dict(max_len_b=12)
    assert_same_hypos(fairseq_generate([m], D, s, beam_size=4, **kw), ours([m], D, s, beam_size=4, **kw)[0])
    assert_same_hypos(fairseq_generate([m], D, s, beam_size=1, **kw),
                      AggressiveGenerator([m], D, beam_size=1, **kw).generate([m], s))
    ref, _ = ours([m], D, s, beam_size=4, decoding="var-batch", **kw)
    assert_same_hypos(ref, ours([m], D, s, beam_size=4, decoding="var-stream", budget=Budget(3), **kw)[0])


def test_iad_with_learned_positions_up_to_the_last():
    """Outputs as long as the learned position table allows, in batches: padded block slots past
    a row's limit must not read positions beyond the table."""
    from fairseq_streambeam.generators.aggressive import AggressiveGenerator

    m = _transformer(0, max_target_positions=8, decoder_learned_pos=True)
    s = make_sample(D, random_sentences(D, 7, 0, max_len=9))
    ref = fairseq_generate([m], D, s, beam_size=1)
    assert max(len(h[0]["tokens"]) for h in ref) == 8
    assert_same_hypos(ref, AggressiveGenerator([m], D, beam_size=1).generate([m], s))


def test_lstm_alignment_on_left_padded_sources_matches_fairseq():
    """fairseq's LSTMEncoder re-pads left-padded sources to the right: its attention holds each
    source at positions 0..n-1, and the alignments are read from there."""
    from fairseq.sequence_generator import SequenceGeneratorWithAlignment

    models = [lstm_model(63).double()]
    s = make_sample(D, random_sentences(D, 6, 68, max_len=9), left_pad=True)
    kw = dict(beam_size=3, max_len_b=10, print_alignment="hard")
    ref = SequenceGeneratorWithAlignment(models, D, **kw).generate(models, s)
    var = ours(models, D, s, decoding="var-batch", **kw)[0]
    for decoding, want in (("beam", ref), ("fixed-stream", ref), ("var-stream", var)):
        got = ours(models, D, s, decoding=decoding, budget=Budget(3), **kw)[0]
        assert_same_hypos(want, got, msg=decoding)
        for a, b in zip(want, got):
            for x, y in zip(a, b):
                assert x["alignment"] == y["alignment"], decoding
                assert torch.allclose(x["attention"].double(), y["attention"].double(), atol=1e-6), decoding


def test_sources_that_are_not_token_ids_are_refused():
    """Speech models read features [B, T, F]: one clear error instead of a failure deep inside."""
    from fairseq_streambeam.spec import UsageError

    m = lstm_model(0)
    s = make_sample(D, random_sentences(D, 2, 1, max_len=5))
    s["net_input"]["src_tokens"] = torch.randn(2, 5, 8)
    with pytest.raises(UsageError, match="token ids"):
        ours([m], D, s, beam_size=2)
