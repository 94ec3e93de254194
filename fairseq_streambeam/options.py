"""Command-line options of the plugin: fields of the task's dataclass, checked at parse time and
reported in one line; their meaning and validation live in spec.py (`DecodeSpec`)."""

import contextlib
import dataclasses
import math
import multiprocessing
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks.translation import TranslationConfig

from .spec import ADMIT_ORDERS, DECODINGS, ORDERS, UsageError, check_files, count_problem, from_cli, model_files_problem
from .textio import BPE_FILES, bpe_problem, file_problem

DECODING_CHOICES = ChoiceEnum(list(DECODINGS))
ORDER_CHOICES = ChoiceEnum([o for o in ORDERS if o != "fifo"])  # fifo (paper A.2): a bench variant
ADMIT_CHOICES = ChoiceEnum(list(ADMIT_ORDERS))


def _option(default, help_text: str):
    """A task option: fairseq builds its command-line flag from the field, with this help."""
    return field(default=default, metadata={"help": help_text})


@dataclass
class StreamBeamConfig(TranslationConfig):
    decoding: DECODING_CHOICES = _option("beam", "beam: fixed beam (= fairseq's output); greedy: beam 1; var-batch: "
                                                 "variable-width beams (delta, M) per batch; var-stream: "
                                                 "variable-width beams with streaming refill (Yang et al. 2020); "
                                                 "fixed-stream: fixed beam, streamed; iad: input-guided aggressive "
                                                 "decoding (= greedy output, Ge et al. 2022); gad: generalized "
                                                 "aggressive decoding, drafts by a --drafter model or a --draft-lookup "
                                                 "table (= greedy output with "
                                                 "--gad-beta 1; GAD++ otherwise); fairseq: fairseq's own "
                                                 "SequenceGenerator")
    prune_abs_threshold: Optional[float] = _option(None, "delta: drop candidates more than delta below the best "
                                                         "(var-* only; default 1.5)")
    prune_max_cands: Optional[int] = _option(None, "M: at most M children per parent (var-* only; default 5)")
    finish_count: Optional[int] = _option(None, "z: finished hypotheses that end a source under the sticky rule "
                                                "(default: the beam size k, as in Yang et al.'s runs); --nbest may not "
                                                "exceed it. var-batch and var-stream only: beam, greedy and "
                                                "fixed-stream finish k as fairseq does")
    refill_eps: float = _option(1 / 6, "eps: refill when fewer than eps*n sources are live (streaming)")
    stream_order: ORDER_CHOICES = _option("min-length", "which cohort steps next when streaming: min-length (the "
                                                        "paper), or continuous: every live source steps in one decoder "
                                                        "call whatever its prefix length (fairseq transformer "
                                                        "decoders; others use min-length)")
    stream_admit: ADMIT_CHOICES = _option("shortest-first", "order in which streaming admits a window's sources: "
                                                            "shortest-first keeps cohorts' lengths alike (little "
                                                            "padding); longest-first starts long outputs early, so the "
                                                            "window's last steps are fuller (same output)")
    stream_candidates: Optional[int] = _option(None, "streaming: refill by live beam candidates instead of sources: "
                                                     "keep about this many candidates per decoder step (--batch-size "
                                                     "still caps the sources)")
    stream_window: int = _option(32, "streaming modes: hand the generator windows of this many fairseq batches; "
                                     "--batch-size/--max-tokens stay the live budget n")
    max_wait_steps: int = _option(0, "latency bound: step a cohort first once it has waited this many decoder steps "
                                     "(0 = off; output unchanged)")
    compile: bool = _option(False, "on the CPU, run the decoder layers' math through torch.compile (inductor); on "
                                   "CUDA, replay beam steps as CUDA graphs: compiles or captures a few graphs at the "
                                   "start; scores move in their last bits")
    lmbr_posteriors: Optional[str] = _option(None, "LMBR n-gram posteriors (JSON lines by sentence id, from "
                                                   "python -m fairseq_streambeam.scorers.build_posteriors)")
    lmbr_lambda: Optional[float] = _option(None, "LMBR: weight of the NMT log-probs against the evidence (var-*: "
                                                 "default 1 / number of models; beam, greedy, fixed-stream: required, "
                                                 "from streambeam-calibrate); scores, and var-*'s delta, stay in NMT "
                                                 "log-prob units")
    lmbr_theta0: Optional[float] = _option(None, "LMBR: per-word constant Theta0 (default -1/T of Tromble et al.)")
    lmbr_p: float = _option(0.85, "LMBR linear-BLEU precision p (Tromble et al. 2008)")
    lmbr_r: float = _option(0.72, "LMBR linear-BLEU precision ratio r")
    token_masks: Optional[str] = _option(None, "per-sentence token masks applied before top-k: JSON lines "
                                               "{\"id\": n, \"allow\": [token ids]} or {\"id\": n, \"ban\": [...]}")
    iad_ngram: int = _option(2, "iad: after a mismatch, copy again once the output's last n tokens occur exactly once "
                                "in the source")
    block_size: int = _option(0, "aggressive decoding: most draft tokens verified per pass (0 = auto: iad: the whole "
                                 "remaining source for one row, 8 when batched; gad: the drafter's trained "
                                 "--draft-block-size, 4 with --draft-lookup)")
    draft_min_reach: Optional[float] = _option(None, "aggressive decoding: verify a draft position only while its "
                                                     "estimated chance of being reached (all earlier drafts accepted, "
                                                     "measured online) is at least this; 0 = verify every draft token; "
                                                     "default: 0.25 for gad, 0 for iad (see docs/benchmarks.md). "
                                                     "Output unchanged")
    drafter: Optional[str] = _option(None, "gad: block_drafter checkpoint (scripts/train_drafter.sh) with the "
                                           "verifier's target dictionary")
    draft_lookup: Optional[str] = _option(None, "gad, instead of --drafter: draft from the n-gram statistics of this "
                                                "target-side text (one sentence per line, tokenized and segmented like "
                                                "the model's target; best the model's greedy output on training "
                                                "sources) and from repeats in the output itself: no drafter model")
    draft_lookup_order: int = _option(2, "gad with --draft-lookup: longest context of the n-gram table")
    gad_beta: int = _option(1, "gad: accept a draft token among the verifier's top-beta (1 = strict top-1 = greedy "
                               "output; >1 = GAD++)")
    gad_tau: float = _option(math.inf, "gad++: a draft token must also lie within tau of the verifier's top-1 "
                                       "log-probability (default: no bound)")


