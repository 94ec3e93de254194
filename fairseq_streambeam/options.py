"""Command-line options of the plugin (fields of the task's dataclass) and their validation."""

import dataclasses
import math
import os
import sys
import zipfile
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks.translation import TranslationConfig

from .search.finalize import FINISH_COUNT_NEEDS_STICKY, finished_per_source

DECODING_CHOICES = ChoiceEnum(["beam", "greedy", "var-batch", "var-stream", "fixed-stream", "iad", "gad", "fairseq"])
FINALIZE_CHOICES = ChoiceEnum(["auto", "fairseq", "sticky"])
ORDER_CHOICES = ChoiceEnum(["min-length", "fifo", "continuous"])
ADMIT_CHOICES = ChoiceEnum(["shortest-first", "longest-first"])


@dataclass
class StreamBeamConfig(TranslationConfig):
    decoding: DECODING_CHOICES = field(
        default="beam",
        metadata={"help": "beam: fixed beam (= fairseq's output); greedy: beam 1; var-batch: variable-"
                          "width beams (delta, M) per batch; var-stream: variable-width beams with "
                          "streaming refill (Yang et al. 2020); fixed-stream: fixed beam, streamed; "
                          "iad: input-guided aggressive decoding (= greedy output, Ge et al. 2022); "
                          "gad: generalized aggressive decoding with a --drafter model (= greedy output "
                          "with --gad-beta 1; GAD++ otherwise); "
                          "fairseq: fairseq's own SequenceGenerator"},
    )
    prune_abs_threshold: Optional[float] = field(
        default=None, metadata={"help": "delta: drop candidates more than delta below the best "
                                        "(var-* only; default 1.5)"})
    prune_max_cands: Optional[int] = field(
        default=None, metadata={"help": "M: at most M children per parent (var-* only; default 5)"})
    finalize: FINALIZE_CHOICES = field(
        default="auto", metadata={"help": "fairseq: EOS candidates finish at once, k per source; sticky: "
                                          "the paper's rule, final only when top candidate; auto: sticky "
                                          "for var-*, fairseq otherwise"})
    finish_count: Optional[int] = field(
        default=None, metadata={"help": "z: finished hypotheses that end a source under the sticky rule (default: "
                                        "the beam size k, as in Yang et al.'s runs); --nbest may not exceed it. "
                                        "Refused with the fairseq rule (beam, greedy, fixed-stream by default), "
                                        "which always finishes k"})
    refill_eps: float = field(
        default=1 / 6, metadata={"help": "eps: refill when fewer than eps*n sources are live (streaming)"})
    stream_order: ORDER_CHOICES = field(
        default="min-length", metadata={"help": "which cohort steps next when streaming: min-length "
                                                "(the paper), fifo (paper A.2), or continuous: every live "
                                                "source steps in one decoder call whatever its prefix length "
                                                "(fairseq transformer decoders; others use min-length)"})
    stream_admit: ADMIT_CHOICES = field(
        default="shortest-first", metadata={"help": "order in which streaming admits a window's sources: "
                                                    "shortest-first keeps cohorts' lengths alike (little "
                                                    "padding); longest-first starts long outputs early, so "
                                                    "the window's last steps are fuller (same output)"})
    stream_candidates: Optional[int] = field(
        default=None, metadata={"help": "streaming: refill by live beam candidates instead of sources: keep "
                                        "about this many candidates per decoder step (--batch-size still caps "
                                        "the sources)"})
    stream_window: int = field(
        default=32, metadata={"help": "streaming modes: hand the generator windows of this many "
                                      "fairseq batches; --batch-size/--max-tokens stay the live budget n"})
    max_wait_steps: int = field(
        default=0, metadata={"help": "latency bound: step a cohort first once it has waited this many "
                                     "decoder steps (0 = off; output unchanged)"})
    lmbr_posteriors: Optional[str] = field(
        default=None, metadata={"help": "LMBR n-gram posteriors (JSON lines by sentence id, from "
                                        "python -m fairseq_streambeam.scorers.build_posteriors)"})
    lmbr_lambda: Optional[float] = field(
        default=None, metadata={"help": "LMBR: weight of the NMT log-probs against the evidence (default 1 / "
                                        "number of models); scores, and var-*'s delta, stay in NMT log-prob units"})
    lmbr_theta0: Optional[float] = field(
        default=None, metadata={"help": "LMBR: per-word constant Theta0 (default -1/T of Tromble et al.)"})
    lmbr_p: float = field(default=0.85, metadata={"help": "LMBR linear-BLEU precision p (Tromble et al. 2008)"})
    lmbr_r: float = field(default=0.72, metadata={"help": "LMBR linear-BLEU precision ratio r"})
    token_masks: Optional[str] = field(
        default=None, metadata={"help": "per-sentence token masks applied before top-k: JSON lines "
                                        "{\"id\": n, \"allow\": [token ids]} or {\"id\": n, \"ban\": [...]}"})
    iad_ngram: int = field(
        default=2, metadata={"help": "iad: after a mismatch, copy again once the output's last n tokens "
                                     "occur exactly once in the source"})
    block_size: int = field(
        default=0, metadata={"help": "aggressive decoding: most draft tokens verified per pass (0 = auto: "
                                     "iad: the whole remaining source for one row, 8 when batched; "
                                     "gad: the drafter's trained --draft-block-size, 4 with --draft-lookup)"})
    draft_min_reach: Optional[float] = field(
        default=None, metadata={"help": "aggressive decoding: verify a draft position only while its estimated "
                                        "chance of being reached (all earlier drafts accepted, measured online) "
                                        "is at least this; 0 = verify every draft token; default: 0.25 for gad, "
                                        "0 for iad (see docs/benchmarks.md). Output unchanged"})
    drafter: Optional[str] = field(
        default=None, metadata={"help": "gad: block_drafter checkpoint (scripts/train_drafter.sh) with the "
                                        "verifier's target dictionary"})
    draft_lookup: Optional[str] = field(
        default=None, metadata={"help": "gad, instead of --drafter: draft from the n-gram statistics of this "
                                        "target-side text (one sentence per line, tokenized and segmented like "
                                        "the model's target; best the model's greedy output on training "
                                        "sources) and from repeats in the output itself: no drafter model"})
    draft_lookup_order: int = field(
        default=2, metadata={"help": "gad with --draft-lookup: longest context of the n-gram table"})
    no_draft_switch: bool = field(
        default=False, metadata={"help": "gad: draft in every pass (default with --gad-beta 1: passes go "
                                         "without drafts while those cost less time per output token, "
                                         "re-measured now and then; output unchanged. GAD++ always drafts: "
                                         "its output depends on the drafts)"})
    gad_beta: int = field(
        default=1, metadata={"help": "gad: accept a draft token among the verifier's top-beta (1 = strict "
                                     "top-1 = greedy output; >1 = GAD++)"})
    gad_tau: float = field(
        default=math.inf, metadata={"help": "gad++: a draft token must also lie within tau of the "
                                                "verifier's top-1 log-probability (default: no bound)"})
    stream_profile: bool = field(
        default=False, metadata={"help": "synchronize CUDA around model calls so the model vs "
                                         "bookkeeping time split is exact"})


