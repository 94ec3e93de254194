"""The documentation works as written.

- Every command in the ```bash blocks of README.md and docs/*.md has an entry point that exists and
  accepts its options, spelled out: fairseq-generate / fairseq-interactive lines are parsed by
  fairseq's own option parser with the plugin's --user-dir (streambeam-generate / -interactive lines
  with what they fill in), `python -m fairseq_streambeam.X` lines by that module's parser (and
  streambeam-decode-corpus, streambeam-calibrate and streambeam-serve lines by their modules'), scripts by their
  option lists (or the module they forward to); every ../shared path exists. Inline `python -m`
  modules, scripts/ and configs/ paths and links exist.
- README blocks not marked `<!-- slow -->` (on the line before the fence) run for real, in order,
  from a copy of the checkout with ../shared beside it: bash blocks in a shell, ```python blocks in
  this process (skipped without ../shared); each decoding command prints hypotheses and logs its
  counters. Set-up blocks (venv, pip, pytest) are only checked.
- README.md stays a manual: at most 13 KiB, with the set-up and test commands CI relies on.
- No tracked file labels text with how or when it was developed (development rounds, "this
  session", "this CPU" meaning the developers' machine), and README.md and docs/*.md do not link
  into ../shared, which is not part of the repository.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from helpers import BIN, REPO, SHARED

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_BYTES = 13 * 1024
SETUP_COMMAND = "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]'"
TEST_COMMAND = "OMP_NUM_THREADS=2 python -m pytest -q tests"
SLOW = "<!-- slow -->"

# Labels of how or when the code was developed. Text about the user's own machine is fine; the
# lines that say so are listed in ALLOWED.
DEV_LABELS = [
    r"\bsessions?\s+\d+",  # a session number, or a range of them
    r"\bthis\s+session\b",
    r"\b(earlier|previous|last|next|same) session\b",
    r"\b(development|dev) rounds?\b",
    r"\bround \d+\b",
    r"\bthis (project's |project’s )?(cpu|machine|box|computer|laptop)\b",
    r"\bour (cpu|machine|box|computer|laptop|server)s?\b",
]
ALLOWED = {  # path -> substrings that refer to the reader's machine, not the developers'
    "fairseq_streambeam/demo.py": ["toy numbers from a toy model on this machine"],
    "scripts/decode_corpus.sh": ["NPROC workers on this machine through torchrun"],
}
SHARED_LINK = re.compile(r"\]\(\s*(\.\./)+shared\b|\]\(\s*/work/shared\b|\bshared/DESIGN\.md\b")

SETUP_PROGRAMS = {"python3.11", ".", "source", "pip"}  # set-up lines: checked, never run here
PLAIN_PROGRAMS = {"echo", "head", "cat", "mkdir", "cut", "wc"}
# console scripts (setup.py): fairseq's commands with the plugin filled in, and the modules they run
FAIRSEQ_COMMANDS = {"fairseq-generate", "fairseq-interactive", "streambeam-generate", "streambeam-interactive"}
MODULE_COMMANDS = {"streambeam-decode-corpus": "fairseq_streambeam.decode_corpus",
                   "streambeam-serve": "fairseq_streambeam.serve",
                   "streambeam-calibrate": "fairseq_streambeam.calibrate"}


# ---- reading the Markdown ------------------------------------------------------------------------


@dataclass
class Block:
    lang: str
    code: str
    line: int  # line of the opening fence
    slow: bool
    source: str


def fenced_blocks(path: Path) -> List[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        assert j < len(lines), f"{path.name}:{i + 1}: unclosed code block"
        before = [x for x in lines[:i] if x.strip()]
        slow = bool(before) and before[-1].strip() == SLOW
        out.append(Block(m.group(1), "\n".join(lines[i + 1:j]), i + 1, slow, path.name))
        i = j + 1
    return out


@dataclass
class Command:
    env: Dict[str, str]
    argv: List[str]
    outputs: List[str]  # files written by redirection


def shell_commands(code: str) -> List[Command]:
    """The simple commands of a bash block, with the variables it assigns expanded (a token that is
    exactly `$NAME` is split on whitespace, as an unquoted expansion is; `${NAME:-default}` is
    the default unless the block assigns NAME)."""
    variables: Dict[str, str] = {}
    out: List[Command] = []

    def expand(token: str) -> List[str]:
        # ${NAME:-default}: the block's own NAME, else the default (the environment is not read)
        token = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda v: variables.get(v.group(1), v.group(2)), token)
        m = re.fullmatch(r"\$\{?(\w+)\}?", token)
        if m:
            assert m.group(1) in variables, f"undefined variable ${m.group(1)}"
            return variables[m.group(1)].split()

        def sub(v):
            assert v.group(1) in variables, f"undefined variable ${v.group(1)}"
            return variables[v.group(1)]

        return [re.sub(r"\$\{?(\w+)\}?", sub, token)]

    for line in code.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
        pieces: List[List[str]] = [[]]
        for t in tokens:
            if t in ("|", "&&", "||", ";"):
                pieces.append([])
            else:
                pieces[-1].append(t)
        for words in pieces:
            if not words:
                continue
            env: Dict[str, str] = {}
            while words and re.fullmatch(r"\w+=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                env[name] = " ".join(expand(value))
            if not words:  # a plain assignment
                variables.update(env)
                continue
            argv, outputs = [], []
            it = iter(words)
            for w in it:
                if w in (">", ">>"):
                    outputs.append(next(it))
                else:
                    argv += expand(w)
            out.append(Command(env, argv, outputs))
    return out


# ---- checking one command -------------------------------------------------------------------------


class _Parsed(Exception):
    pass


def _stop_after_parsing(monkeypatch):
    """Make argparse raise _Parsed(namespace) after a successful parse, so a module's main()
    checks its options with its own parser and stops before doing any work."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        self.allow_abbrev = False  # a README option must be spelled out
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _bench_resolve(ns):
    from fairseq_streambeam.bench.__main__ import resolve

    resolve(ns)  # methods and --config are read here


