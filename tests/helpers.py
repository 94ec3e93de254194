"""Shared test helpers: tiny random fairseq transformers, real checkpoints, samples, comparisons."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.models.transformer import TransformerModel, tiny_architecture
from fairseq.sequence_generator import SequenceGenerator

import fairseq_streambeam  # noqa: F401  (registers the task, safe globals)
from fairseq_streambeam import StreamBeamGenerator
from fairseq_streambeam.generators.aggressive import Block

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
N_TEST = 61  # sentences of the tiny CLI test set: not a multiple of the batch sizes used, nor of 8
SHARED = Path(os.environ.get("STREAMBEAM_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """Path inside ../shared, or skip the test when it is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not available (set STREAMBEAM_SHARED)")
    return p


def make_dict(n_symbols: int) -> Dictionary:
    d = Dictionary()
    for i in range(n_symbols):
        d.add_symbol(f"w{i}")
    return d


class _Task:
    def __init__(self, d: Dictionary):
        self.source_dictionary = d
        self.target_dictionary = d


def random_transformer(d: Dictionary, seed: int, layers: int = 2, dim: int = 32, peaky: float = 2.0,
                       eos_bias: float = 4.0, **options) -> TransformerModel:
    """A tiny random-weight fairseq transformer. `peaky` scales the output embeddings so the
    distributions are far from uniform, as in trained models; `eos_bias` makes EOS likelier;
    `options` are further fairseq transformer arguments (e.g. decoder_normalize_before=True)."""
    torch.manual_seed(seed)
    args = argparse.Namespace(
        encoder_layers=layers, decoder_layers=layers, encoder_embed_dim=dim, decoder_embed_dim=dim,
        encoder_ffn_embed_dim=2 * dim, decoder_ffn_embed_dim=2 * dim, encoder_attention_heads=2,
        decoder_attention_heads=2, share_all_embeddings=False, share_decoder_input_output_embed=False,
        max_source_positions=256, max_target_positions=256, dropout=0.0,
    )
    tiny_architecture(args)
    args.encoder_layers = args.decoder_layers = layers
    args.encoder_embed_dim = args.decoder_embed_dim = dim
    args.encoder_ffn_embed_dim = args.decoder_ffn_embed_dim = 2 * dim
    for name, value in options.items():
        setattr(args, name, value)
    model = TransformerModel.build_model(args, _Task(d))
    old = model.decoder.output_projection
    proj = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        proj.weight.copy_(old.weight * peaky)
        proj.bias.zero_()
        proj.bias[d.eos()] = eos_bias
    model.decoder.output_projection = proj
    return model.eval()


def random_drafter(d: Dictionary, seed: int, k: int = 4, layers: int = 1, dim: int = 32):
    """A random-weight block_drafter for dictionary `d` (drafts nonsense: verification must cope);
    `.build_args` is the Namespace it was built from, as a checkpoint's cfg.model would hold it."""
    from fairseq_streambeam.models.block_drafter import BlockDrafterModel, block_drafter_architecture

    torch.manual_seed(seed)
    args = argparse.Namespace(arch="block_drafter",
        encoder_layers=layers, decoder_layers=layers, encoder_embed_dim=dim, decoder_embed_dim=dim,
        encoder_ffn_embed_dim=2 * dim, decoder_ffn_embed_dim=2 * dim, encoder_attention_heads=2,
        decoder_attention_heads=2, share_all_embeddings=False, share_decoder_input_output_embed=False,
        max_source_positions=256, max_target_positions=256, dropout=0.0, draft_block_size=k,
    )
    block_drafter_architecture(args)
    model = BlockDrafterModel.build_model(args, _Task(d)).eval()
    model.build_args = args
    return model


def load_checkpoints(*paths: Path, data: Optional[Path] = None, **overrides):
    """Load real fairseq checkpoints; `data` points the saved task at a local data-bin."""
    if data is not None:
        overrides["data"] = str(data)
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(p) for p in paths], arg_overrides=overrides)
    for m in models:
        m.eval()
    return models, task


