"""One decoding spec: every option of a decoding, validated once, for every front end.

`DecodeSpec` is frozen; fairseq's generation options keep `SequenceGenerator`'s argument names (so
fields are also the generators' keyword arguments), the plugin's keep the task's. Building one raises
`UsageError` naming the flag of a bad value or of an option the decoding does not use. Front ends
build specs with `from_cli` and check the files they name with `check_files`; `DECODINGS` says
what each decoding is.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import math
import numbers
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .search.finalize import finished_per_source
from .search.pruning import Pruning
from .textio import file_problem


class UsageError(ValueError):
    """An option that contradicts another or is out of range. A command line reports it in one line
    on stderr with exit status 2; Python callers catch a ValueError."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's own mistakes (an unknown option, a bad choice or number) as one line
    `prog: error: ...` with exit status 2, like the commands' other usage errors, not after the usage text."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclass(frozen=True)
class Decoding:
    """What `--decoding NAME` is: `family` beam (StreamBeamGenerator), draft (AggressiveGenerator)
    or fairseq (fairseq's own SequenceGenerator); variable-width beams; streaming refill (sources
    enter while others decode); its finalization rule (the spec's `finalize="auto"`)."""

    name: str
    family: str
    variable: bool = False
    streaming: bool = False
    rule: str = "fairseq"


DECODINGS: Dict[str, Decoding] = {d.name: d for d in (
    Decoding("beam", "beam"),
    Decoding("greedy", "beam"),
    Decoding("var-batch", "beam", variable=True, rule="sticky"),
    Decoding("var-stream", "beam", variable=True, streaming=True, rule="sticky"),
    Decoding("fixed-stream", "beam", streaming=True),
    Decoding("iad", "draft", streaming=True),
    Decoding("gad", "draft", streaming=True),
    Decoding("fairseq", "fairseq"),
)}
PAPER_DELTA, PAPER_M = 1.5, 5  # Yang et al. 2020, Table 1 settings
ORDERS = ("min-length", "fifo", "continuous")
ADMIT_ORDERS = ("shortest-first", "longest-first")
FINALIZE_RULES = ("auto", "fairseq", "sticky")
# --draft-min-reach when not given: a drafter's late slots are rarely reached, while iad's copied
# drafts are usually right (docs/benchmarks.md, "Measurements behind the defaults")
AUTO_MIN_REACH = {"gad": 0.25, "iad": 0.0}

_VAR = ("var-batch and var-stream", lambda d: d.variable)
_STREAM_BEAM = ("var-stream and fixed-stream", lambda d: d.family == "beam" and d.streaming)
_STREAMING = ("the streaming decodings (var-stream, fixed-stream, iad, gad)", lambda d: d.streaming)
_BEAM = ("the beam decodings", lambda d: d.family == "beam")
_DRAFT = ("--decoding iad and gad", lambda d: d.family == "draft")
_GAD = ("--decoding gad", lambda d: d.name == "gad")
# option -> (the decodings it applies to, in words; test): set to anything but its default for
# another decoding, it is refused rather than ignored
APPLIES: Dict[str, Tuple[str, Callable[[Decoding], bool]]] = {
    "prune_abs_threshold": _VAR, "prune_max_cands": _VAR,
    "finalize": _BEAM, "no_repeat_ngram_size": _BEAM, "match_source_len": _BEAM, "print_alignment": _BEAM,
    "finish_count": _BEAM, "lmbr_posteriors": _BEAM, "token_masks": _BEAM, "lmbr_lambda": _BEAM,
    "lmbr_theta0": _BEAM, "lmbr_p": _BEAM, "lmbr_r": _BEAM,
    "stream_order": _STREAM_BEAM, "stream_admit": _STREAM_BEAM, "max_wait_steps": _STREAM_BEAM,
    "refill_eps": _STREAMING, "stream_candidates": _STREAMING, "stream_window": _STREAMING,
    "block_size": _DRAFT, "draft_min_reach": _DRAFT, "iad_ngram": ("--decoding iad", lambda d: d.name == "iad"),
    "drafter": _GAD, "draft_lookup": _GAD, "draft_lookup_order": _GAD, "gad_beta": _GAD, "gad_tau": _GAD,
    "draft_switch": _GAD, "compile": ("the beam and draft decodings", lambda d: d.family != "fairseq"),
}
FILES = ("lmbr_posteriors", "token_masks", "draft_lookup", "drafter")


