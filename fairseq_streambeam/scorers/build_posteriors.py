"""Build LMBR n-gram posteriors from the n-best lists of any system (Tromble et al. 2008; Iglesias
et al. 2018).

Evidence, one file per system (several files = system combination):
  fairseq   fairseq-generate output with --nbest N: `H-<id>\\t<log2 score>\\t<hypothesis>` lines;
  moses     Moses n-best lists: `id ||| hypothesis ||| features ||| score` (more fields may follow);
  text      one hypothesis per line, `--n N` lines per source, no scores (uniform weights).
Hypotheses are split on spaces into dictionary units, or segmented as raw text by fairseq's
--tokenizer / --bpe (the model's own options, so the n-grams match what the decoder emits). Entry i
of a source gets p_i = softmax(alpha * score_i) (uniform without scores); an n-gram u (orders 1..4,
EOS appended) gets P_s(u) = sum of p_i over the entries containing u, and P(u) = sum_s w_s P_s(u)
over the systems that have the source (weights normalized). Output: JSON lines for --lmbr-posteriors.

  python -m fairseq_streambeam.scorers.build_posteriors --nbest gen.out --dict dict.en.txt --out post.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..textio import BPES, bpe_problem, output_problem, read_lines, segment, text_pipeline, tokenizers
from .lmbr import MAX_ORDER, NGram, write_posteriors

H_LINE = re.compile(r"^H-(\d+)\t(\S+)\t(.*)$")
FORMATS = ("auto", "fairseq", "moses", "text")
# a larger share of evidence units outside the dictionary is reported with a hint to segment the text
UNKNOWN_SHARE = 0.05

Entry = Tuple[Optional[float], List[str]]  # (natural-log score or None, hypothesis as text units)
IdEntry = Tuple[Optional[float], List[int]]  # the same in dictionary ids
Raw = Dict[int, List[Tuple[Optional[float], str]]]  # sentence id -> [(score or None, hypothesis line)]


class EvidenceError(ValueError):
    """A malformed evidence file or option; the CLI prints it as one line."""


def _lines(path: str) -> List[str]:
    try:
        return read_lines(path)
    except (OSError, UnicodeDecodeError) as e:
        raise EvidenceError(f"{path}: cannot read ({e})") from e


def _read_fairseq(path: str) -> Raw:
    out: Raw = defaultdict(list)
    for ln, line in enumerate(_lines(path), 1):
        m = H_LINE.match(line)
        if m:
            try:
                score = float(m.group(2)) * math.log(2)  # fairseq prints log2 scores
            except ValueError:
                raise EvidenceError(f"{path}:{ln}: score {m.group(2)!r} is not a number") from None
            out[int(m.group(1))].append((score, m.group(3)))
    if not out:
        raise EvidenceError(f"{path}: no H- lines (expected fairseq-generate output with --nbest)")
    return dict(out)


def _read_moses(path: str) -> Raw:
    out: Raw = defaultdict(list)
    for ln, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split("|||")]
        if len(fields) < 4:
            raise EvidenceError(f"{path}:{ln}: not a Moses n-best line (id ||| hypothesis ||| features ||| score)")
        try:
            sid, score = int(fields[0]), float(fields[3])
        except ValueError:
            raise EvidenceError(f"{path}:{ln}: the id {fields[0]!r} or score {fields[3]!r} is not a number") from None
        out[sid].append((score, fields[1]))
    if not out:
        raise EvidenceError(f"{path}: no n-best lines")
    return dict(out)


def _read_text(path: str, n: Optional[int]) -> Raw:
    if not n or n < 1:
        raise EvidenceError(f"{path}: plain-text evidence needs --n N (hypotheses per source)")
    lines = _lines(path)
    if not lines or len(lines) % n:
        raise EvidenceError(f"{path}: {len(lines)} lines is not a multiple of --n {n}")
    return {i: [(None, x) for x in lines[i * n:(i + 1) * n]] for i in range(len(lines) // n)}


def detect_format(path: str) -> str:
    """fairseq if the file has H- lines, moses if its first line has `|||`, else text."""
    lines = _lines(path)
    if any(H_LINE.match(x) for x in lines[:1000]):
        return "fairseq"
    first = next((x for x in lines if x.strip()), "")
    return "moses" if "|||" in first else "text"


def read_evidence(path: str, fmt: str = "auto", n: Optional[int] = None,
                  segment: Optional[Callable[[str], List[str]]] = None) -> Dict[int, List[Entry]]:
    """sentence id -> [(natural-log score or None, units)] of one system's evidence file."""
    if fmt not in FORMATS:
        raise EvidenceError(f"unknown evidence format {fmt!r}; choose from {FORMATS}")
    readers = {"fairseq": _read_fairseq, "moses": _read_moses, "text": lambda p: _read_text(p, n)}
    raw = readers[detect_format(path) if fmt == "auto" else fmt](path)
    seg = segment or str.split
    return {sid: [(s, seg(text)) for s, text in entries] for sid, entries in raw.items()}


