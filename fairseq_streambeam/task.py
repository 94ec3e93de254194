"""fairseq adapter: the `streambeam_translation` task (the only layer that knows fairseq's CLI).

A TranslationTask that (1) builds a StreamBeamGenerator from `--decoding`, (2) never drops input
sentences, and (3) in streaming modes hands the generator windows of `--stream-window` fairseq
batches, so refill spans what would have been batch boundaries while `--batch-size` /
`--max-tokens` keep meaning "how many sources decode together" (the paper's n).
"""

from __future__ import annotations

import atexit
import logging
import math

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
    UsageError,
    finalize_rule,
    install_usage_error_hook,
    unsupported_generation_options,
)
from .runtime.scheduler import Budget
from .scorers.lmbr import LMBRScorer, Theta, load_posteriors
from .scorers.masks import TokenMaskScorer, load_masks
from .search.finalize import FINISH_COUNT_NEEDS_STICKY, finished_per_source

logger = logging.getLogger("fairseq_streambeam")
install_usage_error_hook()  # option errors print one line under fairseq-generate & co., not a traceback

# --draft-min-reach when not given. Measured on CPU (deen-tiny + a 30-minute drafter, newstest2017): gad
# 2.06x -> 1.41x greedy's time at batch 1, 4.53x -> 2.52x at batch 32; iad's drafts are usually right and
# a lone row pays little per extra slot, so it verifies everything (any cap was slower on CoNLL-14).
AUTO_MIN_REACH = {"gad": 0.25, "iad": 0.0}


@register_task("streambeam_translation", dataclass=StreamBeamConfig)
class StreamBeamTranslationTask(TranslationTask):
    cfg: StreamBeamConfig

    def __init__(self, cfg: StreamBeamConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        if cfg.stream_window < 1:
            raise UsageError(f"--stream-window must be >= 1, got {cfg.stream_window}")
        _check_finish_count(cfg)  # before fairseq loads the model; --nbest and --beam come later
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
        _check_finish_count(self.cfg)
        if str(self.cfg.decoding) == "fairseq":
            if self.cfg.lmbr_posteriors or self.cfg.token_masks:
                raise UsageError("--lmbr-posteriors and --token-masks need one of this plugin's decodings, "
                                 "not --decoding fairseq")
            return super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                           extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                                           prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        bad = unsupported_generation_options(args, extra_gen_cls_kwargs, prefix_allowed_tokens_fn)
        if bad:
            raise UsageError(f"--decoding {self.cfg.decoding} does not support {', '.join(bad)}; "
                             "use --decoding fairseq for those")
        if str(self.cfg.decoding) in ("iad", "gad"):
            return self._aggressive_generator(models, args)
        decoding, beam, nbest = str(self.cfg.decoding), getattr(args, "beam", 5), getattr(args, "nbest", 1)
        try:  # the generator checks this too; here it is an option error of the command line
            finished_per_source(finalize_rule(decoding, self.cfg.finalize), 1 if decoding == "greedy" else beam,
                                self.cfg.finish_count, nbest)
        except ValueError as e:
            raise UsageError(str(e)) from None
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
            budget=self.budget,
            refill_eps=self.cfg.refill_eps,
            max_wait=self.cfg.max_wait_steps,
            profile=self.cfg.stream_profile,
            scorers=self._scorers(len(models)),
        )
        _report_at_exit(gen, gen.mode.name)
        return gen

    def _aggressive_generator(self, models, args):
        c, name = self.cfg, str(self.cfg.decoding)
        if c.lmbr_posteriors or c.token_masks:
            raise UsageError(f"--lmbr-posteriors and --token-masks apply to the beam decodings, not --decoding {name}")
        if getattr(args, "nbest", 1) > 1:
            raise UsageError(f"--decoding {name} is greedy: it returns one hypothesis (--nbest 1)")
        if name == "gad":
            if bool(c.drafter) == bool(c.draft_lookup):
                raise UsageError("--decoding gad needs either --drafter PATH (a block_drafter checkpoint; see "
                                 "scripts/train_drafter.sh) or --draft-lookup TEXT (an n-gram table), not both")
            if c.drafter:
                drafter = ModelDrafter(self._drafter_model(c.drafter, models[0]), self.target_dictionary,
                                       c.block_size)
            else:
                drafter = self._lookup_drafter(c.draft_lookup, c.draft_lookup_order, c.block_size)
        else:
            if c.drafter or c.draft_lookup or c.gad_beta != 1 or c.gad_tau != math.inf or c.no_draft_switch:
                raise UsageError("--drafter, --draft-lookup, --gad-beta, --gad-tau and --no-draft-switch apply to "
                                 "--decoding gad")
            drafter = InputCopyDrafter(c.iad_ngram, c.block_size)
        gen = AggressiveGenerator(
            models, self.target_dictionary, **_fairseq_generation_kwargs(args), drafter=drafter,
            budget=self.budget, refill_eps=c.refill_eps, beta=c.gad_beta, tau=c.gad_tau,
            draft_min_reach=c.draft_min_reach if c.draft_min_reach is not None else AUTO_MIN_REACH[name],
            draft_switch=name == "gad" and c.gad_beta == 1 and not c.no_draft_switch,
        )
        _report_at_exit(gen, name)
        return gen

    def _lookup_drafter(self, path: str, order: int, block_size: int) -> LookupDrafter:
        """The n-gram table of `path`, built once per task (0.6 s for 68,756 sentences here)."""
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

    def _scorers(self, n_models: int) -> list:
        """Per-step scorers, in order: LMBR posteriors (Iglesias et al. 2018 defaults), then token
        masks (so a masked token stays -inf whatever LMBR adds)."""
        c, d = self.cfg, self.target_dictionary
        out = []
        if c.lmbr_posteriors:
            theta = Theta.linear_bleu(c.lmbr_p, c.lmbr_r, theta0=c.lmbr_theta0)
            lam = 0.5 / n_models if c.lmbr_lambda is None else c.lmbr_lambda
            out.append(LMBRScorer(load_posteriors(c.lmbr_posteriors), theta, lam, d.pad()))
        if c.token_masks:
            out.append(TokenMaskScorer(load_masks(c.token_masks), d.eos(), d.pad()))
        return out

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        if isinstance(generator, (StreamBeamGenerator, AggressiveGenerator)) and self.budget is not None:
            generator.scheduler.budget = self.budget  # live budget = this run's --batch-size/--max-tokens
        return super().inference_step(generator, models, sample, prefix_tokens=prefix_tokens,
                                      constraints=constraints)


def _check_finish_count(cfg: StreamBeamConfig) -> None:
    """--finish-count needs a decoding with the sticky rule and must be >= 1 (its upper bound, the
    beam size, is a generation option that fairseq hands over only with build_generator)."""
    z = cfg.finish_count
    if z is None:
        return
    decoding = str(cfg.decoding)
    if decoding in ("iad", "gad", "fairseq") or finalize_rule(decoding, cfg.finalize) != "sticky":
        raise UsageError(FINISH_COUNT_NEEDS_STICKY)
    if z < 1:
        raise UsageError(f"--finish-count must be >= 1, got {z}")


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