@dataclass(frozen=True)
class DecodeSpec:
    """Every option of one decoding (see the module docstring); derived settings are properties."""

    decoding: str = "beam"
    # fairseq's generation options, as SequenceGenerator names them
    beam_size: int = 1
    nbest: int = 1
    max_len_a: float = 0
    max_len_b: int = 200
    max_len: int = 0
    min_len: int = 1
    normalize_scores: bool = True
    len_penalty: float = 1.0
    unk_penalty: float = 0.0
    temperature: float = 1.0
    no_repeat_ngram_size: int = 0
    match_source_len: bool = False
    print_alignment: Optional[str] = None
    lm_weight: float = 1.0
    eos: Optional[int] = None
    tokens_to_suppress: Tuple[str, ...] = ()
    symbols_to_strip_from_output: Optional[frozenset] = None
    # beam decodings
    prune_abs_threshold: Optional[float] = None
    prune_max_cands: Optional[int] = None
    finalize: str = "auto"
    finish_count: Optional[int] = None
    # streaming
    stream_order: str = "min-length"
    stream_admit: str = "shortest-first"
    refill_eps: float = 1 / 6
    stream_candidates: Optional[int] = None
    stream_window: int = 32
    max_wait_steps: int = 0
    compile: bool = False  # the lean decoder layers through torch.compile; on CUDA, graph steps (runtime.graph_step)
    # scorers
    lmbr_posteriors: Optional[str] = None
    lmbr_lambda: Optional[float] = None
    lmbr_theta0: Optional[float] = None
    lmbr_p: float = 0.85
    lmbr_r: float = 0.72
    token_masks: Optional[str] = None
    # aggressive decoding
    block_size: int = 0
    iad_ngram: int = 2
    draft_min_reach: Optional[float] = None
    drafter: Optional[str] = None
    draft_lookup: Optional[str] = None
    draft_lookup_order: int = 2
    gad_beta: int = 1
    gad_tau: float = math.inf
    draft_switch: bool = True  # gad, top-1: passes go without drafts while those cost less per token

    def __post_init__(self) -> None:
        if self.decoding not in DECODINGS:
            raise UsageError(f"--decoding must be one of {', '.join(DECODINGS)}, got {self.decoding}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (enum.Enum, os.PathLike)):  # fairseq's ChoiceEnum, a Path: as strings
                object.__setattr__(self, f.name, value := _value(value))
            problem = type_problem(f.name, value, str(f.type))
            if problem:
                raise UsageError(problem)
        for name, ok, allowed in _RANGES:
            value = getattr(self, name)
            if not ok(value):
                raise UsageError(f"{flag(name)} must be {allowed}, got {value}")
        self._check_applies()
        if (self.kind.family == "draft" or self.decoding == "greedy") and self.nbest > 1:
            raise UsageError(f"--decoding {self.decoding} returns one hypothesis per source: --nbest must be 1")
        if self.kind.family == "beam":
            try:
                finished_per_source(self.rule, self.beam, self.finish_count, self.nbest)
            except ValueError as e:
                raise UsageError(str(e)) from None
        if self.drafter and self.draft_lookup:
            raise UsageError("--decoding gad takes --drafter or --draft-lookup, not both")
        self._check_needs()

    def _check_needs(self) -> None:
        """Options that only mean something beside another one."""
        lmbr = [n for n in ("lmbr_lambda", "lmbr_theta0", "lmbr_p", "lmbr_r") if getattr(self, n) != _DEFAULTS[n]]
        if lmbr and not self.lmbr_posteriors:
            raise UsageError(f"{' and '.join(flag(n) for n in lmbr)} {'need' if len(lmbr) > 1 else 'needs'} "
                             "--lmbr-posteriors")
        if self.lmbr_posteriors and self.lmbr_lambda is None and not self.kind.variable:
            # measured: at the defaults, LMBR lowers fixed-width beam's BLEU (docs/lmbr.md, "Defaults")
            raise UsageError(f"--lmbr-posteriors with --decoding {self.decoding} needs a tuned --lmbr-lambda (the "
                             "defaults lower fixed-width beam's BLEU): run streambeam-calibrate on a dev set")
        if self.draft_lookup_order != _DEFAULTS["draft_lookup_order"] and not self.draft_lookup:
            raise UsageError("--draft-lookup-order needs --draft-lookup")
        if self.gad_tau != _DEFAULTS["gad_tau"] and self.gad_beta == 1:
            raise UsageError("--gad-tau applies to GAD++ (--gad-beta above 1)")
        if self.gad_beta > 1 and self.draft_min_reach:
            raise UsageError("--draft-min-reach caps drafts by what earlier passes accepted, and GAD++'s output "
                             "depends on its drafts: it would depend on what was decoded before (use --block-size)")
        if self.max_len_a == 0 and not self.match_source_len and self.min_len > self.max_len_b:
            raise UsageError(f"--min-len {self.min_len} exceeds the maximum length {self.max_len_b} (--max-len-b)")

    def _check_applies(self) -> None:
        given = [n for n in APPLIES if getattr(self, n) != _DEFAULTS[n] and not APPLIES[n][1](self.kind)]
        if given:
            where = APPLIES[given[0]][0]
            flags = [flag(n) for n in given if APPLIES[n][0] == where]
            verb = "applies" if len(flags) == 1 else "apply"
            raise UsageError(f"{' and '.join(flags)} {verb} to {where}, not --decoding {self.decoding}")

    @property
    def kind(self) -> Decoding:
        return DECODINGS[self.decoding]

    @property
    def beam(self) -> int:
        """Hypotheses per source: 1 for greedy and the aggressive decodings, else `beam_size`."""
        return self.beam_size if self.decoding != "greedy" and self.kind.family == "beam" else 1

    @property
    def rule(self) -> str:
        """The finalization rule: `finalize`, with auto = the decoding's own."""
        return self.kind.rule if self.finalize == "auto" else self.finalize

    @property
    def pruning(self) -> Pruning:
        if not self.kind.variable:
            return Pruning(self.beam)
        delta, m = self.prune_abs_threshold, self.prune_max_cands
        return Pruning(self.beam, PAPER_DELTA if delta is None else delta, PAPER_M if m is None else m)

    @property
    def policy(self) -> str:
        """The scheduling policy (runtime.scheduler): batch, or a streaming order."""
        if self.kind.family == "draft":
            return "min-length"
        return self.stream_order if self.kind.streaming else "batch"

    @property
    def min_reach(self) -> float:
        """The draft cap's reach (runtime.draft_budget); none for GAD++, whose output depends on
        its drafts and so would depend on what the generator decoded before."""
        if self.draft_min_reach is not None:
            return self.draft_min_reach
        return 0.0 if self.gad_beta > 1 else AUTO_MIN_REACH.get(self.decoding, 0.0)

    @property
    def switches_drafting(self) -> bool:
        """GAD with top-1 verification may skip drafting (GAD++'s output depends on the drafts)."""
        return self.decoding == "gad" and self.gad_beta == 1 and self.draft_switch


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodeSpec)}
_RANGES = [
    ("beam_size", lambda v: v >= 1, ">= 1"),
    ("nbest", lambda v: v >= 1, ">= 1"),
    ("min_len", lambda v: v >= 0, ">= 0"),
    ("max_len_b", lambda v: v >= 0, ">= 0"),
    ("temperature", lambda v: v > 0, "> 0"),
    ("len_penalty", lambda v: not math.isnan(v), "a number"),
    ("unk_penalty", lambda v: not math.isnan(v), "a number"),
    ("max_len_a", lambda v: not math.isnan(v), "a number"),
    ("no_repeat_ngram_size", lambda v: v >= 0, ">= 0"),
    ("print_alignment", lambda v: v in (None, "hard", "soft"), "hard or soft"),
    ("prune_abs_threshold", lambda v: v is None or v > 0, "> 0"),
    ("prune_max_cands", lambda v: v is None or v >= 0, ">= 0 (0 = unlimited)"),
    ("finalize", lambda v: v in FINALIZE_RULES, "one of " + ", ".join(FINALIZE_RULES)),
    ("finish_count", lambda v: v is None or v >= 1, ">= 1"),
    ("stream_order", lambda v: v in ORDERS, "one of " + ", ".join(ORDERS)),
    ("stream_admit", lambda v: v in ADMIT_ORDERS, "one of " + ", ".join(ADMIT_ORDERS)),
    ("refill_eps", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("stream_candidates", lambda v: v is None or v >= 1, ">= 1"),
    ("stream_window", lambda v: v >= 1, ">= 1"),
    ("max_wait_steps", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("lmbr_lambda", lambda v: v is None or v > 0, "> 0"),
    ("lmbr_theta0", lambda v: v is None or math.isfinite(v), "a finite number"),
    ("lmbr_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("lmbr_r", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("iad_ngram", lambda v: v >= 1, ">= 1"),
    ("block_size", lambda v: v >= 0, ">= 0 (0 = auto)"),
    ("draft_min_reach", lambda v: v is None or 0 <= v <= 1, "in [0, 1]"),
    ("draft_lookup_order", lambda v: v >= 1, ">= 1"),
    ("gad_beta", lambda v: v >= 1, ">= 1"),
    ("gad_tau", lambda v: v >= 0, ">= 0"),
]

# fairseq generation options (GenerationConfig names) -> DecodeSpec fields; `unnormalized` is negated
GENERATION = {"beam": "beam_size", "nbest": "nbest", "max_len_a": "max_len_a", "max_len_b": "max_len_b",
              "min_len": "min_len", "lenpen": "len_penalty", "unkpen": "unk_penalty", "temperature": "temperature",
              "no_repeat_ngram_size": "no_repeat_ngram_size", "match_source_len": "match_source_len",
              "print_alignment": "print_alignment"}
# the paper's (and the bench's) names of the pruning options -> DecodeSpec fields
PAPER_NAMES = {"delta": "prune_abs_threshold", "max_cands": "prune_max_cands", "M": "prune_max_cands",
               "z": "finish_count"}
# build_generator's extra_gen_cls_kwargs the plugin's generators take (lm_model: shallow fusion's LM)
EXTRA_ARGUMENTS = ("lm_model", "lm_weight", "tokens_to_suppress", "symbols_to_strip_from_output")
# fairseq generation options no plugin decoding implements (--decoding fairseq has them): name,
# test of the value, flag. --score-reference scores the reference instead of decoding, and
# --sampling-topk/-topp mean sampling.
REFUSED = [
    ("score_reference", bool, "--score-reference"),
    ("sampling", bool, "--sampling"),
    ("sampling_topk", lambda v: v is not None and v >= 0, "--sampling-topk"),
    ("sampling_topp", lambda v: v is not None and v >= 0, "--sampling-topp"),
    ("diverse_beam_groups", lambda v: v is not None and v > 0, "--diverse-beam-groups"),
    ("diversity_rate", lambda v: v is not None and v > -1, "--diversity-rate"),
    ("constraints", bool, "--constraints"),
]


def from_cli(cfg: Any, gen: Any = None, extra: Optional[dict] = None, prefix_fn: Any = None) -> DecodeSpec:
    """The spec of a task config (or argparse namespace) `cfg` and fairseq's generation options `gen`
    (None before they are known: then the widest beam the plugin's options allow, so that only the
    generation options' own checks wait for them). `extra` (fairseq's extra_gen_cls_kwargs: lm_model,
    lm_weight, tokens_to_suppress, symbols_to_strip_from_output) and `prefix_fn` are build_generator's
    other arguments; fairseq also reads `prefix_allowed_tokens_fn` from `gen`."""
    extra = extra or {}
    prefix_fn = prefix_fn if prefix_fn is not None else getattr(gen, "prefix_allowed_tokens_fn", None)
    plugin = {n: _value(getattr(cfg, n, _DEFAULTS[n])) for n in PLUGIN_OPTIONS}
    # the plugin's options are the task's: given with the generation options (the hub's translate()
    # and generate() pass their keywords there) and unlike the task's, they would be ignored
    moved = [n for n in PLUGIN_OPTIONS if gen is not None and gen is not cfg and getattr(gen, n, None) is not None
             and _value(getattr(gen, n)) != plugin[n]]
    if moved:
        raise UsageError(f"{', '.join(f'{n}={getattr(gen, n)!r}' for n in moved)}: the plugin's options are the "
                         "task's; with the hub interface give them to attach_to_hub(hub, ...)")
    decoding = plugin["decoding"]
    if gen is None or not hasattr(gen, "beam"):  # e.g. fairseq-train with the task: no generation options
        spec = DecodeSpec(**plugin, beam_size=max(5, plugin["finish_count"] or 1))
    else:
        fields = {f: _value(getattr(gen, g)) for g, f in GENERATION.items() if getattr(gen, g, None) is not None}
        fields["normalize_scores"] = not getattr(gen, "unnormalized", False)
        if "lm_weight" in extra:
            fields["lm_weight"] = extra["lm_weight"]
        if extra.get("tokens_to_suppress"):
            fields["tokens_to_suppress"] = tuple(extra["tokens_to_suppress"])
        if extra.get("symbols_to_strip_from_output") is not None:
            fields["symbols_to_strip_from_output"] = frozenset(extra["symbols_to_strip_from_output"])
        if decoding == "fairseq":  # fairseq's generator checks its own options
            return DecodeSpec(**plugin)
        refused = [f for name, is_set, f in REFUSED if is_set(getattr(gen, name, None))]
        refused += sorted(set(extra) - set(EXTRA_ARGUMENTS))
        refused += ["prefix_allowed_tokens_fn"] if prefix_fn is not None else []
        if DECODINGS.get(decoding, DECODINGS["beam"]).family == "draft" and (
                getattr(gen, "lm_path", None) or extra.get("lm_model") is not None):
            refused.append("--lm-path")
        if refused:
            raise UsageError(f"--decoding {decoding} does not support {', '.join(refused)}; "
                             "use --decoding fairseq for those")
        spec = DecodeSpec(**plugin, **fields)
    if decoding == "gad" and not (spec.drafter or spec.draft_lookup):
        raise UsageError("--decoding gad needs --drafter PATH (a block_drafter checkpoint) or --draft-lookup TEXT "
                         "(target-side text for an n-gram table); see docs/drafting.md")
    return spec


def check_files(spec: DecodeSpec) -> None:
    """The files a spec names exist, and a drafter is a checkpoint. Front ends call this before a
    model loads (not at parse time: a script may write a file after parsing its command)."""
    for name in FILES:
        path = getattr(spec, name)
        problem = file_problem(flag(name), path) if path else None
        if problem:
            raise UsageError(problem)
    if spec.drafter and not is_checkpoint_file(spec.drafter):
        raise UsageError(f"--drafter {spec.drafter} is not a checkpoint (a file written by torch.save, e.g. "
                         "checkpoint_best.pt of scripts/train_drafter.sh)")


def is_checkpoint_file(path: str) -> bool:
    """A file torch.save wrote: a zip archive (the default format) or a pickle (the legacy one)."""
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def checkpoint_files(path: str) -> List[str]:
    """The local checkpoint files of `--path` (split at os.pathsep: an ensemble), none for a URL
    (fairseq's `://` paths, which fairseq itself reads and does not split)."""
    return [] if "://" in path else path.split(os.pathsep)


def model_files_problem(data: Optional[str], langs: Tuple[Optional[str], ...], path: Optional[str],
                        data_flag: str = "--data") -> Optional[str]:
    """Why a model cannot load, in one line (None: it can): no `--path`, one of its checkpoints
    (split at os.pathsep, as fairseq does) not a file torch.save wrote, or a language's dictionary
    missing from the first of `data`'s directories (where fairseq's translation task reads them).
    URLs (fairseq's `://` paths) are left to fairseq. `data_flag`: how messages name `data`."""
    if not path:
        return "--path is required: the model's checkpoint (colon-separated for an ensemble)"
    for ckpt in checkpoint_files(path):
        try:
            problem = file_problem("--path", ckpt) or (
                None if is_checkpoint_file(ckpt) else f"--path {ckpt}: not a checkpoint (a file written by torch.save)")
        except OSError as e:
            problem = f"--path {ckpt}: cannot read ({e.strerror})"
        if problem:
            return problem.replace(": no such file", ": no such checkpoint") + (
                "; name the checkpoint file in it" if os.path.isdir(ckpt) else "")
    first = data.split(os.pathsep)[0] if data and "://" not in data else None
    name = f"{data_flag} {first}".strip()
    if first and not os.path.isdir(first):
        return f"{name}: no such directory (the model's data-bin or dictionaries)"
    missing = [lang for lang in langs if first and lang and not os.path.isfile(os.path.join(first, f"dict.{lang}.txt"))]
    return f"{name}: no dict.{missing[0]}.txt there" if missing else None


def count_problem(ns: Any, names: Sequence[str], least: int = 1) -> Optional[str]:
    """The first of the whole-number options `names` of `ns` set below `least` (e.g. --batch-size
    -1, which fairseq takes as no limit), in one line; None when there is none."""
    for name in names:
        value = getattr(ns, name, None)
        if value is not None and value < least:
            return f"--{name.replace('_', '-')} must be >= {least}, got {value}"
    return None


# what a field of each annotation holds: (test, words for a message); other annotations go unchecked
_KINDS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "a whole number"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def type_problem(name: str, value: Any, annotation: str) -> Optional[str]:
    """Why `value` does not suit a field annotated `annotation` ("int", "Optional[float]", ...), in
    one line (None: it does): Python callers pass options unparsed, and a string or a float where a
    count belongs would fail deep inside a decode."""
    optional = annotation.startswith("Optional[")
    kind = _KINDS.get(annotation[len("Optional["):-1] if optional else annotation)
    if kind is None or (optional and value is None) or kind[0](value):
        return None
    return f"{flag(name)} must be {kind[1]}{' or None' if optional else ''}, got {value!r}"


def unknown_problem(given: Sequence[str], known: Sequence[str], what: str,
                    elsewhere: Optional[Tuple[Sequence[str], str]] = None) -> Optional[str]:
    """One line naming the first of `given` that is not in `known`: where it belongs when it is one
    of `elsewhere`'s names (names, where), else with the closest known name (for fairseq's and the
    paper's names, the field: beam -> beam_size, delta -> prune_abs_threshold)."""
    for name in given:
        if name in known:
            continue
        if elsewhere is not None and name in elsewhere[0]:
            return f"{what}: {name} is {elsewhere[1]}"
        alias = {**GENERATION, **PAPER_NAMES}.get(name)
        close = [alias] if alias in known else difflib.get_close_matches(name, known, n=1)
        return f"{what} has no option {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
    return None


def flag(name: str) -> str:
    """The command-line flag of a spec field (fairseq's own name for its generation options); a
    field that is no command-line option (a bench or Python setting) by its own name."""
    name = {f: g for g, f in GENERATION.items()}.get(name, name)
    return "--" + name.replace("_", "-") if name in GENERATION or name in PLUGIN_OPTIONS else name


def _value(v: Any) -> Any:
    """fairseq's ChoiceEnum members as plain strings, paths as strings."""
    return str(v) if isinstance(v, enum.Enum) else os.fspath(v) if isinstance(v, os.PathLike) else v


# the plugin's options on the command line (the task's dataclass fields of the same names)
PLUGIN_OPTIONS = ("decoding", "prune_abs_threshold", "prune_max_cands", "finish_count", "stream_order",
                  "stream_admit", "refill_eps", "stream_candidates", "stream_window", "max_wait_steps",
                  "lmbr_posteriors", "lmbr_lambda", "lmbr_theta0", "lmbr_p", "lmbr_r", "token_masks", "block_size",
                  "iad_ngram", "draft_min_reach", "drafter", "draft_lookup", "draft_lookup_order", "gad_beta",
                  "gad_tau", "compile")
