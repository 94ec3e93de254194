"""Option errors a user can act on: found when fairseq parses the command line, before any model
loads (the options are checked before the checkpoint, which the cases below do not write, so an
error that came later would name it), and reported as one line `prog: error: ...` with exit
status 2. The Python API raises ValueError."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from fairseq import options
from fairseq.dataclass.constants import PRINT_ALIGNMENT_CHOICES
from helpers import REPO, make_dict, random_transformer

from fairseq_streambeam import Budget, StreamBeamGenerator, attach_to_hub
from fairseq_streambeam.generators.aggressive import AggressiveGenerator
from fairseq_streambeam.options import StreamBeamConfig
from fairseq_streambeam.spec import DecodeSpec, UsageError, from_cli, type_problem

PLUGIN = str(REPO / "fairseq_streambeam")


def parse(tmp_path, *flags: str):
    parser = options.get_generation_parser()
    return options.parse_args_and_arch(parser, input_args=[
        str(tmp_path), "--user-dir", PLUGIN, "--task", "streambeam_translation",
        "--path", str(tmp_path / "model.pt"), *flags])


def text_file(tmp_path) -> str:
    p = tmp_path / "notes.txt"
    p.write_text("not a checkpoint\n")
    return str(p)


CASES = [
    (["--decoding", "var-stream", "--prune-abs-threshold", "-1"], "--prune-abs-threshold must be > 0, got -1.0"),
    (["--decoding", "var-stream", "--prune-max-cands", "-2"], "--prune-max-cands must be >= 0"),
    (["--decoding", "var-stream", "--refill-eps", "2"], "--refill-eps must be in [0, 1], got 2.0"),
    (["--decoding", "var-stream", "--stream-window", "0"], "--stream-window must be >= 1"),
    (["--decoding", "var-stream", "--sampling"], "--decoding var-stream does not support --sampling"),
    (["--decoding", "gad", "--draft-lookup", "{text}", "--print-alignment"], "--print-alignment applies to the beam"),
    (["--decoding", "iad", "--lm-path", "{text}"], "--decoding iad does not support --lm-path"),
    (["--decoding", "iad", "--match-source-len"], "--match-source-len applies to the beam decodings"),
    (["--decoding", "iad", "--no-repeat-ngram-size", "2"], "--no-repeat-ngram-size applies to the beam decodings"),
    (["--decoding", "beam", "--prune-abs-threshold", "1"], "applies to var-batch and var-stream, not --decoding beam"),
    (["--decoding", "beam", "--finish-count", "2"], "--finish-count applies to the sticky rule"),
    (["--decoding", "var-batch", "--beam", "4", "--nbest", "5"], "--nbest 5 asks for more hypotheses than the 4"),
    (["--decoding", "gad"], "--decoding gad needs --drafter PATH"),
    (["--decoding", "gad", "--drafter", "{text}", "--draft-lookup", "{text}"], "not both"),
    (["--decoding", "gad", "--draft-lookup", "{text}", "--gad-beta", "0"], "--gad-beta must be >= 1, got 0"),
    (["--decoding", "gad", "--draft-lookup", "{text}", "--nbest", "2"], "returns one hypothesis per source"),
    (["--decoding", "iad", "--gad-tau", "1"], "--gad-tau applies to --decoding gad, not --decoding iad"),
    (["--decoding", "beam", "--lmbr-posteriors", "{text}"], "needs a tuned --lmbr-lambda (the defaults lower"),
    (["--decoding", "iad", "--lmbr-posteriors", "{text}"], "applies to the beam decodings, not --decoding iad"),
    (["--decoding", "beam", "--beam", "0"], "--beam must be >= 1, got 0"),
    (["--decoding", "var-stream", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--decoding", "beam", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--decoding", "iad", "--beam", "0"], "--beam must be >= 1, got 0"),
    (["--decoding", "beam", "--lenpen", "nan"], "--lenpen must be a number, got nan"),
    (["--decoding", "var-stream", "--unkpen", "nan"], "--unkpen must be a number, got nan"),
    (["--decoding", "beam", "--stream-order", "continuous"], "--stream-order applies to var-stream and fixed-stream"),
    (["--decoding", "iad", "--stream-admit", "longest-first"], "--stream-admit applies to var-stream and fixed-stream"),
    (["--decoding", "iad", "--max-wait-steps", "3"], "--max-wait-steps applies to var-stream and fixed-stream"),
    (["--decoding", "var-stream", "--lmbr-p", "0"], "--lmbr-p must be in (0, 1]"),
    (["--decoding", "var_stream"], "argument --decoding: invalid choice: 'var_stream'"),  # not fairseq's usage
    (["--decoding", "beam", "--stream-window", "x"], "argument --stream-window: invalid int value"),
]


@pytest.mark.parametrize("flags,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_option_is_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    text = text_file(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        parse(tmp_path, *[f.format(text=text) for f in flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"{err[0].split(':')[0]}: error: ") and message in err[0], err


def test_good_options_parse(tmp_path):
    torch.save({}, tmp_path / "model.pt")  # parsing checks that the checkpoint is one
    args = parse(tmp_path, "--decoding", "var-stream", "--beam", "5", "--nbest", "5", "--prune-abs-threshold", "2",
                 "--no-repeat-ngram-size", "3")
    assert args.decoding == "var-stream" and args.prune_abs_threshold == 2.0 and args.no_repeat_ngram_size == 3


@pytest.mark.parametrize("command", ["generate", "interactive"])
@pytest.mark.parametrize("case,message", [
    ("no --path", "--path is required"), ("a directory", "not a regular file; name the checkpoint file in it"),
    ("a text file", "not a checkpoint (a file written by torch.save)"), ("missing", "no-such.pt: no such checkpoint"),
    ("no dictionary", "no dict.fr.txt there"),
    ("no sentencepiece model", "--sentencepiece-model {tmp}/no.model: no such file"),
    ("a text file as sentencepiece model", "--sentencepiece-model {tmp}/notes.txt: not a sentencepiece model"),
    ("results in a file", "--results-path {tmp}/notes.txt/out: {tmp}/notes.txt is not a directory"),
    ("sentencepiece without a model", "--bpe sentencepiece needs --sentencepiece-model"),
    ("missing drafter", "--drafter {tmp}/no.pt: no such file"),
    ("missing lookup text", "--draft-lookup {tmp}/no.en: no such file"),
])
def test_checkpoints_and_dictionaries_are_checked_when_parsing(tmp_path, capsys, command, case, message):
    """fairseq-interactive without --path, or either command with a directory for it, ended in a
    traceback; a missing dictionary came after the whole configuration was logged; a missing drafter
    or lookup text, found when the task was built, left fairseq-generate's --results-path file
    behind (opened before the task); interactive named an unset sentencepiece model `???`."""
    torch.save({}, tmp_path / "model.pt")
    (tmp_path / "dict.de.txt").write_text("")
    path = {"no --path": None, "a directory": str(tmp_path), "a text file": text_file(tmp_path),
            "missing": f"{tmp_path / 'model.pt'}:{tmp_path / 'no-such.pt'}"}.get(case, str(tmp_path / "model.pt"))
    parser = options.get_generation_parser() if command == "generate" else options.get_interactive_generation_parser()
    flags = [str(tmp_path), "--user-dir", PLUGIN, "--task", "streambeam_translation", "-s", "de", "-t",
             "fr" if case == "no dictionary" else "de"] + ([] if path is None else ["--path", path])
    if case == "results in a file":
        flags += ["--results-path", text_file(tmp_path) + "/out"]
    if "sentencepiece" in case:
        flags += ["--bpe", "sentencepiece"] + ([] if "without" in case else [
            "--sentencepiece-model", text_file(tmp_path) if "text file" in case else str(tmp_path / "no.model")])
    if case == "missing drafter":
        flags += ["--decoding", "gad", "--drafter", str(tmp_path / "no.pt")]
    if case == "missing lookup text":
        flags += ["--decoding", "gad", "--draft-lookup", str(tmp_path / "no.en")]
    with pytest.raises(SystemExit) as exit_:
        options.parse_args_and_arch(parser, input_args=flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and message.format(tmp=tmp_path) in err[0], err


@pytest.mark.parametrize("decoding", ["beam", "fairseq"])
def test_interactive_refuses_soft_alignments(tmp_path, capsys, decoding):
    """fairseq-interactive (0.12.3) stops at its first sentence with a ValueError when alignments
    are soft, whatever the generator; refused when parsing. Hard ones parse."""
    torch.save({}, tmp_path / "model.pt")
    (tmp_path / "dict.de.txt").write_text("")
    flags = [str(tmp_path), "--user-dir", PLUGIN, "--task", "streambeam_translation", "-s", "de", "-t", "de",
             "--path", str(tmp_path / "model.pt"), "--decoding", decoding, "--print-alignment"]
    options.parse_args_and_arch(options.get_interactive_generation_parser(), input_args=flags + ["hard"])
    with pytest.raises(SystemExit) as exit_:
        options.parse_args_and_arch(options.get_interactive_generation_parser(), input_args=flags + ["soft"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "fairseq-interactive prints hard alignments only" in err[0], err


def test_interactive_input_file_is_checked_when_parsing(tmp_path, capsys):
    """fairseq-interactive reads --input only after the models load: a missing file is found first."""
    torch.save({}, tmp_path / "model.pt")
    (tmp_path / "dict.de.txt").write_text("")
    flags = [str(tmp_path), "--user-dir", PLUGIN, "--task", "streambeam_translation", "-s", "de", "-t", "de",
             "--path", str(tmp_path / "model.pt"), "--input", str(tmp_path / "no.txt")]
    with pytest.raises(SystemExit) as exit_:
        options.parse_args_and_arch(options.get_interactive_generation_parser(), input_args=flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and f"--input {tmp_path}/no.txt: no such file" in err[0], err


@pytest.mark.parametrize("options,message", [
    (dict(decoding="gad", drafter="{text}"), "is not a checkpoint"),
    (dict(decoding="gad", drafter="missing.pt"), "--drafter missing.pt: no such file"),
    (dict(decoding="var-stream", token_masks="missing.jsonl"), "--token-masks missing.jsonl: no such file"),
])
def test_files_are_checked_when_the_task_is_built(tmp_path, options, message):
    """Parsers other than fairseq-generate's and -interactive's leave them to the task (a script may
    write the file after parsing a later command), which fairseq sets up before it loads a model."""
    from helpers import make_dict

    from fairseq_streambeam.task import StreamBeamTranslationTask

    options = {k: v.format(text=text_file(tmp_path)) for k, v in options.items()}
    cfg = StreamBeamConfig(**options)
    from_cli(cfg)  # what the parser checks
    with pytest.raises(UsageError, match=message):
        StreamBeamTranslationTask(cfg, make_dict(4), make_dict(4))


def test_python_api_raises_value_error():
    with pytest.raises(ValueError, match="--refill-eps must be in"):
        from_cli(StreamBeamConfig(decoding="var-stream", refill_eps=-0.5))
    with pytest.raises(ValueError, match="--refill-eps must be in"):
        DecodeSpec(decoding="var-stream", refill_eps=-0.5)
    assert issubclass(UsageError, ValueError)
    from_cli(StreamBeamConfig(decoding="var-stream"))  # the defaults pass


@pytest.mark.parametrize("options,message", [
    (dict(beam_size=2.5), "--beam must be a whole number, got 2.5"),
    (dict(beam_size="5"), "--beam must be a whole number, got '5'"),
    (dict(nbest=True), "--nbest must be a whole number, got True"),
    (dict(decoding="var-stream", prune_abs_threshold="2.0"), "--prune-abs-threshold must be a number or None, "
                                                             "got '2.0'"),
    (dict(decoding="var-stream", prune_max_cands=2.5), "--prune-max-cands must be a whole number or None, got 2.5"),
    (dict(len_penalty="1"), "--lenpen must be a number, got '1'"),
    (dict(compile=1), "--compile must be True or False, got 1"),
])
def test_python_options_of_the_wrong_type_are_one_usage_error(options, message):
    """Python callers pass options unparsed: a string or a float where a count belongs is refused
    by name, not left to fail deep inside a decode (topk's k, a comparison with a string)."""
    with pytest.raises(UsageError, match=re.escape(message)):
        DecodeSpec(**options)


def test_python_options_take_numpy_numbers_enums_and_paths(tmp_path):
    """What Python callers pass besides plain values: numpy numbers (ints for floats too), fairseq's
    ChoiceEnum members (cfg.generation.print_alignment), and paths, kept as strings."""
    s = DecodeSpec(decoding="var-stream", beam_size=np.int64(5), len_penalty=np.float32(0.5), prune_abs_threshold=2,
                   normalize_scores=np.bool_(False), print_alignment=PRINT_ALIGNMENT_CHOICES.hard,
                   lmbr_posteriors=tmp_path / "p.jsonl")
    assert s.beam == 5 and s.pruning.delta == 2 and not s.normalize_scores
    assert s.print_alignment == "hard" and type(s.print_alignment) is str
    assert s.lmbr_posteriors == str(tmp_path / "p.jsonl")


def test_every_spec_field_but_two_is_type_checked():
    """type_problem reads annotations spelt T or Optional[T]; a field spelt otherwise would go
    unchecked without notice."""
    fields = dataclasses.fields(DecodeSpec)
    unchecked = {str(f.type) for f in fields if type_problem(f.name, object(), str(f.type)) is None}
    assert unchecked == {"Tuple[str, ...]", "Optional[frozenset]"}


def test_unknown_python_options_and_budgets_are_refused_by_name():
    d = make_dict(12)
    model = random_transformer(d, 0)
    message = "a generator has no option 'beam_sise' (did you mean 'beam_size'?)"
    with pytest.raises(UsageError, match=re.escape(message)):
        StreamBeamGenerator([model], d, beam_sise=5)
    with pytest.raises(UsageError, match=re.escape("attach_to_hub has no option 'decodng' (did you mean 'decoding'?)")):
        attach_to_hub(None, decodng="var-stream")  # refused before the hub is read
    for name in ("beam", "beam_size", "print_alignment"):
        with pytest.raises(UsageError, match=f"attach_to_hub: {name} is a generation option: give it to translate"):
            attach_to_hub(None, **{name: 5})
    for name, field in (("beam", "beam_size"), ("delta", "prune_abs_threshold"), ("max_cands", "prune_max_cands")):
        with pytest.raises(UsageError, match=re.escape(f"no option '{name}' (did you mean '{field}'?)")):
            StreamBeamGenerator([model], d, **{name: 5})
    for budget in (64, 0):
        with pytest.raises(TypeError, match="budget must be a Budget"):
            StreamBeamGenerator([model], d, decoding="var-stream", budget=budget)
        with pytest.raises(TypeError, match="budget must be a Budget"):
            AggressiveGenerator([model], d, budget=budget)
    StreamBeamGenerator([model], d, decoding="var-stream", budget=Budget(64))


@pytest.mark.parametrize("generator,decoding", [(StreamBeamGenerator, "var-stream"), (AggressiveGenerator, "iad")])
def test_stream_window_is_refused_by_a_generator(generator, decoding):
    """Windows are the task's batching: given to a generator, stream_window would change nothing."""
    d = make_dict(12)
    model = random_transformer(d, 0)
    with pytest.raises(UsageError, match="stream_window= is the task's option"):
        generator([model], d, decoding=decoding, stream_window=4)
    generator([model], d, spec=DecodeSpec(decoding=decoding, stream_window=4))  # the task's spec carries it


@pytest.mark.parametrize("files,flags", [
    (["model-shard0.pt"], ["--path", "{tmp}/model.pt"]),  # a sharded (FSDP) checkpoint
    (["model_ema.pt"], ["--path", "{tmp}/model.pt", "--checkpoint-suffix", "_ema"]),
    (["model_part0.pt", "model_part1.pt"], ["--path", "{tmp}/model.pt", "--checkpoint-shard-count", "2"]),
    ([], ["--path", "s3://bucket/model.pt"]),  # fairseq's own file systems are left to fairseq
])
def test_checkpoints_are_named_as_fairseq_loads_them(tmp_path, files, flags):
    for name in files:
        torch.save({}, tmp_path / name)
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, input_args=[
        str(tmp_path), "--user-dir", PLUGIN, "--task", "streambeam_translation",
        *[f.format(tmp=tmp_path) for f in flags]])
    assert args.path.endswith("model.pt")
