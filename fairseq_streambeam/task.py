"""fairseq adapter: the `streambeam_translation` task (the only layer that knows fairseq's CLI).

A TranslationTask that (1) builds a StreamBeamGenerator from `--decoding`, (2) never drops input
sentences, and (3) in streaming modes hands the generator windows of `--stream-window` fairseq
batches, so refill spans what would have been batch boundaries while `--batch-size` /
`--max-tokens` keep meaning "how many sources decode together" (the paper's n).
"""

from __future__ import annotations

import atexit
import logging
import os

from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationTask

from .drafters.block_model import ModelDrafter
from .drafters.input_copy import InputCopyDrafter
from .drafters.ngram_lookup import LOOKUP_BLOCK, LookupDrafter, NgramTable
from .generators.aggressive import AggressiveGenerator
from .generators.stream_beam import STREAMING, StreamBeamGenerator
from .models.block_drafter import load_drafter
from .options import (
    StreamBeamConfig,
    check_at_parse_time,
    check_generation_options,
    check_options,
    install_usage_error_hook,
    unsupported_generation_options,
)
from .runtime.scheduler import Budget
from .scorers.lmbr import LMBRScorer, Theta, load_posteriors
from .scorers.masks import TokenMaskScorer, load_masks

logger = logging.getLogger("fairseq_streambeam")

# --draft-min-reach when not given: a drafter's late slots are rarely reached, while iad's copied drafts
# are usually right (the measurements: docs/benchmarks.md, "Measurements behind the defaults").
AUTO_MIN_REACH = {"gad": 0.25, "iad": 0.0}


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
        check_options(cfg)  # before a model loads; the generation options come with build_generator
        self.budget: Budget | None = None
        self._drafters: dict = {}  # (path, device, dtype) -> block_drafter; ("lookup", path, order) -> NgramTable

    @property
    def streaming(self) -> bool:
        return str(self.cfg.decoding) in (*STREAMING, "iad", "gad")

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           ignore_invalid_inputs=False, required_batch_size_multiple=1, **kwargs):
        """fairseq's batching with two changes: required_batch_size_multiple is 1, because
        fairseq's batch_by_size silently drops a last batch that is not a multiple of it (fairseq
        issues #5036, #5351); and streaming modes get windows of `stream_window` batches."""
        self.budget = Budget(max_sentences, max_tokens, self.cfg.stream_candidates)
        if self.streaming:
            w = self.cfg.stream_window
            max_tokens = None if max_tokens is None else max_tokens * w
            max_sentences = None if max_sentences is None else max_sentences * w
        return super().get_batch_iterator(
            dataset, max_tokens=max_tokens, max_sentences=max_sentences, max_positions=max_positions,
            ignore_invalid_inputs=ignore_invalid_inputs, required_batch_size_multiple=1, **kwargs)

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        check_options(self.cfg)  # again: a Python caller (the bench) may have changed cfg since __init__
        check_generation_options(self.cfg, args)
        if str(self.cfg.decoding) == "fairseq":
            return super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                           extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                           prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        bad = unsupported_generation_options(args, extra_gen_cls_kwargs, prefix_allowed_tokens_fn,
                                             str(self.cfg.decoding))
        if bad:  # what a Python caller passes beside the options (an LM model, a prefix function)
            raise ValueError(f"--decoding {self.cfg.decoding} does not support {', '.join(bad)}; "
                             "use --decoding fairseq for those")
        if str(self.cfg.decoding) in ("iad", "gad"):
            return self._aggressive_generator(models, args)
        beam, nbest = getattr(args, "beam", 5), getattr(args, "nbest", 1)
        gen = StreamBeamGenerator(
            models, self.target_dictionary,
            beam_size=beam,
            **_fairseq_generation_kwargs(args),
            nbest=nbest,
            finish_count=self.cfg.finish_count,
            decoding=str(self.cfg.decoding),  # fairseq ChoiceEnum members -> plain strings
            delta=self.cfg.prune_abs_threshold,
            max_cands=self.cfg.prune_max_cands,
            finalize=str(self.cfg.finalize),
            stream_order=str(self.cfg.stream_order),
            stream_admit=str(self.cfg.stream_admit),
            budget=self.budget,
            refill_eps=self.cfg.refill_eps,
            max_wait=self.cfg.max_wait_steps,
            profile=self.cfg.stream_profile,
            no_repeat_ngram_size=getattr(args, "no_repeat_ngram_size", 0) or 0,
            match_source_len=bool(getattr(args, "match_source_len", False)),
            print_alignment=getattr(args, "print_alignment", None) or None,
            lm_model=(extra_gen_cls_kwargs or {}).get("lm_model"),  # fairseq-generate loads --lm-path
            lm_weight=(extra_gen_cls_kwargs or {}).get("lm_weight", 1.0),
            scorers=self._scorers(len(models)),
        )
        _report_at_exit(gen, gen.mode.name)
        return gen

    def _aggressive_generator(self, models, args):
        c, name = self.cfg, str(self.cfg.decoding)  # options checked by check_options
        if name == "gad":
            if c.drafter:
                drafter = ModelDrafter(self._drafter_model(c.drafter, models[0]), self.target_dictionary,
                                       c.block_size)
            else:
                drafter = self._lookup_drafter(c.draft_lookup, c.draft_lookup_order, c.block_size)
        else:
            src_d, tgt_d = self.source_dictionary, self.target_dictionary
            # separate dictionaries (e.g. WMT'19 Ru-En): copy each source token as the target token it spells
            vocab_map = None if src_d.symbols == tgt_d.symbols else [tgt_d.index(w) for w in src_d.symbols]
            drafter = InputCopyDrafter(c.iad_ngram, c.block_size, vocab_map=vocab_map)
        gen = AggressiveGenerator(
            models, self.target_dictionary, **_fairseq_generation_kwargs(args), drafter=drafter,
            budget=self.budget, refill_eps=c.refill_eps, beta=c.gad_beta, tau=c.gad_tau,
            draft_min_reach=c.draft_min_reach if c.draft_min_reach is not None else AUTO_MIN_REACH[name],
            draft_switch=name == "gad" and c.gad_beta == 1 and not c.no_draft_switch,
        )
        _report_at_exit(gen, name)
        return gen

    def _lookup_drafter(self, path: str, order: int, block_size: int) -> LookupDrafter:
        """The n-gram table of `path`, built once per task (a benchmark builds a generator per repeat)."""
        key = ("lookup", path, order)
        if key not in self._drafters:
            self._drafters[key] = NgramTable.from_file(path, self.target_dictionary, order)
        d = self.target_dictionary
        return LookupDrafter(self._drafters[key], bos=d.eos(), eos=d.eos(), block_size=block_size or LOOKUP_BLOCK)

    def _drafter_model(self, path: str, like):
        """The drafter checkpoint on the verifier's device and dtype, loaded once per task (a
        benchmark builds a generator per repeat and must not time checkpoint loading)."""
        p = next(like.parameters())
        key = (path, p.device, p.dtype)
        if key not in self._drafters:
            self._drafters[key] = load_drafter(path, self, like=like)
        return self._drafters[key]

    _lmbr_loaded: tuple | None = None  # (path, mtime, size, posteriors) of the last posteriors file read

    def _lmbr_posteriors(self, path: str) -> dict:
        """The posteriors of `path`, parsed once per task while the file stays the same (a benchmark
        builds a generator per repeat and must not time the parsing; the tuner rewrites its file)."""
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if self._lmbr_loaded is None or self._lmbr_loaded[:3] != key:
            self._lmbr_loaded = (*key, load_posteriors(path))
        return self._lmbr_loaded[3]

    def _scorers(self, n_models: int) -> list:
        """Per-step scorers, in order: LMBR posteriors (Iglesias et al. 2018 defaults), then token
        masks (so a masked token stays -inf whatever LMBR adds)."""
        c, d = self.cfg, self.target_dictionary
        out = []
        if c.lmbr_posteriors:
            theta = Theta.linear_bleu(c.lmbr_p, c.lmbr_r, theta0=c.lmbr_theta0)
            lam = 1.0 / n_models if c.lmbr_lambda is None else c.lmbr_lambda
            out.append(LMBRScorer(self._lmbr_posteriors(c.lmbr_posteriors), theta, lam, d.pad()))
        if c.token_masks:
            out.append(TokenMaskScorer(load_masks(c.token_masks), d.eos(), d.pad()))
        return out

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        if isinstance(generator, (StreamBeamGenerator, AggressiveGenerator)) and self.budget is not None:
            generator.scheduler.budget = self.budget  # live budget = this run's --batch-size/--max-tokens
        return super().inference_step(generator, models, sample, prefix_tokens=prefix_tokens,
                                      constraints=constraints)


