"""The options of the plugin's own front ends (decode_corpus, serve): the model and its text
processing, fairseq-generate's generation options and the task's decoding options, parsed by one
parser and checked before any model loads, so that a usage mistake is one line and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
import typing

from .options import plugin_fields
from .spec import DECODINGS, UsageError, check_files, count_problem, from_cli, model_files_problem
from .textio import BPES, bpe_problem, tokenizers

# the front ends' default and choices for the task's --decoding: streaming by default, and not
# `fairseq` (fairseq's stock generator keeps no counters and has no online loop)
DECODING_DEFAULT = "var-stream"
DECODING_CHOICES = tuple(d for d in DECODINGS if d != "fairseq")

# fairseq-generate's generation options that the plugin's decodings take, with fairseq's defaults
# and help (--prefix-size needs reference targets, which raw text does not have)
GENERATION_OPTIONS = ("beam", "nbest", "lenpen", "unkpen", "max_len_a", "max_len_b", "min_len", "temperature",
                      "unnormalized", "no_repeat_ngram_size", "match_source_len")


def fairseq_log_level() -> None:
    """fairseq adapter: importing fairseq runs wav2vec2_classification's logging.basicConfig(level=DEBUG),
    leaving the root logger at DEBUG with a handler, so fairseq-generate's own basicConfig (level
    LOGLEVEL, default INFO) changes nothing and libraries' debug records reach stderr (hydra's, asyncio's,
    matplotlib's; under --compile hundreds of torch inductor's file locks). The plugin's commands set
    the level fairseq-generate asks for."""
    logging.getLogger().setLevel(os.environ.get("LOGLEVEL", "INFO").upper())


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, unless the help states its own (a default that depends on
    the decoding is None or inf in the parser) or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        none = action.default is None or action.default is False  # (0 == False: a default of 0 is shown)
        return text if "default" in text or none else super()._get_help_string(action)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model, its dictionaries and text processing, the live budget, threads and precision
    (the decoding options: add_generation_options and add_task_options)."""
    p.add_argument("--data", required=True, help="directory with the model's dictionaries")
    p.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
    p.add_argument("-s", "--source-lang", required=True)
    p.add_argument("-t", "--target-lang", required=True)
    p.add_argument("--tokenizer", default="none", choices=tokenizers())
    p.add_argument("--bpe", default="none", choices=BPES)
    p.add_argument("--bpe-codes")
    p.add_argument("--sentencepiece-model")
    p.add_argument("--batch-size", type=int, default=64, help="sources decoded together (the paper's n)")
    p.add_argument("--max-tokens", type=int, help="most source tokens decoded together (with --batch-size)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--fp16", action="store_true", help="half-precision models (model.half(), as fairseq-generate "
                   "--fp16, which does so on a CPU too); scores stay float32")


def check_model_options(args: argparse.Namespace, positive: typing.Sequence[str]) -> None:
    """Every check that needs no model: the decoding spec (spec.from_cli), the files it names, the
    `positive` counts, and that the dictionaries, checkpoints and BPE files exist."""
    check_files(from_cli(args, args))
    problem = count_problem(args, positive) or model_files_problem(
        args.data, (args.source_lang, args.target_lang), args.path) or bpe_problem(
        args.bpe, args.bpe_codes, args.sentencepiece_model)
    if problem:
        raise UsageError(problem)


@dataclasses.dataclass
class LoadedModel:
    task: typing.Any  # the plugin's task (task.StreamBeamTranslationTask)
    codec: typing.Any  # raw text <-> ids (textio.TextCodec)
    models: list
    cuda: bool


def load_model(args: argparse.Namespace, cuda: bool) -> LoadedModel:
    """The task with the plugin's options of `args`, its text codec and the checkpoints (checked
    options: check_model_options), on CUDA if `cuda`, in half precision if --fp16."""
    import torch

    from .loader import load_models, load_task
    from .textio import TextCodec

    torch.set_num_threads(args.threads)
    task = load_task(args.data, args.source_lang, args.target_lang,
                     **{f.name: getattr(args, f.name) for f in plugin_fields()})
    codec = TextCodec(task, args.tokenizer, args.bpe, args.bpe_codes, args.sentencepiece_model)
    return LoadedModel(task, codec, load_models(task, args.path, cuda, args.fp16), cuda)


def add_generation_options(p) -> None:
    """fairseq's GenerationConfig fields in GENERATION_OPTIONS, with its types, defaults and help."""
    from fairseq.dataclass.configs import GenerationConfig

    fields = {f.name: f for f in dataclasses.fields(GenerationConfig)}
    for name in GENERATION_OPTIONS:
        _add_field(p, fields[name])


def add_task_options(p, auto: typing.Optional[typing.Dict[str, str]] = None) -> None:
    """Every option the plugin adds to its task (options.plugin_fields), with the task's types,
    defaults and help: the task's dataclass is the one list, so the two cannot drift apart.
    `auto`: options whose default is "auto", resolved by the front end as the text says."""
    for f in plugin_fields():
        _add_field(p, f, (auto or {}).get(f.name))


def _add_field(p, f: dataclasses.Field, auto: typing.Optional[str] = None) -> None:
    """Dataclass field `f` as an option, with its type, default and help."""
    name, kind, default = "--" + f.name.replace("_", "-"), f.type, f.default
    help_text = str(f.metadata.get("help", "")).replace("%", "%%")
    if auto:
        default, help_text = "auto", f"{help_text} (default auto: {auto})"
    if f.name == "decoding":  # the task's --decoding fairseq (its own generator) is not one of the choices here
        help_text = help_text.split("; fairseq: ")[0]
        p.add_argument(name, default=DECODING_DEFAULT, choices=DECODING_CHOICES, help=help_text)
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):  # fairseq ChoiceEnum
        p.add_argument(name, default=default, choices=[str(c.value) for c in kind], help=help_text)
    elif kind is bool:
        p.add_argument(name, action="store_true", default=default, help=help_text)
    else:
        inner = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if len(inner) != 1 or inner[0] not in (int, float, str):
            raise TypeError(f"front ends cannot expose option {f.name} of type {kind}")
        p.add_argument(name, type=inner[0], default=default, help=help_text)
