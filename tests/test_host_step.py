"""scripts/host_step.py: host work per decoder step on a random model, each decoding against fairseq's."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import REPO

spec = importlib.util.spec_from_file_location("host_step", REPO / "scripts" / "host_step.py")
host_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_step)


def test_table_counts_steps_and_operators(capsys):
    host_step.main(["--sources", "3", "--rounds", "1", "--layers", "1", "--decodings", "fairseq,beam,continuous"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    table = {r[0].strip().strip("`"): [float(x) for x in r[1:]] for r in rows}
    assert list(table) == ["fairseq", "beam", "continuous"]
    assert table["fairseq"][0] == table["beam"][0] == table["continuous"][0] == host_step.LENGTH + 1  # a fixed load
    assert table["fairseq"][2] == 1.0  # the first decoding is the ratios' base
    assert all(steps > 0 and ms > 0 and ops > 20 for steps, ms, _, ops in table.values())


def _table(capsys, *argv):
    host_step.main(["--sources", "3", "--rounds", "1", "--layers", "1", *argv])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    return {r[0].strip().strip("`"): [float(x) for x in r[1:]] for r in rows}


def test_static_steps_leave_the_host_fewer_operators(capsys):
    """Beam steps and IAD's draft blocks on static shapes: what a CUDA graph does not replay is a
    fraction of the eager step's operators."""
    eager = _table(capsys, "--decodings", "beam,iad")
    static = _table(capsys, "--decodings", "beam,iad", "--graph-steps")
    for name in ("beam", "iad"):
        assert static[name][0] == eager[name][0] and 0 < static[name][3] < 0.7 * eager[name][3], (name, static, eager)


def test_counts_each_dispatched_operator():
    with host_step.OpCount() as c:
        torch.ones(3).add(1).mul(2)
    assert c.n["aten.add"] == 1 and c.n["aten.mul"] == 1


def test_unknown_decoding_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        host_step.main(["--decodings", "beam,gad"])
    assert e.value.code == 2
    assert "--decodings: unknown gad" in capsys.readouterr().err
