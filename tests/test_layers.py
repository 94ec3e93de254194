"""Every import inside the package runs down the layers of docs/design.md ("Layers"): the engine
never imports a front end, and every part of the package has a layer. The engine's functions stay
short and its constructors narrow."""

from __future__ import annotations

import ast
import re
from typing import Dict, Iterator, Set, Tuple

from helpers import REPO

PACKAGE = REPO / "fairseq_streambeam"


def design_layers() -> Dict[str, int]:
    """Part (a module or folder of the package) -> its layer, from docs/design.md's table."""
    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    layers = {}
    for layer, parts in re.findall(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for part in re.findall(r"`(\w+)`", parts):
            layers[part] = int(layer)
    return layers


def part_of(module: str) -> str:
    """fairseq_streambeam.runtime.kv_cache -> runtime; fairseq_streambeam.task -> task."""
    return module.split(".")[1] if module.count(".") else "__init__"


def imports() -> Iterator[Tuple[str, str, str]]:
    """(importing file, its part, the imported part) for every import of a package module,
    function-level imports included."""
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        module = ".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                # `from X import name`: the module X.name where there is one, else X itself
                targets = [f"{target}.{a.name}" if is_module(f"{target}.{a.name}") else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t.split(".")[0] == "fairseq_streambeam" and part_of(t) != part_of(module):
                    yield str(rel), part_of(module), part_of(t)


def is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_part_has_a_layer():
    parts: Set[str] = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir()
                                                               if (p / "__init__.py").exists()}
    assert parts - {"__init__"} == set(design_layers())


def test_imports_run_down_the_layers():
    layers = design_layers()
    top = max(layers.values()) + 1  # the package's __init__.py (its face) sits above every part
    upward = [f"{f} ({a}, layer {layers[a]}) imports {b} (layer {layers.get(b, top)})"
              for f, a, b in imports() if a != "__init__" and layers.get(b, top) >= layers[a]]
    assert not upward, "\n".join(upward)


def test_the_check_sees_function_level_imports():
    found = {(f, b) for f, _, b in imports()}
    assert ("fairseq_streambeam/calibrate", "frontend") in found  # imported inside parse_args
    assert ("fairseq_streambeam/drafters/distill", "spec") in found


ENGINE = ("generators", "runtime", "search", "scorers")  # the engine's folders, kept to small functions


def engine_functions() -> Iterator[Tuple[str, ast.FunctionDef]]:
    for folder in ENGINE:
        for path in sorted((PACKAGE / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{folder}/{path.name}", node  # type: ignore[misc]


def test_engine_functions_are_at_most_60_lines():
    long = [f"{f}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"  # type: ignore[operator]
            for f, n in engine_functions() if n.end_lineno - n.lineno + 1 > 60]  # type: ignore[operator]
    assert not long, "\n".join(long)


def test_engine_constructors_take_at_most_8_parameters():
    """Named parameters of every __init__ written out (self, *args and **kwargs aside; dataclass
    records such as runtime.counters.Counters are data, not constructors called with arguments)."""
    wide = [f"{f}:{n.lineno}: {len(names)} parameters" for f, n in engine_functions() if n.name == "__init__"
            for names in [[a.arg for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs][1:]]
            if len(names) > 8]
    assert not wide, "\n".join(wide)