AFTER_PARSE = {"fairseq_streambeam.bench": _bench_resolve}


def check_module(module: str, args: List[str], monkeypatch) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"python -m {module}: no such module"
    entry = module + ".__main__" if spec.submodule_search_locations else module
    main = importlib.import_module(entry).main
    with monkeypatch.context() as m:
        _stop_after_parsing(m)
        try:
            main(args)
        except _Parsed as parsed:
            if module in AFTER_PARSE:
                AFTER_PARSE[module](parsed.args[0])
            return
        except SystemExit as e:
            pytest.fail(f"python -m {module} {' '.join(args)}: options refused (exit {e.code})")
    pytest.fail(f"python -m {module}: main() did not parse its arguments with argparse")


def check_fairseq(program: str, args: List[str], monkeypatch) -> None:
    from fairseq import options

    # the options are checked here; the files they name are the reader's (DATA-BIN, ../shared) or
    # an earlier command's (a lookup text, a drafter)
    monkeypatch.setattr("fairseq_streambeam.options.model_files_problem", lambda *a: None)
    monkeypatch.setattr("fairseq_streambeam.options.check_files", lambda spec: None)

    if program.startswith("streambeam-"):
        from fairseq_streambeam.cli import with_plugin

        args = with_plugin([program, *args])[1:]
    else:
        assert "--user-dir" in args, f"{program} without --user-dir fairseq_streambeam"
        i = args.index("--user-dir")
        assert args[i + 1] == "fairseq_streambeam", "--user-dir is the plugin directory of the checkout"
        args = args[:i + 1] + [str(REPO / "fairseq_streambeam")] + args[i + 2:]
    interactive = program.endswith("-interactive")
    parser = options.get_interactive_generation_parser() if interactive else options.get_generation_parser()
    try:
        options.parse_args_and_arch(parser, input_args=args)
    except SystemExit as e:
        pytest.fail(f"{program} {' '.join(args)}: options refused (exit {e.code})")


