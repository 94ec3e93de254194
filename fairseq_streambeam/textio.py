"""Raw text <-> token ids with fairseq's own tokenizer and BPE classes (as the hub interface
does): moses + fastBPE for the WMT'19 models, sentencepiece for deen-tiny, none for pre-split text."""

from __future__ import annotations

import argparse
import os
from typing import Any, List, Optional, Tuple

import torch


def read_lines(path) -> List[str]:
    """A UTF-8 text file's lines, split at "\\n" only (a "\\r" before it dropped), as sacrebleu and
    decode_corpus read them: str.splitlines also splits at \\x85, \\x0c, U+2028 and others, which real
    corpora contain."""
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line.rstrip("\n").removesuffix("\r") for line in f]


# fairseq's BPEs that these options configure (the others read options of their own)
BPES = ("none", "fastbpe", "subword_nmt", "sentencepiece", "bytes", "characters")
BPE_FILES = {"sentencepiece": "--sentencepiece-model", "fastbpe": "--bpe-codes", "subword_nmt": "--bpe-codes"}


def bpe_problem(bpe: str, bpe_codes: Optional[str], sentencepiece_model: Optional[str]) -> Optional[str]:
    """Why `bpe` cannot be built from these options, in one line (None: it can)."""
    if bpe not in BPES:
        return f"--bpe {bpe}: not one of {', '.join(BPES)}"
    needs = BPE_FILES.get(bpe)
    if not needs:
        return None
    path = sentencepiece_model if bpe == "sentencepiece" else bpe_codes
    if not path or path == "???":  # "???": omegaconf's MISSING, the default fairseq's BPE configs give
        return f"--bpe {bpe} needs {needs}"
    if "://" in path:  # fairseq also opens URLs
        return None
    problem = file_problem(needs, path)
    if problem is None and bpe == "sentencepiece":
        import sentencepiece

        try:  # read now (milliseconds), not after the models load
            sentencepiece.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError):
            problem = f"{needs} {path}: not a sentencepiece model"
    return problem


def file_problem(flag: str, path: str) -> Optional[str]:
    """Why `path`, given as `flag`, is not a regular file, in one line (None: it is one)."""
    if os.path.isfile(path):
        return None
    return f"{flag} {path}: {'not a regular file' if os.path.exists(path) else 'no such file'}"


def output_problem(flag: str, path: str) -> Optional[str]:
    """Why a file cannot be written at `path`, given as `flag`, in one line (None: it can be tried):
    a directory there, or no directory to hold it."""
    if os.path.isdir(path):
        return f"{flag} {path}: a directory, not a file"
    parent = os.path.dirname(os.path.abspath(path))
    return None if os.path.isdir(parent) else f"{flag} {path}: no such directory {parent}"


def missing_paths(path: Optional[str]) -> List[str]:
    """`path` and its parent directories that do not exist yet, deepest first: what a command
    that makes them removes again after a usage error (`remove_empty`)."""
    out: List[str] = []
    while path and not os.path.exists(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def remove_empty(paths: List[str]) -> None:
    """After a usage error: remove the files and directories of `paths` (made by this run) that
    are still empty, so that a failed run leaves nothing behind."""
    for path in paths:
        try:
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                os.remove(path)
            elif os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        except OSError:
            pass


def tokenizers() -> List[str]:
    """The --tokenizer choices: none and fairseq's registered tokenizers."""
    import fairseq.data.encoders  # noqa: F401  (registers them)
    from fairseq import registry

    return ["none", *sorted(registry.REGISTRIES["tokenizer"]["registry"])]


def text_pipeline(tokenizer: str, bpe: str, bpe_codes: Optional[str], sentencepiece_model: Optional[str],
                  source_lang: str, target_lang: str) -> Tuple[Any, Any]:
    """fairseq's tokenizer and BPE objects ("none": None), built from the options fairseq-interactive
    reads: Moses tokenizes with `source_lang`'s rules and detokenizes with `target_lang`'s."""
    from fairseq.data import encoders

    problem = bpe_problem(bpe, bpe_codes, sentencepiece_model)
    if problem:
        raise ValueError(problem)
    tok = encoders.build_tokenizer(argparse.Namespace(
        tokenizer=None if tokenizer == "none" else tokenizer, source_lang=source_lang, target_lang=target_lang,
        moses_no_dash_splits=False, moses_no_escape=False))
    enc = encoders.build_bpe(argparse.Namespace(bpe=None if bpe == "none" else bpe, bpe_codes=bpe_codes,
                                                sentencepiece_model=sentencepiece_model))
    return tok, enc


def segment(line: str, tok: Any, bpe: Any) -> str:
    """Raw text -> space-separated dictionary units (tokenized, then BPE-split)."""
    if tok is not None:
        line = tok.encode(line)
    if bpe is not None:
        line = bpe.encode(line)
    return line


class TextCodec:
    def __init__(self, task, tokenizer: str, bpe: str, bpe_codes: Optional[str], sentencepiece_model: Optional[str]):
        self.tok, self.bpe = text_pipeline(tokenizer, bpe, bpe_codes, sentencepiece_model,
                                           task.cfg.source_lang, task.cfg.target_lang)
        self.src_dict, self.tgt_dict = task.source_dictionary, task.target_dictionary

    def encode(self, line: str) -> torch.Tensor:
        """Source ids with EOS; words outside the dictionary become unk."""
        return self.src_dict.encode_line(segment(line, self.tok, self.bpe), add_if_not_exist=False,
                                         append_eos=True).long()

    def decode(self, ids: List[int]) -> str:
        text = self.tgt_dict.string(torch.tensor(ids))
        if self.bpe is not None:
            text = self.bpe.decode(text)
        if self.tok is not None:
            text = self.tok.decode(text)
        return text
