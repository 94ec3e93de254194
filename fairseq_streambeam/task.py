"""fairseq adapter: the `streambeam_translation` task.

A TranslationTask that builds the generator of its decoding spec (spec.py) with the drafter and
scorers the spec names, never drops input sentences, and in streaming decodings hands the generator
windows of `--stream-window` batches: refill spans batch boundaries while `--batch-size` /
`--max-tokens` keep meaning how many sources decode together (the paper's n).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
import warnings
import weakref

import numpy as np
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .drafters.block_model import ModelDrafter
from .drafters.input_copy import InputCopyDrafter
from .drafters.ngram_lookup import LOOKUP_BLOCK, LookupDrafter, NgramTable
from .generators.aggressive import AggressiveGenerator
from .generators.stream_beam import StreamBeamGenerator
from .models.block_drafter import drafter_state, load_drafter
from .options import StreamBeamConfig, check_at_parse_time, install_usage_error_hook
from .runtime.counters import Counters
from .runtime.scheduler import Budget
from .scorers.lmbr import LMBRScorer, Theta, load_posteriors
from .scorers.masks import TokenMaskScorer, load_masks
from .spec import GENERATION, DecodeSpec, UsageError, check_files, from_cli, unknown_problem

logger = logging.getLogger("fairseq_streambeam")


def batching_problem(dataset, max_tokens, max_positions, ignore_invalid_inputs: bool) -> str | None:
    """Why fairseq's batching would stop on `dataset`, in one line: a sentence longer than the
    model's positions (fairseq raises a bare Exception, unless ignore_invalid_inputs skips it), or a
    kept sentence (source or reference) longer than `max_tokens` (fairseq's batch_by_size asserts in
    its Cython, and streaming windows, whose limit is max_tokens times the window, decoded it)."""
    try:
        indices = np.arange(len(dataset), dtype=np.int64)
        if max_positions is not None:
            indices, ignored = dataset.filter_indices_by_size(indices, max_positions)
            if len(ignored) and not ignore_invalid_inputs:
                first = ignored[0]
                return (f"{_named(dataset, first)} has {dataset.num_tokens(first)} tokens, more than the model's "
                        f"positions ({_limits(max_positions)}); --skip-invalid-size-inputs-valid-test skips such "
                        "sentences")
        if max_tokens is None:
            return None
        sizes = np.asarray(dataset.num_tokens_vec(indices))
    except NotImplementedError:  # a dataset without vectorized sizes: fairseq's own checks stand
        return None
    if not len(sizes) or sizes.max() <= max_tokens:
        return None
    i = int(np.argmax(sizes))
    sides = "source" if getattr(dataset, "tgt", None) is None else "source or reference"  # interactive: no reference
    return (f"--max-tokens {max_tokens} is below the {sizes[i]} tokens of {_named(dataset, indices[i])} ({sides}): "
            "raise --max-tokens")


def _limits(max_positions) -> str:
    """fairseq's max_positions, a number or a (source, target) pair, in words."""
    if isinstance(max_positions, tuple) and len(max_positions) == 2:
        return f"source {max_positions[0]}, target {max_positions[1]}"
    return str(max_positions)


def _named(dataset, i: int) -> str:
    """`sentence i` with its first tokens, where the dataset has them: fairseq-interactive numbers
    sentences within each buffer of input lines, so the words are what find the line."""
    try:
        words = dataset.src_dict.string(dataset.src[i][:6])
    except (AttributeError, IndexError, TypeError):
        return f"sentence {i}"
    return f'sentence {i} ("{words} ...")'


