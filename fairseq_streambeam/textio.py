"""Raw text <-> token ids with fairseq's own tokenizer and BPE classes (as the hub interface
does): moses + fastBPE for the WMT'19 models, sentencepiece for deen-tiny, none for pre-split text."""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch


class TextCodec:
    def __init__(self, task, tokenizer: str, bpe: str, bpe_codes: Optional[str], sentencepiece_model: Optional[str]):
        self.tok = task.build_tokenizer(argparse.Namespace(
            tokenizer=None if tokenizer == "none" else tokenizer, moses_source_lang=task.cfg.source_lang,
            moses_target_lang=task.cfg.target_lang, moses_no_dash_splits=False, moses_no_escape=False))
        self.bpe = task.build_bpe(argparse.Namespace(bpe=None if bpe == "none" else bpe, bpe_codes=bpe_codes,
                                                     sentencepiece_model=sentencepiece_model))
        self.src_dict, self.tgt_dict = task.source_dictionary, task.target_dictionary

    def encode(self, line: str) -> torch.Tensor:
        """Source ids with EOS; words outside the dictionary become unk."""
        if self.tok is not None:
            line = self.tok.encode(line)
        if self.bpe is not None:
            line = self.bpe.encode(line)
        return self.src_dict.encode_line(line, add_if_not_exist=False, append_eos=True).long()

    def decode(self, ids: List[int]) -> str:
        text = self.tgt_dict.string(torch.tensor(ids))
        if self.bpe is not None:
            text = self.bpe.decode(text)
        if self.tok is not None:
            text = self.tok.decode(text)
        return text