def check_script(path: str, args: List[str], monkeypatch) -> None:
    script = REPO / path
    assert script.is_file(), f"{path}: no such script"
    text = script.read_text()
    forwards = re.search(r"-m (fairseq_streambeam[\w.]*)[^\n]*\"\$@\"", text)
    if re.search(r'case "\$1" in', text):  # its own option list
        own = args[:args.index("--")] if "--" in args else args
        for a in own:
            if a.startswith("-"):
                assert re.search(rf"(^|\s|\|){re.escape(a)}(\)|\|)", text, re.M), f"{path} has no option {a}"
    elif forwards:
        check_module(forwards.group(1), args, monkeypatch)
    if path.endswith(".sh"):
        assert os.access(script, os.X_OK), f"{path} is not executable"


def check_paths(argv: List[str]) -> None:
    for a in argv:
        if a.startswith("../shared/") and SHARED.exists():
            assert (SHARED / a[len("../shared/"):]).exists(), f"{a} does not exist"
        elif re.match(r"(configs|scripts)/", a):
            assert (REPO / a).exists(), f"{a} does not exist in the repository"


def setup_extras() -> set:
    block = re.search(r"extras_require=\{(.*?)\n\s*\}", (REPO / "setup.py").read_text(), re.S)
    return set(re.findall(r'^\s*"(\w+)":', block.group(1), re.M))


def console_scripts() -> set:
    return set(re.findall(r'"([\w-]+) = fairseq_streambeam\.', (REPO / "setup.py").read_text()))


def check_command(c: Command, monkeypatch) -> None:
    prog, args = c.argv[0], c.argv[1:]
    check_paths(c.argv)
    if prog.startswith("streambeam-"):
        assert prog in console_scripts(), f"{prog} is not a console script of setup.py"
    if prog in PLAIN_PROGRAMS:
        return
    if prog in (".", "source"):
        assert args == [".venv/bin/activate"]
    elif prog == "python3.11":
        assert args[:2] == ["-m", "venv"]
    elif prog == "pip":
        assert args[0] == "install"
        for extra in re.findall(r"^\.\[(.*)\]$", " ".join(a for a in args if a.startswith(".["))):
            assert set(extra.split(",")) <= setup_extras(), f"pip install '.[{extra}]': unknown extra"
    elif prog == "python" and re.match(r"scripts/\w+\.py$", args[0]):  # a tool beside the package: its parser()
        check_paths(args[:1])
        spec = importlib.util.spec_from_file_location(Path(args[0]).stem, REPO / args[0])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.parser().parse_args(args[1:])
    elif prog == "python":
        assert args[0] == "-m", "python lines run modules: python -m ..."
        if args[1] == "pytest":
            assert (REPO / args[-1]).is_dir()
        else:
            check_module(args[1], args[2:], monkeypatch)
    elif prog in FAIRSEQ_COMMANDS:
        check_fairseq(prog, args, monkeypatch)
    elif prog in MODULE_COMMANDS:
        check_module(MODULE_COMMANDS[prog], args, monkeypatch)
    elif prog.startswith("scripts/"):
        check_script(prog, args, monkeypatch)
    elif prog == "sbatch":
        check_script(args[0], args[1:], monkeypatch)
    else:
        pytest.fail(f"the docs test does not know how to check `{prog}`: teach check_command")


def readme_bash_blocks() -> List[Block]:
    return [b for b in fenced_blocks(README) if b.lang == "bash"]


def docs_bash_blocks() -> List[Block]:
    """Blocks of docs/*.md: all parsed, none run (they are benchmark commands)."""
    return [b for doc in DOCS for b in fenced_blocks(doc) if b.lang == "bash"]


def is_setup(block: Block) -> bool:
    return any(c.argv[0] in SETUP_PROGRAMS or c.argv[1:3] == ["-m", "pytest"] for c in shell_commands(block.code))


# ---- the tests -----------------------------------------------------------------------------------


