"""fairseq generation options in the beam modes, against fairseq's own SequenceGenerator.

--no-repeat-ngram-size: fairseq's CUDA kernel blocks a token that would complete an n-gram already
in the prefix; its CPU fallback compares against padding and blocks nothing (fairseq issue #5206).
The reference here is fairseq's generator with a plain-Python blocker that computes what the
kernel computes."""

from __future__ import annotations

import math

import pytest
import torch
from fairseq.ngram_repeat_block import NGramRepeatBlock
from fairseq.sequence_generator import SequenceGenerator
from helpers import (
    assert_same_hypos,
    load_checkpoints,
    make_dict,
    make_sample,
    ours,
    random_sentences,
    random_transformer,
    shared_path,
)

from fairseq_streambeam import Budget
from fairseq_streambeam.search.penalties import block_repeated_ngrams

D = make_dict(12)  # a small vocabulary, so that outputs repeat n-grams and blocking matters


def kernel_bans(prefix: list[int], n: int) -> set[int]:
    """Tokens fairseq's kernel bans after `prefix` (BOS first): t[i+n-1] wherever t[i:i+n-1] equals
    the last n-1 tokens, for i = 0 .. len(prefix) - n."""
    T = len(prefix)
    tail = prefix[T - n + 1:] if n > 1 else []
    return {prefix[i + n - 1] for i in range(T - n + 1) if prefix[i:i + n - 1] == tail}


class KernelBlocker(torch.nn.Module):
    """Stands in for fairseq's NGramRepeatBlock with the kernel's rule (fairseq passes the whole
    token buffer and the step; the prefix is tokens[:, :step + 1])."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, tokens, lprobs, bsz: int, beam_size: int, step: int):
        for row, prefix in enumerate(tokens[:, : step + 1].tolist()):
            for t in kernel_bans(prefix, self.n):
                lprobs[row, t] = -math.inf
        return lprobs


def fairseq_with_blocking(models, d, sample, n, **kw):
    gen = SequenceGenerator(models, d, no_repeat_ngram_size=n, **kw)
    gen.repeat_ngram_blocker = KernelBlocker(n)
    return gen.generate(models, sample)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_block_repeated_ngrams_equals_the_kernel_rule(n):
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(2, 6, (40, 9), generator=g)  # 4 symbols: many repeats
    lprobs = torch.randn(40, 8, generator=g)
    got = lprobs.clone()
    block_repeated_ngrams(got, tokens, n)
    assert torch.isinf(got).sum() >= 10, "the case should ban tokens"
    for row, prefix in enumerate(tokens.tolist()):
        banned = kernel_bans(prefix, n)
        for t in range(8):
            assert got[row, t].item() == (-math.inf if t in banned else lprobs[row, t].item())


def test_fairseq_cpu_fallback_blocks_nothing():
    """Why the reference above is not fairseq's CPU blocker as it stands."""
    tokens = torch.tensor([[2, 5, 6, 5, 1, 1]])  # BOS, 5 6 5, then padding: 5 -> 6 repeats at step 3
    lprobs = torch.zeros(1, 8)
    NGramRepeatBlock(2, use_extension=False)(tokens, lprobs, 1, 1, 3)
    assert not torch.isinf(lprobs).any()
    assert kernel_bans([2, 5, 6, 5], 2) == {6}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("beam", [1, 4])
def test_no_repeat_ngram_matches_fairseq(n, beam):
    m = random_transformer(D, 5, eos_bias=0.0)
    s = make_sample(D, random_sentences(D, 8, 6, max_len=10))
    kw = dict(beam_size=beam, max_len_b=14)
    ref = fairseq_with_blocking([m], D, s, n, **kw)
    unblocked = SequenceGenerator([m], D, **kw).generate([m], s)
    assert any(a[0]["tokens"].tolist() != b[0]["tokens"].tolist() for a, b in zip(ref, unblocked)), \
        "blocking should change some output"
    assert_same_hypos(ref, ours([m], D, s, no_repeat_ngram_size=n, **kw)[0])
    got, _ = ours([m], D, s, no_repeat_ngram_size=n, decoding="fixed-stream", budget=Budget(3), **kw)
    assert_same_hypos(ref, got)


