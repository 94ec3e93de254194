"""Command-line options of the plugin (fields of the task's dataclass) and their validation."""

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks.translation import TranslationConfig

DECODING_CHOICES = ChoiceEnum(["beam", "greedy", "var-batch", "var-stream", "fixed-stream", "iad", "gad", "fairseq"])
FINALIZE_CHOICES = ChoiceEnum(["auto", "fairseq", "sticky"])
ORDER_CHOICES = ChoiceEnum(["min-length", "fifo"])


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
        default=None, metadata={"help": "z: finished hypotheses that end a source under the sticky rule (default "
                                        "--beam k, as Yang et al.'s runs); --nbest prints at most z. An error "
                                        "with the fairseq rule, which always finishes k"})
    refill_eps: float = field(
        default=1 / 6, metadata={"help": "eps: refill when fewer than eps*n sources are live (streaming)"})
    stream_order: ORDER_CHOICES = field(
        default="min-length", metadata={"help": "which cohort steps next when streaming: min-length "
                                                "(the paper) or fifo (paper A.2)"})
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
        default=None, metadata={"help": "LMBR: weight of the NMT log-probs (default 0.5 / number of models)"})
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


def unsupported_generation_options(args, extra_gen_cls_kwargs, prefix_allowed_tokens_fn) -> list[str]:
    """fairseq generation options this generator does not implement (use --decoding fairseq)."""
    bad = []
    checks = [
        ("sampling", lambda v: bool(v), "--sampling"),
        ("diverse_beam_groups", lambda v: v is not None and v > 0, "--diverse-beam-groups"),
        ("diversity_rate", lambda v: v is not None and v > -1, "--diversity-rate"),
        ("match_source_len", lambda v: bool(v), "--match-source-len"),
        ("constraints", lambda v: bool(v), "--constraints"),
        ("no_repeat_ngram_size", lambda v: v is not None and v > 0, "--no-repeat-ngram-size"),
        ("print_alignment", lambda v: bool(v), "--print-alignment"),
        ("lm_path", lambda v: v is not None, "--lm-path"),
    ]
    for name, is_set, flag in checks:
        if is_set(getattr(args, name, None)):
            bad.append(flag)
    if prefix_allowed_tokens_fn is not None:
        bad.append("prefix_allowed_tokens_fn")
    if extra_gen_cls_kwargs and extra_gen_cls_kwargs.get("lm_model") is not None and "--lm-path" not in bad:
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
