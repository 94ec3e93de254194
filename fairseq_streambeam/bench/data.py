"""Benchmark inputs: a fairseq data-bin split, or raw source/reference files encoded with fairseq's
own tokenizer/BPE classes (moses + fastBPE for the WMT'19 models, sentencepiece for deen-tiny)."""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from fairseq.data import BaseWrapperDataset, LanguagePairDataset

from ..textio import BPES, TextCodec, read_lines, tokenizers


@dataclass
class TestSet:
    dataset: LanguagePairDataset
    refs: List[str]  # detokenized reference per dataset index
    decode: Callable[[List[int]], str]  # hypothesis token ids -> detokenized text
    src_symbols: List[List[str]]  # source tokens as dictionary symbols (for CTranslate2)
    orig_ids: List[int]  # sentence id in the full test set of each dataset index (for LMBR posteriors)


class CorpusOrder(BaseWrapperDataset):
    """A dataset batched in corpus order: fairseq sorts sentences by length before batching, which
    hides the long tails of unsorted batches (sentences arriving as they come, e.g. a service)."""

    def ordered_indices(self):
        return np.arange(len(self), dtype=np.int64)


class Head(BaseWrapperDataset):
    """The first `n` sentences in the wrapped dataset's decoding order: a warm-up that is one batch
    for every method (a streaming decoding would otherwise take a whole window of batches)."""

    def __init__(self, dataset, n: int):
        super().__init__(dataset)
        self.n = n

    def ordered_indices(self):
        return self.dataset.ordered_indices()[: self.n]


def add_input_args(g, subset: str) -> None:
    """The options that name a test set, for the bench and calibrate: a data-bin split (default
    `subset`), or raw source and reference files with fairseq's tokenizer and BPE."""
    g.add_argument("--gen-subset", default=subset, help="data-bin split (when --src is not given)")
    g.add_argument("--src", help="raw source file (instead of a data-bin split); needs --ref")
    g.add_argument("--ref", help="raw (detokenized) reference file")
    g.add_argument("--tokenizer", default="none", choices=tokenizers(), help="fairseq tokenizer for --src")
    g.add_argument("--bpe", default="none", choices=BPES, help="fairseq BPE for --src")
    g.add_argument("--bpe-codes", help="fastBPE codes (with --bpe fastbpe)")
    g.add_argument("--sentencepiece-model", help="with --bpe sentencepiece")
    g.add_argument("--post-process", default="sentencepiece",
                   help="how a data-bin's tokens are detokenized for BLEU (fairseq --post-process)")


def _every(n: int, limit: int, lines: Optional[Tuple[int, int]] = None) -> List[int]:
    """Indices of an evenly spaced subset of about `limit` items (all when limit is 0), of the
    items `lines` = (start, end) when given."""
    start, end = lines or (0, n)
    if end > n:
        raise ValueError(f"lines {start}:{end} run past the end of the test set ({n} sentences)")
    n = end - start
    return list(range(start, end)) if not limit or limit >= n else [start + i * n // limit for i in range(limit)]


def from_data_bin(task, subset: str, limit: int, post_process: Optional[str],
                  lines: Optional[Tuple[int, int]] = None) -> TestSet:
    task.load_dataset(subset)
    ds = task.dataset(subset)
    if ds.tgt is None:
        raise ValueError(f"split {subset} has no target side: no references to score against")
    keep = _every(len(ds), limit, lines)
    src = [ds.src[i] for i in keep]
    tgt = [ds.tgt[i] for i in keep]
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    dataset = LanguagePairDataset(src, [len(x) for x in src], src_dict, tgt, [len(x) for x in tgt], tgt_dict)
    refs = [tgt_dict.string(t, post_process, escape_unk=True) for t in tgt]  # as fairseq-generate's T- lines
    return TestSet(dataset, refs, lambda ids: tgt_dict.string(torch.tensor(ids), post_process),
                   [[src_dict[i] for i in s[:-1].tolist()] for s in src], keep)


def from_raw(task, src_path: str, ref_path: str, limit: int, tokenizer: str, bpe: str, bpe_codes: Optional[str],
             sentencepiece_model: Optional[str], lines: Optional[Tuple[int, int]] = None) -> TestSet:
    src_lines, ref_lines = read_lines(src_path), read_lines(ref_path)
    if len(src_lines) != len(ref_lines):
        raise ValueError(f"{src_path} has {len(src_lines)} lines but {ref_path} has {len(ref_lines)}")
    keep = _every(len(src_lines), limit, lines)
    codec = TextCodec(task, tokenizer, bpe, bpe_codes, sentencepiece_model)
    src_dict = task.source_dictionary
    src = [codec.encode(src_lines[i]) for i in keep]
    dataset = LanguagePairDataset(src, [len(x) for x in src], src_dict, tgt_dict=task.target_dictionary)
    return TestSet(dataset, [ref_lines[i] for i in keep], codec.decode,
                   [[src_dict[i] for i in s[:-1].tolist()] for s in src], keep)