def test_no_repeat_ngram_var_stream_equals_var_batch():
    m = random_transformer(D, 7, eos_bias=0.0).double()
    s = make_sample(D, random_sentences(D, 9, 8, max_len=10))
    kw = dict(beam_size=5, max_len_b=14, no_repeat_ngram_size=2)
    ref, _ = ours([m], D, s, decoding="var-batch", **kw)
    for n in (1, 4):
        assert_same_hypos(ref, ours([m], D, s, decoding="var-stream", budget=Budget(n), **kw)[0], atol=1e-5)


def test_no_repeat_ngram_deen_tiny_matches_fairseq():
    models, task = load_checkpoints(shared_path("models", "deen-tiny", "checkpoint_best.pt"),
                                    data=shared_path("models", "deen-tiny", "data-bin"))
    task.load_dataset("test")
    ds = task.dataset("test")
    s = ds.collater([ds[i] for i in range(12)])
    d = task.target_dictionary
    kw = dict(beam_size=5, max_len_b=40)
    ref = fairseq_with_blocking(models, d, s, 2, **kw)
    assert_same_hypos(ref, ours(models, d, s, no_repeat_ngram_size=2, **kw)[0])


def fairseq_with_alignment(models, d, sample, kind, **kw):
    from fairseq.sequence_generator import SequenceGeneratorWithAlignment

    return SequenceGeneratorWithAlignment(models, d, print_alignment=kind, **kw).generate(models, sample)


def assert_same_attention(ref, got):
    """Same hypotheses, attention matrices in the sample's layout, and alignments."""
    assert_same_hypos(ref, got)
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            assert x["attention"].shape == y["attention"].shape and x["attention"].dtype == y["attention"].dtype
            assert torch.allclose(x["attention"], y["attention"], atol=1e-5)
            if x["alignment"] and isinstance(x["alignment"][0], list):  # soft: probabilities printed to 6 places
                assert len(x["alignment"]) == len(y["alignment"])
                for p, q in zip(x["alignment"], y["alignment"]):
                    assert len(p) == len(q) and all(abs(float(u) - float(v)) <= 2e-6 for u, v in zip(p, q))
            else:
                assert x["alignment"] == y["alignment"]


@pytest.mark.parametrize("kind", ["hard", "soft"])
@pytest.mark.parametrize("left_pad", [True, False])
def test_print_alignment_matches_fairseq(kind, left_pad):
    d = make_dict(40)
    models = [random_transformer(d, 3), random_transformer(d, 4)]
    s = make_sample(d, random_sentences(d, 7, 4), left_pad=left_pad)
    kw = dict(beam_size=4, max_len_b=12)
    ref = fairseq_with_alignment(models, d, s, kind, **kw)
    assert any(len(h[0]["alignment"]) > 2 for h in ref)
    assert_same_attention(ref, ours(models, d, s, print_alignment=kind, **kw)[0])
    got, _ = ours(models, d, s, print_alignment=kind, decoding="fixed-stream", budget=Budget(2), **kw)
    assert_same_attention(ref, got)  # streamed: cohorts merged with padded encoder positions


def test_print_alignment_of_float64_models_matches_fairseq():
    """fairseq's attention is float32 whatever the model's dtype; the history's was promoted to float64."""
    d = make_dict(40)
    m = random_transformer(d, 3).double()
    s = make_sample(d, random_sentences(d, 5, 4))
    kw = dict(beam_size=4, max_len_b=12)
    ref = fairseq_with_alignment([m], d, s, "hard", **kw)
    assert_same_attention(ref, ours([m], d, s, print_alignment="hard", **kw)[0])


def test_print_alignment_var_stream_equals_var_batch():
    d = make_dict(40)
    m = random_transformer(d, 9).double()
    s = make_sample(d, random_sentences(d, 9, 10))
    kw = dict(beam_size=5, max_len_b=12, print_alignment="hard")
    ref, _ = ours([m], d, s, decoding="var-batch", **kw)
    assert all(h["alignment"] for hs in ref for h in hs if len(h["tokens"]) > 1)
    for n in (1, 3):
        got, _ = ours([m], d, s, decoding="var-stream", budget=Budget(n), **kw)
        for a, b in zip(ref, got):
            assert [h["alignment"] for h in a] == [h["alignment"] for h in b]
            assert all(torch.allclose(x["attention"], y["attention"], atol=1e-6) for x, y in zip(a, b))


