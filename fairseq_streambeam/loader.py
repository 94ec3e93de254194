"""The task and the models for the front ends beside fairseq's own commands (the benchmark,
decode_corpus, calibrate, the GPU script); the task validates its options before any model loads."""

from __future__ import annotations

from typing import Any, List

import torch
from fairseq import checkpoint_utils, utils

from .options import StreamBeamConfig
from .spec import UsageError
from .task import StreamBeamTranslationTask


def load_task(data: str, source_lang: str, target_lang: str, **options: Any) -> StreamBeamTranslationTask:
    """The plugin's task over the dictionaries in `data`, with plugin options `options`."""
    # the three fields fairseq fills from its dataset config by interpolation
    cfg = StreamBeamConfig(data=data, source_lang=source_lang, target_lang=target_lang, train_subset="train",
                           dataset_impl=None, required_seq_len_multiple=1, **options)
    return StreamBeamTranslationTask.setup_task(cfg)


def load_models(task: StreamBeamTranslationTask, path: str, cuda: bool = False, fp16: bool = False) -> List:
    """The checkpoints of `path` (colon-separated: an ensemble) in eval mode, on CUDA if asked,
    in half precision if asked."""
    models, _ = checkpoint_utils.load_model_ensemble(utils.split_paths(path), task=task)
    for m in models:
        m.eval()
        if fp16:
            m.half()
        if cuda:
            m.cuda()
    return models


def wants_cuda(device: str) -> bool:
    """--device auto|cuda|cpu as a yes/no; asking for CUDA without a GPU is a one-line error."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())