def gec_tiny():
    """The gec-tiny checkpoint (skips without ../shared) and its task with the CoNLL-14 test set loaded."""
    root = shared_path("models", "gec-tiny")
    models, task = load_checkpoints(root / "checkpoint_best.pt", data=root / "data-bin", source_lang="src",
                                    target_lang="trg")
    task.load_dataset("test")
    return models, task


def gec_sample(task, step: int) -> dict:
    """Every `step`-th sentence of gec-tiny's test set, as a batch."""
    ds = task.dataset("test")
    return make_sample(task.target_dictionary, [ds.src[i][:-1].tolist() for i in range(0, len(ds), step)])


def make_sample(d: Dictionary, sentences: List[List[int]], left_pad: bool = True) -> dict:
    """A fairseq translation batch (source only) from lists of token ids (EOS appended)."""
    toks = [torch.tensor(s + [d.eos()], dtype=torch.long) for s in sentences]
    ds = LanguagePairDataset(toks, [t.numel() for t in toks], d, left_pad_source=left_pad)
    return ds.collater([ds[i] for i in range(len(toks))])


def random_sentences(d: Dictionary, n: int, seed: int, min_len: int = 1, max_len: int = 12) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(d.nspecial, len(d), (length,), generator=g).tolist())
    return out


def fairseq_generate(models, d, sample, **kw):
    gen = SequenceGenerator(models, d, **kw)
    return gen.generate(models, sample)


def ours(models, d, sample, **kw):
    gen = StreamBeamGenerator(models, d, **kw)
    return gen.generate(models, sample), gen


def assert_same_hypos(a, b, nbest: Optional[int] = None, atol: float = 1e-4, msg: str = ""):
    """Same token ids (every hypothesis, in order) and scores within atol."""
    assert len(a) == len(b), msg
    for i, (ha, hb) in enumerate(zip(a, b)):
        ha, hb = (ha[:nbest], hb[:nbest]) if nbest else (ha, hb)
        assert len(ha) == len(hb), f"{msg} sentence {i}: {len(ha)} vs {len(hb)} hypotheses"
        for j, (x, y) in enumerate(zip(ha, hb)):
            assert x["tokens"].tolist() == y["tokens"].tolist(), f"{msg} sentence {i} hypo {j} tokens differ"
            assert abs(float(x["score"]) - float(y["score"])) <= atol, f"{msg} sentence {i} hypo {j} score"
            assert torch.allclose(x["positional_scores"].float(), y["positional_scores"].float(), atol=atol), \
                f"{msg} sentence {i} hypo {j} positional scores"


def run_cli(args, env_extra=None, **kw):
    """Run a console script with one thread and a minimal environment."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": str(BIN) + ":/usr/bin:/bin",
           **(env_extra or {})}
    return subprocess.run(args, capture_output=True, text=True, env=env, **kw)


def block_of(tokens: torch.Tensor, pad=None) -> Block:
    """A verification block of `tokens` [N, m] with host padding `pad` (none by default)."""
    pad = np.zeros(tuple(tokens.shape), dtype=bool) if pad is None else np.asarray(pad)
    zeros = np.zeros(pad.shape, dtype=np.int64)
    return Block(tokens, [int((~p[1:]).sum()) for p in pad], pad, zeros, zeros.astype(bool), None, None, None)


def spy_loaded_dtypes(monkeypatch) -> list:
    """The dtype of each model that fairseq_streambeam.loader.load_models loads from now on (as
    str), for tests of options such as --fp16."""
    import fairseq_streambeam.loader as loader

    dtypes: list = []
    real = loader.load_models

    def spy(*a, **kw):
        models = real(*a, **kw)
        dtypes.extend(str(next(m.parameters()).dtype) for m in models)
        return models

    monkeypatch.setattr(loader, "load_models", spy)
    return dtypes