def test_print_alignment_cli_matches_fairseq(tiny_run):
    """fairseq-generate's A- lines, var-stream and beam against --decoding fairseq."""
    import re

    from helpers import BIN, REPO, run_cli

    data, ckpt = tiny_run

    def generate(*extra):
        r = run_cli([str(BIN / "fairseq-generate"), str(data), "--user-dir", str(REPO / "fairseq_streambeam"),
                     "--task", "streambeam_translation", "--path", str(ckpt), "--gen-subset", "test", "--cpu",
                     "--beam", "4", "--batch-size", "8", "--print-alignment", "hard", *extra])
        assert r.returncode == 0, r.stderr[-2000:]
        # A- lines, and H- lines without their scores (float32 batch composition moves the last digits)
        return sorted(re.sub(r"^(H-\d+)\t[^\t]*", r"\1", x) for x in r.stdout.splitlines()
                      if re.match(r"^[HA]-\d+\t", x))

    ref = generate("--decoding", "fairseq", "--required-batch-size-multiple", "1")
    assert sum(x.startswith("A-") for x in ref) > 10
    assert generate("--decoding", "beam") == ref
    assert generate("--decoding", "fixed-stream") == ref


def random_lm(d, seed: int):
    """A tiny random-weight fairseq transformer_lm over dictionary `d`."""
    import argparse

    from fairseq.models.transformer_lm import TransformerLanguageModel, transformer_lm_gpt2_tiny

    torch.manual_seed(seed)
    args = argparse.Namespace(decoder_layers=1, decoder_embed_dim=32, decoder_ffn_embed_dim=64,
                              decoder_attention_heads=2, dropout=0.0, tokens_per_sample=256, max_target_positions=256)
    transformer_lm_gpt2_tiny(args)
    args.decoder_layers, args.decoder_embed_dim, args.decoder_ffn_embed_dim = 1, 32, 64

    class Task:
        source_dictionary = target_dictionary = d

    return TransformerLanguageModel.build_model(args, Task()).eval()


@pytest.mark.parametrize("beam", [1, 4])
def test_lm_fusion_matches_fairseq(beam):
    d = make_dict(40)
    models, lm = [random_transformer(d, 11)], random_lm(d, 12)
    s = make_sample(d, random_sentences(d, 7, 13))
    kw = dict(beam_size=beam, max_len_b=12, lm_model=lm, lm_weight=0.7)
    ref = SequenceGenerator(models, d, **kw).generate(models, s)
    plain = SequenceGenerator(models, d, beam_size=beam, max_len_b=12).generate(models, s)
    assert any(a[0]["tokens"].tolist() != b[0]["tokens"].tolist() for a, b in zip(ref, plain)), "the LM should matter"
    assert_same_hypos(ref, ours(models, d, s, **kw)[0])
    assert_same_hypos(ref, ours(models, d, s, decoding="fixed-stream", budget=Budget(2), **kw)[0])


def test_lm_fusion_through_the_task_and_var_stream():
    """fairseq-generate hands --lm-path's model to build_generator as extra_gen_cls_kwargs."""
    import argparse

    from fairseq.tasks.translation import TranslationConfig

    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.task import StreamBeamTranslationTask

    d = make_dict(40)
    m, lm = random_transformer(d, 14).double(), random_lm(d, 15).double()
    s = make_sample(d, random_sentences(d, 8, 16))
    base = {f: getattr(TranslationConfig(), f) for f in ("train_subset",)}
    gen_args = argparse.Namespace(beam=5, nbest=1, max_len_b=12)
    out = {}
    for decoding in ("var-batch", "var-stream"):
        task = StreamBeamTranslationTask(StreamBeamConfig(decoding=decoding, **base), d, d)
        gen = task.build_generator([m], gen_args, extra_gen_cls_kwargs={"lm_model": lm, "lm_weight": 0.5})
        if decoding == "var-stream":
            gen.scheduler.budget = Budget(2)
        out[decoding] = gen.generate([m], s)
        assert gen.lm_model is lm and gen.lm_weight == 0.5
    assert_same_hypos(out["var-batch"], out["var-stream"])