def segmenter(tokenizer: str = "none", bpe: str = "none", bpe_codes: Optional[str] = None,
              sentencepiece_model: Optional[str] = None, lang: str = "en") -> Optional[Callable[[str], List[str]]]:
    """Raw text -> dictionary units with fairseq's tokenizer and BPE (as the hub interface and
    decode_corpus encode text), or None when neither is asked for (text already in units)."""
    if tokenizer == "none" and bpe == "none":
        return None
    problem = bpe_problem(bpe, bpe_codes, sentencepiece_model)
    if problem:
        raise EvidenceError(problem)
    try:
        tok, enc = text_pipeline(tokenizer, bpe, bpe_codes, sentencepiece_model, lang, lang)
    except (ImportError, OSError, KeyError, RuntimeError) as e:
        raise EvidenceError(f"cannot build --tokenizer {tokenizer} / --bpe {bpe}: {e}") from e
    return lambda line: segment(line, tok, enc).split()


@dataclass
class _Source:
    """One source's entries of one system: the n-grams and which entries contain each."""

    entries: int
    scores: Optional[np.ndarray]  # [entries] natural-log scores, None = uniform
    grams: List[NGram]
    pair_gram: np.ndarray  # (gram, entry) incidence pairs, each n-gram counted once per entry
    pair_entry: np.ndarray

    def posteriors(self, alpha: float) -> np.ndarray:
        x = None if self.scores is None else alpha * self.scores
        if x is None or not np.isfinite(x.max()):  # no score, or none finite (all -inf): uniform
            p = np.full(self.entries, 1.0 / self.entries)
        else:
            p = np.exp(x - x.max())
            p /= p.sum()
        return np.bincount(self.pair_gram, weights=p[self.pair_entry], minlength=len(self.grams))


class Evidence:
    """The evidence of one or more systems in dictionary ids, indexed once so that posteriors for
    another alpha cost one weighted count per source (the tuner rebuilds them per alpha)."""

    def __init__(self, systems: Sequence[Dict[int, List[IdEntry]]],
                 weights: Optional[Sequence[float]] = None, max_order: int = MAX_ORDER):
        if weights is not None and len(weights) != len(systems):
            raise EvidenceError(f"{len(weights)} weights for {len(systems)} evidence files")
        if weights is not None and (any(w < 0 for w in weights) or not sum(weights) > 0):
            raise EvidenceError("system weights must be >= 0 with a positive sum")
        self.sources: Dict[int, List[Tuple[float, _Source]]] = defaultdict(list)
        for w, system in zip([1.0] * len(systems) if weights is None else weights, systems):
            for sid, entries in system.items():
                if w > 0 and entries:
                    self.sources[sid].append((w, _index(entries, max_order)))

    def posteriors(self, alpha: float = 1.0) -> Dict[int, Dict[NGram, float]]:
        """sentence id -> {n-gram: P(u)} for scale factor alpha."""
        out: Dict[int, Dict[NGram, float]] = {}
        for sid, parts in self.sources.items():
            z = sum(w for w, _ in parts)
            post: Dict[NGram, float] = defaultdict(float)
            for w, src in parts:
                for g, p in zip(src.grams, src.posteriors(alpha).tolist()):
                    post[g] += w / z * p
            out[sid] = dict(post)
        return out


def _index(entries: List[IdEntry], max_order: int) -> _Source:
    gram_id: Dict[NGram, int] = {}
    pg: List[int] = []
    pe: List[int] = []
    for e, (_, toks) in enumerate(entries):
        seen = {tuple(toks[i:i + n]) for n in range(1, max_order + 1) for i in range(len(toks) - n + 1)}
        for g in seen:
            pg.append(gram_id.setdefault(g, len(gram_id)))
            pe.append(e)
    scored = all(s is not None for s, _ in entries)
    scores = np.array([s for s, _ in entries], dtype=np.float64) if scored else None
    return _Source(len(entries), scores, list(gram_id), np.array(pg, dtype=np.int64), np.array(pe, dtype=np.int64))


