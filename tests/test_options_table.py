"""docs/options.md, the table of fairseq-generate options by decoding, against the code.

- Every field of fairseq's GenerationConfig, and the other options listed in EXTRA, has a row.
- Every cell holds when a command line is parsed, for each decoding of its column: "no" is the
  plugin's one-line refusal (exit status 2, naming the option), anything else is accepted; with
  `--decoding fairseq` every option is accepted.
- Rows marked "decode-checked" are decoded with fairseq-generate's own main, in this process, on a
  small random transformer: "yes" options give fairseq's hypotheses (beam, fixed-stream; greedy
  fairseq's `--beam 1`; iad and gad greedy's), "ignored" ones the output without them, "fails"
  ones the KeyError that `--decoding fairseq` stops with.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.configs import GenerationConfig
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from helpers import REPO
from omegaconf import DictConfig, OmegaConf

DOC = REPO / "docs" / "options.md"
PLUGIN = str(REPO / "fairseq_streambeam")
COLUMNS = (("beam", "greedy", "fixed-stream", "var-batch", "var-stream"), ("iad", "gad"))
DECODINGS = COLUMNS[0] + COLUMNS[1]
VALUES = {"yes", "no", "ignored", "fails"}
MARK = "decode-checked"

# options beside GenerationConfig's that change what fairseq-generate decodes, prints or scores
EXTRA = ["--batch-size", "--max-tokens", "--required-batch-size-multiple", "--skip-invalid-size-inputs-valid-test",
         "--gen-subset", "--quiet", "--results-path", "--post-process", "--remove-bpe", "--tokenizer", "--bpe",
         "--scoring", "--fp16", "--bf16", "--cpu", "--seed", "--model-overrides"]

# the value each option is tried with (options that take none are absent)
ARGS: Dict[str, List[str]] = {
    "--beam": ["4"], "--beam-mt": ["3"], "--nbest": ["2"], "--max-len-a": ["0.5"], "--max-len-b": ["4"],
    "--max-len-a-mt": ["1"], "--max-len-b-mt": ["7"], "--min-len": ["2"], "--lenpen": ["0.6"], "--lenpen-mt": ["2"],
    "--unkpen": ["1.5"], "--replace-unk": ["align.txt"], "--prefix-size": ["1"], "--no-repeat-ngram-size": ["2"],
    "--sampling-topk": ["3"], "--sampling-topp": ["0.9"], "--constraints": ["ordered"], "--temperature": ["0.8"],
    "--diverse-beam-groups": ["2"], "--diverse-beam-strength": ["0.9"], "--diversity-rate": ["0.5"],
    "--print-alignment": ["soft"], "--lm-path": ["lm.pt"], "--lm-weight": ["0.5"],
    "--iter-decode-eos-penalty": ["0.5"], "--iter-decode-max-iter": ["3"], "--iter-decode-with-beam": ["2"],
    "--retain-dropout-modules": ["['TransformerDecoderLayer']"], "--decoding-format": ["vote"],
    "--eos-token": ["w3"], "--batch-size": ["3"], "--max-tokens": ["60"], "--required-batch-size-multiple": ["8"],
    "--gen-subset": ["test"], "--results-path": ["out"], "--post-process": ["sentencepiece"], "--remove-bpe": ["@@ "],
    "--tokenizer": ["space"], "--bpe": ["characters"], "--scoring": ["chrf"], "--seed": ["3"],
    "--model-overrides": ["{}"],
}


# ---- the table ---------------------------------------------------------------------------------


@dataclass
class Row:
    flags: List[str]
    cells: Dict[str, str]  # decoding -> yes / no / ignored / fails
    decode_checked: bool
    line: int


def _cell(text: str, column: Tuple[str, ...], where: str) -> Dict[str, str]:
    """`yes`, or `yes; greedy: no` (the first value for the column, then named exceptions)."""
    first, *exceptions = [p.strip() for p in text.split(";")]
    value = re.match(r"\w+", first)
    assert value and value.group(0) in VALUES, f"{where}: cell {text!r} starts with none of {sorted(VALUES)}"
    out = {d: value.group(0) for d in column}
    for part in exceptions:
        m = re.fullmatch(r"([\w\s,-]+?):\s*(\w+)\b.*", part)
        assert m and m.group(2) in VALUES, f"{where}: exception {part!r} is not `decoding: value`"
        for d in (x.strip() for x in m.group(1).split(",")):
            assert d in column, f"{where}: {d} is not a decoding of this column"
            out[d] = m.group(2)
    return out


def read_table() -> List[Row]:
    rows, header = [], False
    for n, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|"):
            header = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "option":
            assert cells[1:3] == [", ".join(c) for c in COLUMNS] and len(cells) == 4, f"options.md:{n}: header"
            header = True
            continue
        if not header or set(cells[0]) <= set("-: "):
            continue
        assert len(cells) == 4, f"options.md:{n}: {len(cells)} cells, not 4 (no | inside a cell)"
        flags = re.findall(r"`(--[\w-]+)`", cells[0])
        assert flags, f"options.md:{n}: no option in {cells[0]!r}"
        where = f"options.md:{n}"
        rows.append(Row(flags, {**_cell(cells[1], COLUMNS[0], where), **_cell(cells[2], COLUMNS[1], where)},
                        MARK in cells[3], n))
    return rows


ROWS = read_table() if DOC.exists() else []
BY_FLAG = {f: r for r in ROWS for f in r.flags}


def generation_flags() -> List[str]:
    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(GenerationConfig) if not f.name.startswith("_")]


def test_every_option_has_one_row():
    assert ROWS, f"{DOC} has no table"
    flags = [f for r in ROWS for f in r.flags]
    assert len(flags) == len(set(flags)), "an option has two rows"
    missing = [f for f in generation_flags() + EXTRA if f not in BY_FLAG]
    assert not missing, f"docs/options.md has no row for {missing}"
    known = options.get_generation_parser()._option_string_actions
    assert not [f for f in flags if f not in known], "a row names an option fairseq-generate does not have"


# ---- parsing ------------------------------------------------------------------------------------


def option_args(flag: str) -> List[str]:
    takes_value = options.get_generation_parser()._option_string_actions[flag].nargs != 0
    assert not takes_value or flag in ARGS, f"{flag}: give a value to try it with in ARGS"
    return [flag, *ARGS.get(flag, [])]


def parse(tmp_path, decoding: str, args: List[str]):
    extra = ["--draft-lookup", str(tmp_path / "lookup.txt")] if decoding == "gad" else []
    torch.save({}, tmp_path / "model.pt")  # parsing checks that the checkpoint is one, not what it holds
    (tmp_path / "lookup.txt").write_text("a b c\n")  # and that the lookup text exists
    parser = options.get_generation_parser()
    return options.parse_args_and_arch(parser, input_args=[
        str(tmp_path), "--user-dir", PLUGIN, "--task", "streambeam_translation", "--path",
        str(tmp_path / "model.pt"), "--decoding", decoding, *extra, *args])


@pytest.mark.parametrize("flag", sorted(BY_FLAG))
def test_parse_check_as_the_table_says(flag, tmp_path, capsys):
    row, args = BY_FLAG[flag], option_args(flag)
    for decoding in DECODINGS:
        where = f"options.md:{row.line}: {' '.join(args)} with --decoding {decoding}"
        if row.cells[decoding] == "no":
            with pytest.raises(SystemExit) as exit_:
                parse(tmp_path, decoding, args)
            err = capsys.readouterr().err.strip().splitlines()
            assert exit_.value.code == 2, f"{where}: exit status {exit_.value.code}"
            assert len(err) == 1 and ": error: " in err[0] and flag in err[0], f"{where}: {err}"
        else:
            try:
                parse(tmp_path, decoding, args)
            except SystemExit as e:
                pytest.fail(f"{where}: refused ({capsys.readouterr().err.strip()}) but the table says "
                            f"{row.cells[decoding]}; exit {e.code}")
    parse(tmp_path, "fairseq", args)  # fairseq's own generator takes them all


# ---- decoding -----------------------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(16)]
# sources in length groups of 3 = --batch-size: fairseq's batches (sorted by length) then hold sources of
# one length, so its --max-len-a (the batch's longest source) is each source's own, as in the plugin
SOURCES = ["w4 w5", "w12 w9", "w5 w11", "w7 w8 w9 w10", "w4 w4 w13 w14", "w13 w12 w11 w10",
           "w15 w6 w7 w8 w9 w10", "w6 w6 w9 w8 w7 w4"]
N = len(SOURCES)
BASE = ["--cpu", "--num-workers", "0", "--batch-size", "3", "--max-len-b", "6"]


@dataclass
class Tiny:
    root: Path
    namespace: argparse.Namespace  # the base command line, parsed
    cfg: DictConfig  # and converted to fairseq's config


def tiny_command(root: Path, decoding: str, args: List[str]) -> List[str]:
    extra = ["--draft-lookup", str(root / "lookup.txt")] if decoding == "gad" else []
    return [str(root), "--user-dir", PLUGIN, "--task", "streambeam_translation", "-s", "src", "-t", "tgt",
            "--dataset-impl", "raw", "--path", str(root / "model.pt"), *BASE, "--decoding", decoding, *extra, *args]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A raw-text data dir (dictionaries, test split, a lookup text for gad) and a random transformer
    checkpoint whose output layer is scaled up so its distributions are peaked, as a trained model's.
    Decoded on one thread (a model this small only waits for a second one)."""
    root = tmp_path_factory.mktemp("options_table")
    for lang in ("src", "tgt"):
        (root / f"dict.{lang}.txt").write_text("".join(f"{w} 1\n" for w in WORDS))
    (root / "test.src-tgt.src").write_text("\n".join(SOURCES) + "\n")
    (root / "test.src-tgt.tgt").write_text("\n".join(" ".join(reversed(s.split())) for s in SOURCES) + "\n")
    (root / "lookup.txt").write_text("\n".join(" ".join(reversed(s.split())) for s in SOURCES[::2]) + "\n")
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        str(root), "--task", "translation", "-s", "src", "-t", "tgt", "--dataset-impl", "raw", "--arch", "transformer",
        "--encoder-layers", "1", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--dropout", "0.1"])
    cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(0)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    with torch.no_grad():
        model.decoder.output_projection.weight.mul_(4.0)
    checkpoint_utils.torch_persistent_save(
        {"args": None, "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
         "model": model.state_dict(), "extra_state": {"epoch": 1},
         "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                                "lr_scheduler_state": {}, "num_updates": 0}], "last_optimizer_state": None},
        str(root / "model.pt"))
    base = options.parse_args_and_arch(options.get_generation_parser(), input_args=tiny_command(root, "beam", []))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Tiny(root, base, convert_namespace_to_omegaconf(base))
    torch.set_num_threads(threads)


Hypos = Dict[int, Tuple[List[str], float]]  # sentence id -> (tokens, score)


def generate(tiny: Tiny, decoding: str, args: List[str], tmp_path: Path) -> Hypos:
    """fairseq-generate's main, in this process, with `args` parsed as on its command line (the plugin's
    parse-time check included); the top hypothesis of each sentence. fairseq's conversion of the parsed
    options to its config takes about a second (hydra), so the base command's config is converted once
    and each option that parsed differently is set in every config group that has it, as the conversion
    sets it."""
    from fairseq_cli.generate import main

    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    command = tiny_command(tiny.root, decoding, [*args, "--results-path", str(out)])
    parsed = options.parse_args_and_arch(options.get_generation_parser(), input_args=command)
    cfg = copy.deepcopy(tiny.cfg)
    for key, value in vars(parsed).items():
        if getattr(tiny.namespace, key, None) != value:
            groups = [g for g in cfg if isinstance(cfg[g], DictConfig) and key in cfg[g]]
            assert groups, f"{key} = {value!r} has no place in fairseq's config"
            for g in groups:
                cfg[g][key] = value
    main(cfg)
    hypos: Hypos = {}
    for line in (out / "generate-test.txt").read_text().splitlines():
        m = re.match(r"H-(\d+)\t(\S+)\t?(.*)$", line)
        if m and int(m.group(1)) not in hypos:
            hypos[int(m.group(1))] = (m.group(3).split(), float(m.group(2)))
    return hypos


def assert_same(ref: Hypos, got: Hypos, what: str, atol: float = 1e-4):
    assert sorted(got) == list(range(N)) and sorted(ref) == list(range(N)), f"{what}: sentences missing"
    for i in range(N):
        assert got[i][0] == ref[i][0], f"{what}: sentence {i}: {got[i][0]} vs {ref[i][0]}"
        assert abs(got[i][1] - ref[i][1]) <= atol, f"{what}: sentence {i}: score {got[i][1]} vs {ref[i][1]}"


# option sets whose "yes" is decode-checked, and the decodings they are checked with
YES_SETS = [
    (["--beam", "4", "--lenpen", "0.6", "--unkpen", "1.5", "--temperature", "0.8", "--min-len", "2",
      "--max-len-a", "0.5", "--max-len-b", "3"], DECODINGS),
    (["--beam", "4", "--unnormalized"], DECODINGS),
    (["--beam", "4", "--prefix-size", "2"], DECODINGS),
]


def flags_of(args: List[str]) -> set:
    return {a for a in args if a.startswith("--")}


def marked(value: str = "") -> set:
    """Options of the rows marked decode-checked (whose every cell is `value`, if given)."""
    return {f for r in ROWS if r.decode_checked and (not value or set(r.cells.values()) == {value}) for f in r.flags}


@pytest.mark.parametrize("args,decodings", YES_SETS, ids=[" ".join(s[0][2:]) for s in YES_SETS])
def test_yes_options_decode_as_fairseq(tiny, tmp_path, args, decodings):
    for flag in flags_of(args):
        assert all(BY_FLAG[flag].cells[d] in ("yes", "ignored") for d in decodings), f"{flag}: not all yes"
    beam1 = [a if a != "4" or args[i - 1] != "--beam" else "1" for i, a in enumerate(args)]
    fairseq, fairseq1 = generate(tiny, "fairseq", args, tmp_path), generate(tiny, "fairseq", beam1, tmp_path)
    greedy = generate(tiny, "greedy", args, tmp_path)
    assert_same(fairseq1, greedy, f"greedy {' '.join(args)}")
    for d in decodings:
        if d in ("beam", "fixed-stream"):
            assert_same(fairseq, generate(tiny, d, args, tmp_path), f"{d} {' '.join(args)}")
        elif d in ("iad", "gad"):
            assert_same(greedy, generate(tiny, d, args, tmp_path), f"{d} {' '.join(args)}")


def ignored_args() -> List[str]:
    return [a for f in sorted(marked("ignored")) for a in option_args(f)]


@pytest.mark.parametrize("decoding", DECODINGS + ("fairseq",))
def test_ignored_options_change_nothing(tiny, tmp_path, decoding):
    """All of them at once; --required-batch-size-multiple 8 with --batch-size 3 would drop
    sentences in fairseq's own batching."""
    args = ignored_args()
    assert "--required-batch-size-multiple" in args and "--bf16" in args
    for flag in flags_of(args):
        row = BY_FLAG[flag]
        assert decoding == "fairseq" or row.cells[decoding] == "ignored", f"{flag}: {row.cells[decoding]}"
    assert_same(generate(tiny, decoding, [], tmp_path), generate(tiny, decoding, args, tmp_path),
                f"{decoding} with {' '.join(args)}", atol=1e-5)  # gad's draft switch follows timings


@pytest.mark.parametrize("flag", sorted(marked("fails")))
def test_failing_options_fail_as_with_fairseq(tiny, tmp_path, flag):
    key = {"--print-step": "steps", "--retain-iter-history": "history"}[flag]
    for decoding in DECODINGS + ("fairseq",):
        assert decoding == "fairseq" or BY_FLAG[flag].cells[decoding] == "fails"
        with pytest.raises(KeyError, match=key):
            generate(tiny, decoding, option_args(flag), tmp_path)


def test_decode_checked_marks_are_the_decoded_options():
    """Ignored and failing rows marked decode-checked are decoded by the tests above; the other marked
    rows must be the options of YES_SETS."""
    yes = {f for args, _ in YES_SETS for f in flags_of(args)}
    assert marked() - marked("ignored") - marked("fails") == yes, \
        "the rows marked decode-checked differ from the options YES_SETS decodes"