def test_build_generator_arguments_are_taken_or_refused():
    """build_generator's other arguments, as fairseq's task reads them: tokens_to_suppress (extra
    kwargs) is applied as fairseq applies it; a prefix function (also as a generation option), an
    unknown extra kwarg and a generator class are refused, never ignored."""
    import argparse

    from fairseq.tasks.translation import TranslationConfig, TranslationTask

    from fairseq_streambeam.options import StreamBeamConfig
    from fairseq_streambeam.spec import UsageError
    from fairseq_streambeam.task import StreamBeamTranslationTask

    d = make_dict(40)
    m = random_transformer(d, 14).double()
    s = make_sample(d, random_sentences(d, 6, 16))
    gen_args = argparse.Namespace(beam=4, nbest=1, max_len_b=12)
    suppress = {"tokens_to_suppress": (d[8], d[9])}
    task = StreamBeamTranslationTask(StreamBeamConfig(decoding="beam", train_subset="train"), d, d)
    fairseq_task = TranslationTask(TranslationConfig(), d, d)
    ref = fairseq_task.build_generator([m], gen_args, extra_gen_cls_kwargs=suppress).generate([m], s)
    gen = task.build_generator([m], gen_args, extra_gen_cls_kwargs=suppress)
    assert sorted(gen.token_indices_to_suppress.tolist()) == [8, 9]
    assert_same_hypos(ref, gen.generate([m], s))
    fn_args = argparse.Namespace(beam=4, nbest=1, max_len_b=12, prefix_allowed_tokens_fn=lambda b, t: [2])
    for args, kwargs, refused in ((fn_args, {}, "prefix_allowed_tokens_fn"),
                                  (gen_args, {"extra_gen_cls_kwargs": {"eos": 3}}, "eos"),
                                  (gen_args, {"seq_gen_cls": SequenceGenerator}, "seq_gen_cls")):
        with pytest.raises(UsageError, match=refused):
            task.build_generator([m], args, **kwargs)


def match_source_len_generator(models, d, **kw) -> SequenceGenerator:
    """fairseq's generator for --match-source-len as its task builds it (fairseq-generate, the hub)."""
    from fairseq.search import LengthConstrainedBeamSearch

    return SequenceGenerator(models, d, search_strategy=LengthConstrainedBeamSearch(d, 1, 0, 1, 0), **kw)


def test_match_source_len_matches_fairseq_per_source():
    """fairseq caps outputs at the batch's longest source; here each source's own length caps its
    output, which is fairseq's result for a source decoded alone (and for equal-length batches):
    every output is exactly as long as its source with EOS."""
    d = make_dict(40)
    m = random_transformer(d, 17, eos_bias=-2.0)  # long outputs, so the cap matters
    sents = random_sentences(d, 6, 18, min_len=2, max_len=9)
    kw = dict(beam_size=4, max_len_b=30, match_source_len=True)
    sample = make_sample(d, sents)
    got, _ = ours([m], d, sample, **kw)
    streamed, _ = ours([m], d, sample, decoding="fixed-stream", budget=Budget(2), **kw)
    assert_same_hypos(got, streamed)
    ragged, _ = ours([m], d, sample, decoding="fixed-stream", stream_order="continuous", budget=Budget(3), **kw)
    assert_same_hypos(got, ragged)  # rows at their own steps
    rows = [sents[i] for i in sample["id"].tolist()]  # the collater sorts sources by length
    for hypos, sent in zip(got, rows):
        ref = match_source_len_generator([m], d, **kw).generate([m], make_sample(d, [sent]))
        assert_same_hypos(ref, [hypos])
        assert all(len(h["tokens"]) == len(sent) + 2 for h in hypos)  # source length with EOS, then EOS