def unsupported_generation_options(args, extra_gen_cls_kwargs, prefix_allowed_tokens_fn,
                                   decoding: str = "beam") -> list[str]:
    """fairseq generation options that `decoding` does not implement (use --decoding fairseq).
    Refused too, rather than ignored: --score-reference (fairseq scores the reference instead of
    decoding) and --sampling-topk/--sampling-topp (they mean sampling)."""
    bad = []
    aggressive = str(decoding) in ("iad", "gad")
    checks = [
        ("score_reference", lambda v: bool(v), "--score-reference"),
        ("sampling", lambda v: bool(v), "--sampling"),
        ("sampling_topk", lambda v: v is not None and v >= 0, "--sampling-topk"),
        ("sampling_topp", lambda v: v is not None and v >= 0, "--sampling-topp"),
        ("diverse_beam_groups", lambda v: v is not None and v > 0, "--diverse-beam-groups"),
        ("diversity_rate", lambda v: v is not None and v > -1, "--diversity-rate"),
        ("match_source_len", lambda v: aggressive and bool(v), "--match-source-len"),
        ("constraints", lambda v: bool(v), "--constraints"),
        ("no_repeat_ngram_size", lambda v: aggressive and v is not None and v > 0, "--no-repeat-ngram-size"),
        ("print_alignment", lambda v: aggressive and bool(v), "--print-alignment"),
        ("lm_path", lambda v: aggressive and v is not None, "--lm-path"),
    ]
    for name, is_set, flag in checks:
        if is_set(getattr(args, name, None)):
            bad.append(flag)
    if prefix_allowed_tokens_fn is not None:
        bad.append("prefix_allowed_tokens_fn")
    lm = extra_gen_cls_kwargs and extra_gen_cls_kwargs.get("lm_model") is not None
    if aggressive and lm and "--lm-path" not in bad:
        bad.append("--lm-path")
    return bad


