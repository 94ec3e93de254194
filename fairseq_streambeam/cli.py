"""Console commands: `streambeam-generate` and `streambeam-interactive` are fairseq-generate and
fairseq-interactive with this plugin's `--user-dir` and `--task streambeam_translation` filled in;
`streambeam-decode-corpus`, `streambeam-calibrate` and `streambeam-serve` are `python -m` of
fairseq_streambeam.decode_corpus, .calibrate and .serve.

A relative `--user-dir fairseq_streambeam` resolves against the working directory, so it works only
from the checkout root; these commands pass the installed package's absolute path instead, and so
work from any directory. An option the user gives is kept as given. Their `--help` also lists the
task's options (fairseq's prints its help before it adds them, so `--decoding` would be missing).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time
import warnings
from typing import List, Optional

from . import malloc
from .frontend import fairseq_log_level
from .textio import missing_paths, remove_empty

# the directory fairseq's import_user_module finds in this package's __path__ (so it imports nothing twice)
PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
TASK = "streambeam_translation"


def _given(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_plugin(argv: List[str]) -> List[str]:
    """`argv` (program name first) with `--user-dir PLUGIN_DIR` and `--task streambeam_translation`
    added after the program name, each unless the user gave that option."""
    extra: List[str] = []
    if not _given(argv[1:], "--user-dir"):
        extra += ["--user-dir", PLUGIN_DIR]
    if not _given(argv[1:], "--task"):
        extra += ["--task", TASK]
    return argv[:1] + extra + argv[1:]


def _show_help_with_task_options(interactive: bool) -> None:
    """Print the help of fairseq-generate (or -interactive) including the options of the task given
    on the command line, and exit. fairseq adds a task's options only after its first parse, where
    argparse has already printed the help."""
    from fairseq import options
    from fairseq.tasks import TASK_REGISTRY

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--task")
    task = pre.parse_known_args(sys.argv[1:])[0].task

    def add_task_options(parser: argparse.ArgumentParser) -> None:
        if task in TASK_REGISTRY:  # the user dir is imported by now
            TASK_REGISTRY[task].add_args(parser)

    parser = options.get_interactive_generation_parser() if interactive else options.get_generation_parser()
    options.parse_args_and_arch(parser, modify_parser=add_task_options)


class _AlreadyImported(logging.Filter):
    """fairseq adapter: fairseq's import_user_module logs "--user-dir=... has already been imported"
    at INFO when the plugin is in sys.modules, as it always is for these commands (they live in it):
    a line before every one-line error and every run. Only that record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "has already been imported" not in record.getMessage()


_ALREADY_IMPORTED = _AlreadyImported()  # one instance: addFilter adds the same object once


def _fairseq_command(interactive: bool) -> None:
    sys.argv = with_plugin(sys.argv)
    logging.getLogger("fairseq.utils").addFilter(_ALREADY_IMPORTED)
    fairseq_log_level()
    # fairseq adapter: fairseq builds its config with Hydra's deprecated compose API, and Hydra warns
    # of that in about 20 lines at every run, before any log or error line; its warnings name hydra
    warnings.filterwarnings("ignore", message=r"(?s).*hydra", category=UserWarning)
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        _show_help_with_task_options(interactive)
    malloc.retain_freed_memory()
    if interactive:
        from fairseq_cli.interactive import cli_main
    else:
        from fairseq_cli.generate import cli_main
    new = [] if interactive else missing_paths(_results_file(sys.argv))
    try:
        cli_main()
    except Exception as e:  # noqa: BLE001 (only fairseq's usage failures are turned into one line)
        message = fairseq_usage_error(e)
        if message is None:
            raise
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
        _end_batch_prefetch()
        remove_empty(new)
        sys.exit(2)  # argparse's status for a usage error


def _results_file(argv: List[str]) -> Optional[str]:
    """fairseq adapter: the file fairseq-generate writes under --results-path (generate-SUBSET.txt),
    which it creates before it loads the model and the data, so before their usage errors; None
    without --results-path."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--results-path")
    pre.add_argument("--gen-subset", default="test")
    a = pre.parse_known_args(argv[1:])[0]
    return None if a.results_path is None else os.path.join(a.results_path, f"generate-{a.gen_subset}.txt")


def _end_batch_prefetch(timeout: float = 10.0) -> None:
    """fairseq adapter: fairseq-generate reads batches through iterators.BufferedIterator, whose
    daemon thread (BackgroundConsumer) may be inside torch when an error ends the run early, and
    finalizing the interpreter then aborts the process ("terminate called without an active
    exception", SIGABRT) instead of exiting with the error's status. Each such thread is let end
    after the batch it is reading: it is told to read no more (its `_max_len`) and its queue drained."""
    from fairseq.data.iterators import BackgroundConsumer

    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if isinstance(thread, BackgroundConsumer):
            thread._max_len = 0
            while thread.is_alive() and time.monotonic() < deadline:
                try:
                    thread._queue.get(timeout=0.05)
                except queue.Empty:
                    pass


def fairseq_usage_error(e: BaseException) -> Optional[str]:
    """One line for a usage mistake, which fairseq reports with a traceback (None: not one): the
    plugin's own (spec.UsageError, e.g. a source longer than the model's positions, or --min-len
    above a source's length limit), or one in fairseq's options: a missing split, or a data directory
    or checkpoint that parsing could not check (a URL: FileNotFoundError, or load_checkpoint's
    OSError "Model file not found"), an option that fairseq asserts on (its messages name the
    option), or a mandatory option left unset (omegaconf's MissingMandatoryValue, e.g. --bpe
    sentencepiece without --sentencepiece-model)."""
    from .spec import UsageError

    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, UsageError):
        return first
    if isinstance(e, FileNotFoundError) or (isinstance(e, OSError) and first.startswith("Model file not found")):
        return first
    if isinstance(e, AssertionError) and first.startswith("--"):
        return first
    if type(e).__name__ == "MissingMandatoryValue":
        key = getattr(e, "full_key", None) or first
        return f"missing value for {key} (e.g. --{str(key).split('.')[-1].replace('_', '-')})"
    return None


def generate() -> None:
    """`streambeam-generate`: fairseq-generate with the plugin."""
    _fairseq_command(interactive=False)


def interactive() -> None:
    """`streambeam-interactive`: fairseq-interactive with the plugin."""
    _fairseq_command(interactive=True)


def decode_corpus(argv: Optional[List[str]] = None) -> int:
    """`streambeam-decode-corpus`: sharded, resumable decoding (imported when run, so the other
    two commands do not load it)."""
    from fairseq_streambeam.decode_corpus import main

    return main(argv)


def calibrate(argv: Optional[List[str]] = None) -> int:
    """`streambeam-calibrate`: pruning and LMBR settings from a dev set (imported when run)."""
    from fairseq_streambeam.calibrate import main

    return main(argv)


def serve(argv: Optional[List[str]] = None) -> int:
    """`streambeam-serve`: the translation server (imported when run)."""
    from fairseq_streambeam.serve import main

    return main(argv)