def test_readme_is_a_manual_with_the_ci_commands():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md has {size} bytes, more than {MAX_README_BYTES}: details go to docs/"
    lines = [x for b in readme_bash_blocks() for x in b.code.splitlines()]
    assert SETUP_COMMAND in lines and TEST_COMMAND in lines


@pytest.mark.parametrize("block", readme_bash_blocks() + docs_bash_blocks(), ids=lambda b: f"{b.source}:{b.line}")
def test_commands_parse(block, monkeypatch):
    commands = shell_commands(block.code)
    assert commands
    for c in commands:
        check_command(c, monkeypatch)


def test_readme_quick_blocks_run(tmp_path, monkeypatch):
    """The blocks not marked slow, run as written in order (bash, then Python in-process), from a
    folder that is not a checkout: the console commands work anywhere. The bash blocks find the
    data through STREAMBEAM_SHARED; the Python block's paths are ../shared, put beside the folder."""
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not available (set STREAMBEAM_SHARED)")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "shared").symlink_to(SHARED)
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HOME": os.environ.get("HOME", str(tmp_path)), "STREAMBEAM_SHARED": str(SHARED.resolve())}
    ran = 0
    for block in fenced_blocks(README):
        if block.slow or (block.lang == "bash" and is_setup(block)):
            continue
        if block.lang == "bash":
            missing = sorted({c.argv[0] for c in shell_commands(block.code)
                              if c.argv[0].startswith("streambeam-") and not (BIN / c.argv[0]).exists()})
            assert not missing, f"{missing} not in {BIN}: pip install -e '.[test]' installs the console scripts"
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=outside, env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"README.md:{block.line}:\n{r.stderr[-3000:]}"
            decoders = sum(c.argv[0] in FAIRSEQ_COMMANDS for c in shell_commands(block.code))
            assert len(re.findall(r"^H-\d+\t", r.stdout, re.M)) >= decoders, r.stdout[-2000:]
            counters = re.findall(r"streambeam [\w-]+: \d+ sentences", r.stderr)  # logged at exit
            assert len(counters) >= decoders, r.stderr[-2000:]
        elif block.lang == "python":
            monkeypatch.chdir(outside)
            exec(compile(block.code, f"README.md:{block.line}", "exec"), {"__name__": "readme"})
        ran += 1
    assert ran


def test_inline_commands_and_links_exist():
    for doc in [README, *DOCS]:
        text = doc.read_text(encoding="utf-8")
        for span in re.findall(r"`([^`\n]+)`", text):
            m = re.match(r"python -m ([\w.]+)", span)
            if m and m.group(1).startswith("fairseq_streambeam"):
                assert importlib.util.find_spec(m.group(1)), f"{doc.name}: `{span}`: no such module"
            for path in re.findall(r"(?<![\w/.])((?:scripts|configs)/[\w./-]+\w)", span):
                assert (REPO / path).exists(), f"{doc.name}: `{span}`: {path} does not exist"
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if not re.match(r"\w+://", target):
                assert (doc.parent / target).exists(), f"{doc.name}: link to {target} does not resolve"


def test_docs_do_not_point_into_shared():
    for doc in [README, *DOCS]:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            assert not SHARED_LINK.search(line), f"{doc.name}:{n}: links into ../shared, outside the repository"


def _tracked_files() -> Optional[List[str]]:
    try:
        r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [p for p in r.stdout.split("\0") if p]


def test_no_development_labels_in_tracked_files():
    files = _tracked_files()
    if files is None:
        pytest.skip("not a git checkout")
    me = Path(__file__).resolve().relative_to(REPO).as_posix()
    pattern = re.compile("|".join(DEV_LABELS), re.I)
    found = []
    for rel in files:
        path = REPO / rel
        if rel == me or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            for ok in ALLOWED.get(rel, []):
                line = line.replace(ok, "")
            m = pattern.search(line)
            if m:
                found.append(f"{rel}:{n}: {m.group(0)!r}")
    assert not found, "labels of how or when the code was developed:\n" + "\n".join(found)
