"""Run the CPU tests' generators on another device without rewriting the tests.

`generate_on(device)` reroutes every `SequenceGenerator.generate` call (fairseq's generator and
ours, which inherit it): the generator's models (and a drafter's model) move to `device` for the
call and back afterwards, the sample and tensor keyword arguments (prefix tokens) are copied there,
the output is checked to lie on `device` as fairseq's does, and it comes back as CPU tensors, so
the tests' own comparisons and CPU reference computations run unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Tuple

import torch
from fairseq.sequence_generator import SequenceGenerator

OUTPUT_TENSORS = ("tokens", "score", "positional_scores")  # fairseq's generator puts these on the model's device


def to_device(x: Any, device) -> Any:
    """Copy of `x` (tensors in nested dicts, lists and tuples) with every tensor on `device`;
    other values are kept as they are."""
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def _modules(gen: SequenceGenerator) -> List[torch.nn.Module]:
    """The modules a generator computes with: its ensemble, a fused LM, and any module its drafter holds."""
    mods = [gen.model] + ([gen.lm_model] if getattr(gen, "lm_model", None) is not None else [])
    drafter = getattr(gen, "drafter", None)
    mods += [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)] if drafter is not None else []
    return mods


def _home(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def misplaced(hypos, device) -> List[Tuple[int, int, str, str]]:
    """(sentence, hypothesis, field, device) of output tensors not on `device`."""
    want = torch.device(device).type
    return [(i, j, key, str(h[key].device)) for i, sent in enumerate(hypos) for j, h in enumerate(sent)
            for key in OUTPUT_TENSORS if torch.is_tensor(h.get(key)) and h[key].device.type != want]


@contextmanager
def generate_on(device) -> Iterator[None]:
    """While active, generators compute on `device` and return CPU tensors (see the module doc)."""
    device = torch.device(device)
    original = SequenceGenerator.generate

    def generate(self, models, sample, **kwargs):
        homes = [(m, _home(m)) for m in _modules(self)]
        for m, _ in homes:
            m.to(device)
        try:
            out = original(self, models, to_device(sample, device), **to_device(kwargs, device))
        finally:
            for m, home in homes:
                m.to(home)
        bad = misplaced(out, device)
        assert not bad, f"{type(self).__name__} output not on {device}: {bad[:5]}"
        return to_device(out, "cpu")

    SequenceGenerator.generate = generate
    try:
        yield
    finally:
        SequenceGenerator.generate = original