@register_task("streambeam_translation", dataclass=StreamBeamConfig)
class StreamBeamTranslationTask(TranslationTask):
    cfg: StreamBeamConfig

    @classmethod
    def add_args(cls, parser):
        """fairseq's options of the dataclass, checked as soon as a command line is parsed; an
        option error found later (e.g. by build_generator) also prints as one line there."""
        super().add_args(parser)
        check_at_parse_time(parser)
        install_usage_error_hook()

    def __init__(self, cfg: StreamBeamConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        # before a model loads; the generation options come with build_generator
        self.spec: DecodeSpec = from_cli(cfg)
        check_files(self.spec)
        self.limits: tuple | None = None  # (sources, source tokens) a batch holds: get_batch_iterator's
        self._drafters: dict = {}  # (file key, device, dtype) -> block_drafter; ("lookup", file key, order) -> table
        self._parsed: dict = {}  # kind -> (file key, content) of the last file of that kind read (_read)
        self.read_files(self.spec)

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           ignore_invalid_inputs=False, required_batch_size_multiple=1, **kwargs):
        """fairseq's batching with two changes: required_batch_size_multiple is 1, because
        fairseq's batch_by_size silently drops a last batch that is not a multiple of it (fairseq
        issues #5036, #5351); and streaming decodings get windows of `stream_window` batches, unless
        the set is split across workers (`num_shards`), which fairseq does by whole batches: each
        worker then decodes the sentences stock fairseq gives it. A limit of 0 or less is none; a
        sentence fairseq cannot batch is a UsageError (batching_problem)."""
        max_tokens = max_tokens if max_tokens is not None and max_tokens > 0 else None
        max_sentences = max_sentences if max_sentences is not None and max_sentences > 0 else None
        problem = batching_problem(dataset, max_tokens, max_positions, ignore_invalid_inputs)
        if problem:
            raise UsageError(problem)
        self.limits = (max_sentences, max_tokens)
        if self.spec.kind.streaming and kwargs.get("num_shards", 1) == 1:
            w = self.spec.stream_window
            max_tokens = None if max_tokens is None else max_tokens * w
            max_sentences = None if max_sentences is None else max_sentences * w
        _quiet_pin_memory_warning()
        return super().get_batch_iterator(
            dataset, max_tokens=max_tokens, max_sentences=max_sentences, max_positions=max_positions,
            ignore_invalid_inputs=ignore_invalid_inputs, required_batch_size_multiple=1, **kwargs)

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None):
        """The generator of the task's options and fairseq's generation options `args`."""
        lm_model = (extra_gen_cls_kwargs or {}).get("lm_model")  # fairseq-generate loads --lm-path
        spec = from_cli(self.cfg, args, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if spec.decoding == "fairseq":
            gen = super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                          extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                          prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
            gen.counters = Counters()  # fairseq's generator counts nothing: inference_step counts for it
            self._report_at_exit(gen, "fairseq")
            return gen
        if seq_gen_cls is not None:
            raise UsageError(f"--decoding {spec.decoding} builds its own generator (seq_gen_cls: --decoding fairseq)")
        return self.generator_for(models, spec, lm_model=lm_model)

    def generator_for(self, models, spec: DecodeSpec, drafter=None, lm_model=None, report_at_exit: bool = True):
        """The plugin's generator for `spec` (its decoding's family), with the drafter and scorers
        its options name; `drafter` replaces the one they name. Batching follows `spec` from now on.
        `report_at_exit`: log the generator's counters when the process ends."""
        check_files(spec)
        self.spec = spec
        d = self.target_dictionary
        if spec.kind.family == "draft":
            gen = AggressiveGenerator(models, d, spec, drafter or self._drafter(spec, models[0]), self.budget_for(spec))
        else:
            gen = StreamBeamGenerator(models, d, spec, self._scorers(spec, len(models)), self.budget_for(spec),
                                      lm_model)
        if report_at_exit:
            self._report_at_exit(gen, spec.decoding)
        return gen

    _run_report: RunReport | None = None

    def _report_at_exit(self, gen, name: str) -> None:
        """Log `gen`'s counters (decoder steps, expansions per step, time split), with those of the
        task's other generators of its decoding, when the process ends."""
        if self._run_report is None:
            self._run_report = RunReport()
        self._run_report.add(gen, name)

    def budget_for(self, spec: DecodeSpec) -> Budget | None:
        """The live budget of `spec`'s generator: the batching's sources and tokens (None before
        any), the spec's own candidate budget (generators of other specs may share this task)."""
        return None if self.limits is None else Budget(*self.limits, spec.stream_candidates)

    def _drafter(self, spec: DecodeSpec, model):
        src_d, tgt_d = self.source_dictionary, self.target_dictionary
        if spec.decoding == "iad":
            # separate dictionaries (e.g. WMT'19 Ru-En): copy each source token as the target token it spells
            vocab_map = None if src_d.symbols == tgt_d.symbols else [tgt_d.index(w) for w in src_d.symbols]
            return InputCopyDrafter(spec.iad_ngram, spec.block_size, vocab_map=vocab_map)
        if spec.drafter:  # loaded once per task (a bench must not time it), on the verifier's device and dtype
            p = next(model.parameters())
            key = (*_file_key(spec.drafter), p.device, p.dtype)
            if key not in self._drafters:
                self._drafters[key] = load_drafter(spec.drafter, self, like=model)
            return ModelDrafter(self._drafters[key], tgt_d, spec.block_size)
        return LookupDrafter(self._lookup_table(spec), bos=tgt_d.eos(), eos=tgt_d.eos(),
                             block_size=spec.block_size or LOOKUP_BLOCK)

    def _lookup_table(self, spec: DecodeSpec) -> NgramTable:
        """The n-gram table of --draft-lookup, built once per task, file version and order."""
        key = ("lookup", *_file_key(spec.draft_lookup), spec.draft_lookup_order)
        if key not in self._drafters:
            try:  # the file's or the order's mistakes are the user's: one line
                self._drafters[key] = NgramTable.from_file(spec.draft_lookup, self.target_dictionary,
                                                           spec.draft_lookup_order)
            except (ValueError, UnicodeDecodeError) as e:
                raise UsageError(f"--draft-lookup {spec.draft_lookup}: {e}") from None
        return self._drafters[key]

    def read_files(self, spec: DecodeSpec) -> None:
        """Parse the files `spec` names (posteriors, token masks, lookup text), so that their
        mistakes come before any model loads; generators built later take what was parsed. A
        drafter is only checked (drafter_state): it is loaded on the verifier's device later."""
        if spec.drafter:
            drafter_state(spec.drafter, self)
        if spec.lmbr_posteriors:
            self.lmbr_posteriors(spec.lmbr_posteriors)
        if spec.token_masks:
            self.token_masks(spec.token_masks)
        if spec.draft_lookup:
            self._lookup_table(spec)

    def _read(self, kind: str, path: str, load):
        """`load(path, vocabulary size)`, once per task while the file stays the same, the last file
        of each kind kept (a benchmark builds a generator per repeat and must not time the parsing;
        the tuner rewrites its file). A file's mistakes (ValueError naming file and line): one line."""
        key, held = _file_key(path), self._parsed.get(kind)
        if held is None or held[0] != key:
            try:
                held = self._parsed[kind] = (key, load(path, len(self.target_dictionary)))
            except ValueError as e:
                raise UsageError(str(e)) from None
        return held[1]

    def lmbr_posteriors(self, path: str) -> dict:
        """The posteriors of `path` (scorers.lmbr), parsed once per file version (_read)."""
        return self._read("posteriors", path, load_posteriors)

    def token_masks(self, path: str) -> dict:
        """The token masks of `path` (scorers.masks), parsed once per file version (_read)."""
        return self._read("masks", path, load_masks)

    def _scorers(self, spec: DecodeSpec, n_models: int) -> list:
        """Per-step scorers, in order: LMBR posteriors (Iglesias et al. 2018 defaults), then token
        masks (so a masked token stays -inf whatever LMBR adds)."""
        d = self.target_dictionary
        out = []
        if spec.lmbr_posteriors:
            theta = Theta.linear_bleu(spec.lmbr_p, spec.lmbr_r, theta0=spec.lmbr_theta0)
            lam = 1.0 / n_models if spec.lmbr_lambda is None else spec.lmbr_lambda
            out.append(LMBRScorer(self.lmbr_posteriors(spec.lmbr_posteriors), theta, lam, d.pad()))
        if spec.token_masks:
            out.append(TokenMaskScorer(self.token_masks(spec.token_masks), d.eos(), d.pad()))
        return out

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        ours = isinstance(generator, (StreamBeamGenerator, AggressiveGenerator))
        if ours and self.limits is not None:  # live budget: this run's --batch-size/--max-tokens, the generator's C
            generator.scheduler.budget = self.budget_for(generator.spec)
        t = time.perf_counter()
        out = super().inference_step(generator, models, sample, prefix_tokens=prefix_tokens, constraints=constraints)
        counters = getattr(generator, "counters", None)
        if not ours and counters is not None:  # fairseq's generator: sentences and time only
            counters.sentences += len(out)
            counters.total_seconds += time.perf_counter() - t
        return out


def _file_key(path: str) -> tuple:
    """A file as it is now, for caches of what is read from it: a rewritten file is read again."""
    st = os.stat(path)
    return path, st.st_mtime_ns, st.st_size


def _quiet_pin_memory_warning() -> None:
    """fairseq's EpochBatchIterator builds its DataLoader with `pin_memory=True` whatever the device,
    and torch warns at every epoch where no accelerator exists. fairseq-generate starts the loader
    in a background thread (BufferedIterator), out of reach of a `catch_warnings` block, so on such
    machines this one warning is filtered for the process (nothing is pinned either way)."""
    if not torch.accelerator.is_available():
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true", category=UserWarning)


class RunReport:
    """The counters of the generators a task builds, logged once per decoding when the process
    ends (one hook per task, however many generators: the hub builds one per `translate` call). A
    generator's counts are folded in when it is collected, so no generator or model is kept."""

    def __init__(self):
        self.done: dict = {}  # decoding -> Counters of collected generators
        self.live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # generator -> decoding
        atexit.register(self.report)

    def add(self, gen, name: str) -> None:
        self.live[gen] = name
        weakref.finalize(gen, self._fold, name, gen.counters).atexit = False  # the report counts live ones

    def _fold(self, name: str, counters: Counters) -> None:
        self.done.setdefault(name, Counters()).add(counters)

    def totals(self) -> dict:
        out = {name: Counters().add(c) for name, c in self.done.items()}
        for gen, name in list(self.live.items()):
            out.setdefault(name, Counters()).add(gen.counters)
        return out

    def report(self) -> None:
        # under a test runner the logging streams may already be closed at exit
        streams = [getattr(h, "stream", None) for h in logging.getLogger().handlers + logger.handlers]
        if any(getattr(st, "closed", False) for st in streams):
            return
        for name, counters in self.totals().items():
            if counters.sentences:
                logger.info("streambeam %s: %s", name, counters.summary())
            if counters.sentences and counters.unscored_sources >= counters.sentences:
                logger.warning("streambeam %s: every sentence lacked a record in --lmbr-posteriors or --token-masks:"
                               " are they keyed by the ids of the sentences decoded?", name)


def attach_to_hub(hub, **options):
    """Make a fairseq hub interface (`TransformerModel.from_pretrained(...)`) decode through this
    plugin's task; `options` are the task's fields, e.g. `attach_to_hub(hub, decoding="var-stream",
    finish_count=1)`. Each call is a new command line: fairseq's translation options are kept, the
    plugin's own return to their defaults unless given. Returns the hub."""
    generation = [f.name for f in dataclasses.fields(GenerationConfig)] + list(GENERATION.values())
    problem = unknown_problem(list(options), [f.name for f in dataclasses.fields(StreamBeamConfig)], "attach_to_hub",
                              (generation, "a generation option: give it to translate() or generate(), as fairseq "
                                           "names it (beam=5, lenpen=1.0)"))
    if problem:
        raise UsageError(problem)
    old = hub.task
    names = {f.name for f in dataclasses.fields(TranslationConfig)}  # fairseq's translation options
    base = {k: getattr(old.cfg, k) for k in names if hasattr(old.cfg, k) and k not in options}
    base.setdefault("train_subset", "train")
    base.setdefault("required_seq_len_multiple", 1)
    hub.task = StreamBeamTranslationTask(StreamBeamConfig(**{**base, **options}), old.source_dictionary,
                                         old.target_dictionary)
    return hub