def test_print_alignment_deen_tiny_matches_fairseq():
    models, task = load_checkpoints(shared_path("models", "deen-tiny", "checkpoint_best.pt"),
                                    data=shared_path("models", "deen-tiny", "data-bin"))
    task.load_dataset("test")
    ds = task.dataset("test")
    s = ds.collater([ds[i] for i in range(0, 300, 25)])
    d = task.target_dictionary
    kw = dict(beam_size=5, max_len_b=40)
    ref = fairseq_with_alignment(models, d, s, "hard", **kw)
    assert_same_attention(ref, ours(models, d, s, print_alignment="hard", **kw)[0])


def _deen_tiny_sample(rows):
    models, task = load_checkpoints(shared_path("models", "deen-tiny", "checkpoint_best.pt"),
                                    data=shared_path("models", "deen-tiny", "data-bin"))
    task.load_dataset("test")
    ds = task.dataset("test")
    return models, task.target_dictionary, ds, ds.collater([ds[i] for i in rows])


def test_lm_fusion_deen_tiny_matches_fairseq():
    """deen-tiny with a language model over its target dictionary (random weights: no LM was
    trained for it), fused as fairseq fuses --lm-path."""
    models, d, _, s = _deen_tiny_sample(range(0, 240, 20))
    lm = random_lm(d, 21)
    kw = dict(beam_size=5, max_len_b=40, lm_model=lm, lm_weight=0.3)
    ref = SequenceGenerator(models, d, **kw).generate(models, s)
    plain = SequenceGenerator(models, d, beam_size=5, max_len_b=40).generate(models, s)
    assert any(a[0]["tokens"].tolist() != b[0]["tokens"].tolist() for a, b in zip(ref, plain)), "the LM should matter"
    assert_same_hypos(ref, ours(models, d, s, **kw)[0])


def test_match_source_len_deen_tiny_matches_fairseq_per_source():
    models, d, ds, s = _deen_tiny_sample(range(3, 240, 20))
    kw = dict(beam_size=5, max_len_b=40, match_source_len=True)
    got = ours(models, d, s, **kw)[0]
    assert_same_hypos(got, ours(models, d, s, decoding="fixed-stream", budget=Budget(3), **kw)[0])
    for hypos, i in zip(got, s["id"].tolist()):
        ref = match_source_len_generator(models, d, **kw).generate(models, ds.collater([ds[i]]))
        assert_same_hypos(ref, [hypos])


@pytest.mark.parametrize("decoding", ["beam", "var-stream", "iad"])
def test_an_extreme_lenpen_gives_scores_instead_of_an_overflow(decoding):
    """n ** 400 overflows a Python float for n >= 6 (fairseq raises OverflowError, and a server's
    whole batch failed with it): the normalizer is inf there, so such hypotheses score -0.0. Below
    the overflow the scores are the normalized ones."""
    m = random_transformer(D, 3)
    s = make_sample(D, random_sentences(D, 4, 5, max_len=8))
    kw = dict(max_len_b=12, min_len=7, len_penalty=400.0)
    if decoding == "iad":
        from fairseq_streambeam.generators.aggressive import AggressiveGenerator

        hyps = AggressiveGenerator([m], D, decoding="iad", beam_size=1, **kw).generate([m], s)
    else:
        hyps, _ = ours([m], D, s, decoding=decoding, beam_size=3, **kw)
    for nbest in hyps:
        for h in nbest:
            n = len(h["tokens"])
            assert n >= 7 and h["score"].item() == 0.0 and math.copysign(1, h["score"].item()) == -1.0


def test_generate_builds_no_autograd_graph_when_called_directly():
    """fairseq's generate() runs under no_grad; _generate (which some callers use) must too."""
    from fairseq_streambeam import StreamBeamGenerator

    m = random_transformer(D, 3)
    s = make_sample(D, random_sentences(D, 3, 5, max_len=6))
    with torch.enable_grad():
        out = StreamBeamGenerator([m], D, beam_size=2, max_len_b=6)._generate(s)
    assert not any(h["score"].requires_grad or h["positional_scores"].requires_grad for hs in out for h in hs)