def plugin_fields() -> List[dataclasses.Field]:
    """The options this plugin adds to fairseq's TranslationConfig, in declaration order (what
    other front ends, e.g. decode_corpus, expose so that they cannot drift from the task)."""
    base = {f.name for f in dataclasses.fields(TranslationConfig)}
    return [f for f in dataclasses.fields(StreamBeamConfig) if f.name not in base]


def finalize_rule(decoding: str, finalize: str) -> str:
    """The finalization rule a beam decoding uses: `--finalize`, with auto = sticky for var-*."""
    finalize = str(finalize)
    if finalize != "auto":
        return finalize
    return "sticky" if str(decoding).startswith("var-") else "fairseq"


class UsageError(ValueError):
    """An option that contradicts another or is out of range. A command line reports it in one line
    on stderr, without a traceback (see `install_usage_error_hook`); Python callers catch a ValueError."""


def install_usage_error_hook() -> None:
    """Print an uncaught UsageError as `prog: error: message` (as argparse does) instead of a
    traceback; any other exception goes to the previous hook. Installed once per process."""
    previous = sys.excepthook
    if getattr(previous, "streambeam_usage_hook", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, UsageError):
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            print(f"{prog}: error: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    hook.streambeam_usage_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _opt(cfg, name: str):
    """Option `name` of a task config or an argparse namespace (fairseq may parse with defaults
    suppressed, so a namespace can lack an option: then its default)."""
    if hasattr(cfg, name):
        return getattr(cfg, name)
    default = _DEFAULTS[name]
    return None if default is dataclasses.MISSING else default


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StreamBeamConfig)}