def to_ids(system: Dict[int, List[Entry]], d) -> Tuple[Dict[int, List[IdEntry]], int, int]:
    """Units -> dictionary ids with EOS appended; also the counts of unknown units and of units."""
    out, unknown, total = {}, 0, 0
    for sid, entries in system.items():
        mapped = []
        for score, units in entries:
            ids = [d.index(t) for t in units]
            unknown += sum(i == d.unk() for i in ids)
            total += len(ids)
            mapped.append((score, ids + [d.eos()]))
        out[sid] = mapped
    return out, unknown, total


def add_evidence_args(p: argparse.ArgumentParser, required: bool = True, segmentation: bool = True) -> None:
    """The evidence options shared by this tool and the calibrator (which has its own segmentation
    options, for the raw dev source and the evidence alike, and tokenizes the evidence in its
    --target-lang: `segmentation=False`)."""
    p.add_argument("--nbest", nargs="+", required=required, metavar="FILE",
                   help="evidence: one file per system (several = system combination)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="fairseq-generate output, Moses n-best, or plain text (auto: by content)")
    p.add_argument("--n", type=int, help="plain text: hypotheses per source (consecutive lines)")
    p.add_argument("--weights", help="comma-separated system weights (default: equal)")
    p.add_argument("--max-order", type=int, default=MAX_ORDER)
    if segmentation:
        p.add_argument("--tokenizer", default="none", choices=tokenizers(),
                       help="segment raw evidence with fairseq's tokenizer")
        p.add_argument("--bpe", default="none", choices=BPES, help="segment raw evidence with fairseq's BPE")
        p.add_argument("--bpe-codes", help="with --bpe fastbpe / subword_nmt")
        p.add_argument("--sentencepiece-model", help="with --bpe sentencepiece")
        p.add_argument("--lang", default="en", help="target language for --tokenizer moses")


def load_evidence(args, d) -> Tuple[Evidence, str]:
    """The Evidence of the parsed evidence options in dictionary `d`, and a one-line summary."""
    if not 1 <= args.max_order <= MAX_ORDER:
        raise EvidenceError(f"--max-order must be in 1..{MAX_ORDER}")
    weights = None
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise EvidenceError(f"--weights {args.weights!r}: not comma-separated numbers") from None
    lang = getattr(args, "lang", None) or args.target_lang  # the evidence is target-language text
    seg = segmenter(args.tokenizer, args.bpe, args.bpe_codes, args.sentencepiece_model, lang)
    systems, unknown, total = [], 0, 0
    for path in args.nbest:
        ids, u, t = to_ids(read_evidence(path, args.format, args.n, seg), d)
        systems.append(ids)
        unknown, total = unknown + u, total + t
    ev = Evidence(systems, weights, args.max_order)
    summary = f"{len(ev.sources)} sentences from {len(systems)} system(s); {unknown} of {total} evidence units " \
              "not in the dictionary (mapped to unk)"
    if unknown > UNKNOWN_SHARE * total:  # raw text where the model's units were meant, most likely
        summary += f": more than {UNKNOWN_SHARE:.0%}; segment the evidence as the model's text (--tokenizer, --bpe)"
    return ev, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fairseq_streambeam.scorers.build_posteriors",
                                description=__doc__.split("\n\n")[0])
    add_evidence_args(p)
    p.add_argument("--dict", required=True, help="the NMT model's target dictionary (dict.xx.txt)")
    p.add_argument("--out", required=True)
    p.add_argument("--alpha", type=float, default=1.0, help="scale of the evidence scores: p ~ exp(alpha * score)")
    p.add_argument("--write-vocab-masks", help="also write --token-masks allowing only the evidence's tokens "
                                               "per sentence (a hard constraint, Iglesias et al. Alg. 1)")
    args = p.parse_args(argv)
    problem = next(filter(None, (output_problem(flag, path) for flag, path in (
        ("--out", args.out), ("--write-vocab-masks", args.write_vocab_masks)) if path)), None)
    if not args.alpha >= 0:
        problem = f"--alpha must be >= 0, got {args.alpha}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from fairseq.data import Dictionary

    try:
        d = Dictionary.load(args.dict)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        print(f"error: --dict {args.dict}: {e}", file=sys.stderr)
        return 2
    try:
        ev, summary = load_evidence(args, d)
    except EvidenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = ev.posteriors(args.alpha)
    write_posteriors(Path(args.out), records)
    if args.write_vocab_masks:
        with open(args.write_vocab_masks, "w", encoding="utf-8") as f:
            for sid in sorted(records):
                allow = sorted({g[0] for g in records[sid] if len(g) == 1})
                f.write(json.dumps({"id": sid, "allow": allow}) + "\n")
    print(f"wrote posteriors for {len(records)} sentences to {args.out}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