def plugin_fields() -> List[dataclasses.Field]:
    """The options this plugin adds to fairseq's TranslationConfig, in declaration order (what
    other front ends, e.g. decode_corpus, expose so that they cannot drift from the task)."""
    base = {f.name for f in dataclasses.fields(TranslationConfig)}
    return [f for f in dataclasses.fields(StreamBeamConfig) if f.name not in base]


def install_usage_error_hook() -> None:
    """Print an uncaught UsageError as `prog: error: message` and exit with status 2 (as argparse
    does) instead of a traceback; other exceptions go to the previous hook. Installed once."""
    previous = sys.excepthook
    if getattr(previous, "streambeam_usage_hook", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, UsageError):
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            print(f"{prog}: error: {value}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            for child in multiprocessing.active_children():  # e.g. fairseq-generate's data-loader worker,
                with contextlib.suppress(OSError):  # which would print a traceback of its own when its
                    child.terminate()  # connection drops (OSError: already gone)
            os._exit(2)  # argparse's status for a usage error (an excepthook cannot raise SystemExit)
        else:
            previous(kind, value, tb)

    hook.streambeam_usage_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def refuse_in_interactive(spec, print_alignment: Optional[str]) -> None:
    """What fairseq-interactive cannot do: files keyed by a data-bin split's sentence ids (LMBR
    posteriors, token masks: it numbers its input lines itself, so they would score the wrong
    sentences), and soft alignments (fairseq 0.12.3's interactive.py unpacks hard ones only: a
    ValueError after the models load, with `--decoding fairseq` too)."""
    for flag, value in (("--lmbr-posteriors", spec.lmbr_posteriors), ("--token-masks", spec.token_masks)):
        if value:
            raise UsageError(f"{flag} keys sentences by their id in a data-bin split; fairseq-interactive "
                             "numbers its input lines itself: use fairseq-generate (streambeam-generate)")
    if print_alignment == "soft":
        raise UsageError("--print-alignment soft: fairseq-interactive prints hard alignments only; use "
                         "--print-alignment hard, or fairseq-generate (streambeam-generate)")


def check_at_parse_time(parser) -> None:
    """Make fairseq's `parser` (with the task's options) build the decoding spec right after parsing
    and report a bad option in one line with exit status 2, as argparse does (not fairseq's hundreds
    of lines of usage), before a model loads. fairseq-generate's and -interactive's checkpoints,
    dictionaries, BPE model and the decoding's own files are checked too (they load next, after
    fairseq-generate has opened its --results-path file); other parsers' decoding files are checked
    when the task is built (a script may write them after parsing)."""
    parse = parser.parse_known_args

    def parse_and_check(args=None, namespace=None):
        ns, extra = parse(args, namespace)
        try:
            spec = from_cli(ns, ns)
            if hasattr(ns, "buffer_size"):  # fairseq-interactive's parser (its --buffer-size)
                refuse_in_interactive(spec, getattr(ns, "print_alignment", None))
            if hasattr(ns, "path") and hasattr(ns, "beam"):  # generate/interactive: the models load next
                problem = count_problem(ns, ("batch_size", "max_tokens")) or model_files_problem(
                    ns.data, (ns.source_lang, ns.target_lang), checkpoint_files(ns), "")
                bpe = getattr(ns, "bpe", None)
                if problem is None and bpe in BPE_FILES and (
                        hasattr(ns, "sentencepiece_model") or hasattr(ns, "bpe_codes")):  # fairseq's last pass
                    problem = bpe_problem(bpe, getattr(ns, "bpe_codes", None), getattr(ns, "sentencepiece_model", None))
                problem = problem or _results_path_problem(getattr(ns, "results_path", None))
                if problem is None and hasattr(ns, "buffer_size") and getattr(ns, "input", "-") != "-":
                    problem = file_problem("--input", ns.input)  # fairseq-interactive reads it after loading
                if problem:
                    raise UsageError(problem)
                check_files(spec)
        except UsageError as e:
            parser.error(str(e))  # one line (set below)
        return ns, extra

    parser.parse_known_args = parse_and_check
    # argparse's mistakes in the task's options (a bad choice, a bad number) and unknown options in
    # one line too, not after fairseq's usage; fairseq's own options are parsed before add_args runs
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")


def _results_path_problem(path: Optional[str]) -> Optional[str]:
    """Why fairseq-generate cannot make its --results-path folder (it would end in a traceback)."""
    if not path:
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--results-path {path}: not a directory"
    up = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(up):
        up = os.path.dirname(up)
    return None if os.path.isdir(up) else f"--results-path {path}: {up} is not a directory"


def checkpoint_files(ns) -> Optional[str]:
    """The files fairseq-generate's `--path` loads, os.pathsep-separated: with --checkpoint-suffix,
    and sharded (`-shard{i}.pt`, `_part{i}.pt` with --checkpoint-shard-count), as
    checkpoint_utils.load_model_ensemble names them."""
    from fairseq.checkpoint_utils import get_maybe_sharded_checkpoint_filename

    if not ns.path or "://" in ns.path:
        return ns.path
    suffix, shards = getattr(ns, "checkpoint_suffix", "") or "", getattr(ns, "checkpoint_shard_count", 1) or 1
    return os.pathsep.join(get_maybe_sharded_checkpoint_filename(p, suffix, i, shards)
                           for p in ns.path.split(os.pathsep) for i in range(shards))