def check_options(cfg, files: bool = True) -> None:
    """Every check of the plugin's options that needs no model and no generation option: ranges,
    options that only apply to some decodings, and (`files`) files that must exist. Raises
    UsageError naming the option, the value and what is allowed. Run when the task is built,
    before a model loads, and on a command line also when the arguments are parsed
    (`check_at_parse_time`, without the files: a parsed command may name a file that an earlier
    step of a script has yet to write)."""
    o = lambda name: _opt(cfg, name)  # noqa: E731
    decoding, rule = str(o("decoding")), finalize_rule(o("decoding"), o("finalize"))
    beam_modes = decoding not in ("iad", "gad", "fairseq")
    ranges = [
        ("prune_abs_threshold", lambda v: v is None or v > 0, "> 0"),
        ("prune_max_cands", lambda v: v is None or v >= 0, ">= 0 (0 = unlimited)"),
        ("finish_count", lambda v: v is None or v >= 1, ">= 1"),
        ("refill_eps", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("stream_candidates", lambda v: v is None or v >= 1, ">= 1"),
        ("stream_window", lambda v: v >= 1, ">= 1"),
        ("max_wait_steps", lambda v: v >= 0, ">= 0 (0 = off)"),
        ("lmbr_lambda", lambda v: v is None or v > 0, "> 0"),
        ("lmbr_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("lmbr_r", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("iad_ngram", lambda v: v >= 1, ">= 1"),
        ("block_size", lambda v: v >= 0, ">= 0 (0 = auto)"),
        ("draft_min_reach", lambda v: v is None or 0 <= v <= 1, "in [0, 1]"),
        ("draft_lookup_order", lambda v: v >= 1, ">= 1"),
        ("gad_beta", lambda v: v >= 1, ">= 1"),
        ("gad_tau", lambda v: v >= 0, ">= 0"),
    ]
    for name, ok, allowed in ranges:
        if not ok(o(name)):
            raise UsageError(f"{_flag(name)} must be {allowed}, got {o(name)}")
    if not decoding.startswith("var-") and (o("prune_abs_threshold") is not None or o("prune_max_cands") is not None):
        raise UsageError(f"--prune-abs-threshold and --prune-max-cands apply to var-batch and var-stream, "
                         f"not --decoding {decoding}")
    if o("finish_count") is not None and (not beam_modes or rule != "sticky"):
        raise UsageError(FINISH_COUNT_NEEDS_STICKY)
    if not beam_modes and (o("lmbr_posteriors") or o("token_masks")):
        raise UsageError(f"--lmbr-posteriors and --token-masks apply to the beam decodings, not --decoding {decoding}")
    gad_only = [n for n in ("drafter", "draft_lookup", "no_draft_switch") if o(n)]
    gad_only += [n for n in ("gad_beta", "gad_tau") if o(n) != _DEFAULTS[n]]
    if decoding != "gad" and gad_only:
        verb = "applies" if len(gad_only) == 1 else "apply"
        raise UsageError(f"{', '.join(_flag(n) for n in gad_only)} {verb} to --decoding gad, not --decoding {decoding}")
    if decoding == "gad":
        if not o("drafter") and not o("draft_lookup"):
            raise UsageError("--decoding gad needs --drafter PATH (a block_drafter checkpoint, see "
                             "scripts/train_drafter.sh) or --draft-lookup TEXT (target-side text for an n-gram table)")
        if o("drafter") and o("draft_lookup"):
            raise UsageError("--decoding gad takes --drafter or --draft-lookup, not both")
    if not files:
        return
    for name in ("lmbr_posteriors", "token_masks", "draft_lookup", "drafter"):
        path = o(name)
        if path and not os.path.isfile(path):
            raise UsageError(f"{_flag(name)} {path}: no such file")
    if o("drafter") and not is_checkpoint_file(o("drafter")):
        raise UsageError(f"--drafter {o('drafter')} is not a checkpoint (a file written by torch.save, e.g. "
                         "checkpoint_best.pt of scripts/train_drafter.sh)")


def check_generation_options(cfg, gen) -> None:
    """Checks that need fairseq's generation options as well (`gen`: GenerationConfig or a
    namespace): generation options a plugin decoding does not implement, and --nbest against the
    hypotheses a source gets."""
    decoding = str(_opt(cfg, "decoding"))
    if decoding == "fairseq":
        return
    bad = unsupported_generation_options(gen, None, None, decoding)
    if bad:
        raise UsageError(f"--decoding {decoding} does not support {', '.join(bad)}; use --decoding fairseq for those")
    nbest, beam = getattr(gen, "nbest", 1) or 1, getattr(gen, "beam", 5) or 5
    if decoding in ("iad", "gad"):
        if nbest > 1:
            raise UsageError(f"--decoding {decoding} is greedy: it returns one hypothesis (--nbest 1)")
        return
    try:
        finished_per_source(finalize_rule(decoding, _opt(cfg, "finalize")), 1 if decoding == "greedy" else beam,
                            _opt(cfg, "finish_count"), nbest)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_at_parse_time(parser) -> None:
    """Make `parser` (fairseq's command-line parser, once the task's options are on it) check the
    plugin's options right after parsing and report a bad one as argparse does: one line
    `prog: error: ...` and exit status 2 (without the usage text), before fairseq loads a model. fairseq's own checks of
    generation options (e.g. --sampling needs --nbest = --beam) run later, in its main."""
    parse = parser.parse_known_args

    def parse_and_check(args=None, namespace=None):
        ns, extra = parse(args, namespace)
        try:
            check_options(ns, files=False)
            check_generation_options(ns, ns)
        except UsageError as e:  # parser.error would print fairseq's usage: hundreds of lines
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        return ns, extra

    parser.parse_known_args = parse_and_check


def is_checkpoint_file(path: str) -> bool:
    """A file torch.save wrote: a zip archive (the default format) or a pickle (the legacy one)."""
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
