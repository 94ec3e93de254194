"""What the benchmark runs: named method variants, from built-ins or a JSON config."""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple

DECODINGS = ("fairseq", "fairseq-greedy", "beam", "greedy", "var-batch", "var-stream", "fixed-stream", "iad", "gad",
             "gad-oracle", "no-draft", "ct2")


@dataclass
class Variant:
    """One method to time. Unset fields take the run's settings (beam, batch size, ...)."""

    name: str
    decoding: str
    beam: Optional[int] = None
    batch_size: Optional[int] = None
    delta: Optional[float] = None
    max_cands: Optional[int] = None
    refill_eps: Optional[float] = None
    finalize: Optional[str] = None
    finish_count: Optional[int] = None  # sticky rule: finished hypotheses that end a source (default: the run's)
    stream_order: Optional[str] = None
    stream_admit: Optional[str] = None  # streaming: shortest-first (default) or longest-first
    lmbr: bool = False  # score with the run's --lmbr-posteriors
    block_size: Optional[int] = None  # aggressive decoding: draft cap (0 = auto)
    candidates: Optional[int] = None  # streaming: live-candidate budget (--stream-candidates)
    gad_beta: Optional[int] = None  # gad: verifier top-beta (1 = greedy output; >1 = GAD++)
    gad_tau: Optional[float] = None  # gad++: log-prob tolerance to the verifier's top-1
    draft_min_reach: Optional[float] = None  # aggressive decoding: adaptive draft cap (--draft-min-reach)
    draft_switch: Optional[bool] = None  # gad: passes without drafts when cheaper (False: draft in every pass)
    lookup: bool = False  # gad: draft from the run's --draft-lookup n-gram table instead of its --drafter
    compile: bool = False  # the decoder layers through torch.compile (--compile)

    def __post_init__(self) -> None:
        if self.decoding not in DECODINGS:
            raise ValueError(f"variant {self.name!r}: unknown decoding {self.decoding!r}; choose from {DECODINGS}")

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if v is not None and not (k in ("lmbr", "lookup", "compile") and v is False)}


BUILTIN: Dict[str, Variant] = {
    "fairseq": Variant("fairseq", "fairseq"),
    "fairseq-greedy": Variant("fairseq-greedy", "fairseq-greedy", beam=1),
    "beam": Variant("beam", "beam"),
    "greedy": Variant("greedy", "greedy", beam=1),
    "var-batch": Variant("var-batch", "var-batch"),
    "var-stream": Variant("var-stream", "var-stream"),
    "fifo": Variant("fifo", "var-stream", stream_order="fifo"),
    "continuous": Variant("continuous", "var-stream", stream_order="continuous"),
    "fixed-stream": Variant("fixed-stream", "fixed-stream"),
    "ct2": Variant("ct2", "ct2"),
    "iad": Variant("iad", "iad", beam=1),
    "gad": Variant("gad", "gad", beam=1),  # needs the run's --drafter
    "gad++": Variant("gad++", "gad", beam=1, gad_beta=3, gad_tau=1.0),
    "gad-lookup": Variant("gad-lookup", "gad", beam=1, lookup=True),  # needs the run's --draft-lookup
    # the aggressive generator with a drafter that drafts greedy's own output: the bound of any drafter
    "gad-oracle": Variant("gad-oracle", "gad-oracle", beam=1, block_size=8),
    # the same generator drafting nothing (one token per pass): its own speed as a greedy decoder
    "no-draft": Variant("no-draft", "no-draft", beam=1),
    # the same decodings with the decoder layers compiled (--compile)
    "beam+compile": Variant("beam+compile", "beam", compile=True),
    "var-stream+compile": Variant("var-stream+compile", "var-stream", compile=True),
    "iad+compile": Variant("iad+compile", "iad", beam=1, compile=True),
    "gad+compile": Variant("gad+compile", "gad", beam=1, compile=True),  # needs the run's --drafter
    "beam+lmbr": Variant("beam+lmbr", "beam", lmbr=True),
    "var-stream+lmbr": Variant("var-stream+lmbr", "var-stream", lmbr=True),
}


def parse_methods(spec: str) -> List[Variant]:
    names = [x.strip() for x in spec.split(",") if x.strip()]
    for name in names:
        if name not in BUILTIN:
            raise ValueError(f"unknown method {name!r}; built-ins are {sorted(BUILTIN)} (or use --config)")
    return [BUILTIN[name] for name in names]


def load_config(path: str) -> Tuple[dict, List[Variant]]:
    """A JSON file: run settings (beam, batch_size, repeats, ...) and a list of `variants`, each
    a built-in name or an object with Variant's fields; `sweep` expands a grid of one decoding.
    Keys starting with "_" are comments."""
    cfg = {k: v for k, v in json.loads(Path(path).read_text()).items() if not k.startswith("_")}
    names = {f.name for f in fields(Variant)}
    variants: List[Variant] = []
    for v in cfg.pop("variants", []):
        if isinstance(v, str):
            variants += parse_methods(v)
        else:
            bad = set(v) - names
            if bad:
                raise ValueError(f"{path}: unknown variant fields {sorted(bad)}")
            variants.append(Variant(**v))
    sweep = cfg.pop("sweep", None)
    if sweep:
        variants += expand_sweep(sweep)
    return cfg, variants


def expand_sweep(sweep: dict) -> List[Variant]:
    """{"decoding": "var-stream", "delta": [1, 1.5], "max_cands": [3, 5]} -> one variant per point,
    named decoding[delta=1,max_cands=3] (or `name`[...] when the sweep gives a name)."""
    base = {k: v for k, v in sweep.items() if not isinstance(v, list)}
    prefix = base.pop("name", base["decoding"])
    grid = [(k, v) for k, v in sweep.items() if isinstance(v, list)]
    points: List[dict] = [{}]
    for key, values in grid:
        points = [dict(p, **{key: x}) for p in points for x in values]
    labels = [",".join(f"{k}={v}" for k, v in p.items()) for p in points]
    return [Variant(name=f"{prefix}[{label}]", **base, **p) for p, label in zip(points, labels)]