def _fairseq_generation_kwargs(args) -> dict:
    """fairseq's generation options (GenerationConfig or a Namespace) as generator arguments."""
    return dict(
        max_len_a=getattr(args, "max_len_a", 0), max_len_b=getattr(args, "max_len_b", 200),
        max_len=getattr(args, "max_len", 0) or 0, min_len=getattr(args, "min_len", 1),
        normalize_scores=not getattr(args, "unnormalized", False), len_penalty=getattr(args, "lenpen", 1),
        unk_penalty=getattr(args, "unkpen", 0), temperature=getattr(args, "temperature", 1.0),
    )


def _report_at_exit(gen, name: str) -> None:
    """Log the run's counters (decoder steps, expansions per step, time split) when the process
    ends; only the counters are kept alive, not the generator and its models."""
    counters = gen.counters

    def report() -> None:
        # under a test runner the logging streams may already be closed at exit
        streams = [getattr(h, "stream", None) for h in logging.getLogger().handlers + logger.handlers]
        if counters.sentences and not any(getattr(st, "closed", False) for st in streams):
            logger.info("streambeam %s: %s", name, counters.summary())

    atexit.register(report)


def attach_to_hub(hub, **options):
    """Make a fairseq hub interface (`TransformerModel.from_pretrained(...)`) decode through this
    plugin's task; `options` are the task's fields, e.g. `attach_to_hub(hub, decoding="var-stream",
    finish_count=1)`. Returns the hub."""
    import dataclasses

    old = hub.task
    names = {f.name for f in dataclasses.fields(StreamBeamConfig)}
    base = {k: getattr(old.cfg, k) for k in names if hasattr(old.cfg, k) and k not in options}
    base.setdefault("train_subset", "train")
    base.setdefault("required_seq_len_multiple", 1)
    hub.task = StreamBeamTranslationTask(StreamBeamConfig(**{**base, **options}), old.source_dictionary,
                                         old.target_dictionary)
    return hub
