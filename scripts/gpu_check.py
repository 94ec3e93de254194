"""Helpers of scripts/gpu_prepare.sh and scripts/gpu_check.sh: what a run on a GPU machine without
network access carries there and what it brings back. A tool beside the package, not part of it:
step-cost imports fairseq_streambeam (gpu_check.sh puts the checkout first on PYTHONPATH),
has-method reads the checkout's benchmark method list, and nothing in the package imports this.

  python scripts/gpu_check.py slim-wheel WHEEL PREFIX...
  python scripts/gpu_check.py slim-checkpoint SRC DST [--dtype fp16|fp32]
  python scripts/gpu_check.py check-wheels DIR
  python scripts/gpu_check.py spm-encode MODEL IN OUT [--lines N]
  python scripts/gpu_check.py step-cost --data DIR --path CKPT -s L -t L --out FILE.json
  python scripts/gpu_check.py has-method NAME
  python scripts/gpu_check.py bench-config SRC DST [--drop NAME...]
  python scripts/gpu_check.py summarize WORK OUT [--print]

The GPU machine has no network and no fairseq: wheels travel in .whl/, slimmed so that they and the
checkpoints fit the 64 MiB that a run carries; `check-wheels` checks, before they travel, that every
requirement of a carried wheel is carried or already on the GPU image. `summarize` turns the
stages' outputs into the few files a run brings back: results.json, results.md, gpu_check.png.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import re
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# Python packages of the offline GPU image these scripts target ('cuda').
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

# The benchmark's method variants, in the checkout this script belongs to.
VARIANTS = Path(__file__).resolve().parent.parent / "fairseq_streambeam" / "bench" / "variants.py"

# The GPU machines' interpreter, for evaluating requirement markers.
IMAGE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                 "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
                 "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def normalize(name: str) -> str:
    """PEP 503 project name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple:
    """(normalized name, version) from a wheel's file name."""
    parts = path.name[:-len(".whl")].split("-")
    if len(parts) < 5:
        raise SystemExit(f"{path.name}: not a wheel file name (name-version-python-abi-platform.whl)")
    return normalize(parts[0]), parts[1]


# ---- slim-wheel ---------------------------------------------------------------------------------

def slim_wheel(path: Path, prefixes: Sequence[str]) -> tuple:
    """Rewrite wheel `path` in place without the members under `prefixes` (and their RECORD rows).
    Returns (members dropped, bytes before, bytes after)."""
    before = path.stat().st_size
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        drop = {i.filename for i in infos if i.filename.startswith(tuple(prefixes))}
        if not drop:
            return 0, before, before
        record = next((i.filename for i in infos if i.filename.endswith(".dist-info/RECORD")), None)
        tmp = path.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if info.filename in drop or info.filename == record:
                    continue
                out.writestr(info, z.read(info.filename))
            if record is not None:
                rows = [r for r in csv.reader(io.StringIO(z.read(record).decode())) if r and r[0] not in drop]
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                out.writestr(record, buf.getvalue())
    tmp.replace(path)
    return len(drop), before, path.stat().st_size


# ---- slim-checkpoint ----------------------------------------------------------------------------

def slim_checkpoint(src: Path, dst: Path, dtype: str = "fp16") -> tuple:
    """A copy of fairseq checkpoint `src` with the optimizer state dropped and floating-point
    weights stored as `dtype` (loading casts them back to the model's float32). Tensors that share
    storage (tied embeddings) stay shared, so they are stored once. Returns (bytes before, after)."""
    import torch

    state = torch.load(src, map_location="cpu", weights_only=False)
    state["last_optimizer_state"] = None
    target = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
    converted: Dict[tuple, object] = {}
    model = {}
    for key, t in state["model"].items():
        if torch.is_tensor(t) and t.is_floating_point():
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if ident not in converted:
                converted[ident] = t.to(target)
            t = converted[ident]
        model[key] = t
    state["model"] = model
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, dst)
    return src.stat().st_size, dst.stat().st_size


# ---- check-wheels -------------------------------------------------------------------------------

def check_wheels(folder: Path, image: frozenset = IMAGE_PACKAGES) -> List[str]:
    """Problems of the wheels in `folder` as one line each: a package carried twice, or a
    requirement (for Python 3.12 on Linux, no extras) neither carried in a matching version nor on
    the GPU image."""
    from packaging.requirements import Requirement

    wheels = sorted(folder.glob("*.whl"))
    carried: Dict[str, str] = {}
    problems = []
    for w in wheels:
        name, version = wheel_name_version(w)
        if name in carried:
            problems.append(f"{name} carried twice ({carried[name]} and {version}): pip refuses the install")
        carried[name] = version
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode("utf-8", "replace").splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(IMAGE_MARKERS):
                continue
            name = normalize(req.name)
            if name in carried:
                if req.specifier and not req.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{w.name} needs {req} but {name} {carried[name]} is carried")
            elif name not in image:
                problems.append(f"{w.name} needs {req}: neither carried nor on the GPU image")
    return problems


# ---- spm-encode ---------------------------------------------------------------------------------

def spm_encode(model: str, src: Path, dst: Path, lines: int = 0) -> int:
    """Segment `src` with sentencepiece model `model` (pieces joined by spaces, as fairseq's data-bins
    of the tiny models); the first `lines` lines only when lines > 0. Returns lines written."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    n = 0
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for line in f:
            if lines and n >= lines:
                break
            out.write(" ".join(sp.encode(line.rstrip("\n"), out_type=str)) + "\n")
            n += 1
    return n


# ---- step-cost ----------------------------------------------------------------------------------

def step_cost(data: str, path: str, src_lang: str, tgt_lang: str, rows: Sequence[int], prefix: int = 16,
              steps: int = 20, device: str = "cuda", subset: str = "test") -> List[dict]:
    """Time of one incremental decoder step (fairseq's EnsembleModel.forward_decoder, as the
    generators call it) for each number of rows, after `prefix` steps of cache: sources are test-set
    sentences of about the median length, repeated to fill the rows. Milliseconds per step, the
    median of `steps` timed steps (each synchronized)."""
    import torch
    from fairseq.sequence_generator import EnsembleModel

    from fairseq_streambeam.loader import load_models, load_task

    task = load_task(data, src_lang, tgt_lang)
    models = load_models(task, path)
    dev = torch.device(device)
    for m in models:
        m.to(dev)
    model = EnsembleModel(models).eval()
    task.load_dataset(subset)
    ds = task.dataset(subset)
    lengths = sorted(range(len(ds)), key=lambda i: ds.src_sizes[i])
    middle = lengths[len(lengths) // 2 - 32: len(lengths) // 2 + 32] or lengths
    eos = task.target_dictionary.eos()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out = []
    with torch.no_grad():
        for n in rows:
            picked = [ds.src[middle[i % len(middle)]] for i in range(n)]
            width = max(len(s) for s in picked)
            src = torch.full((n, width), task.source_dictionary.pad(), dtype=torch.long)
            for i, s in enumerate(picked):
                src[i, width - len(s):] = s  # left padding, as fairseq's collater
            src = src.to(dev)
            enc = model.forward_encoder({"src_tokens": src, "src_lengths": src.ne(task.source_dictionary.pad()).sum(1)})
            states = [{} for _ in models]
            tokens = torch.full((n, 1), eos, dtype=torch.long, device=dev)
            times = []
            for step in range(prefix + steps):
                sync()
                t0 = time.perf_counter()
                lprobs, _ = model.forward_decoder(tokens, enc, states, 1.0)
                sync()
                if step >= prefix:
                    times.append(time.perf_counter() - t0)
                tokens = torch.cat([tokens, lprobs.argmax(-1, keepdim=True)], 1)
            times.sort()
            out.append({"rows": n, "ms_per_step": round(1000 * times[len(times) // 2], 4)})
            print(f"step cost: {n} rows {out[-1]['ms_per_step']} ms", flush=True)
    return out


def _lean_step(math_, dec, x, pk, pv, ck, cv):
    """One decoder step of `dec` through LayerMath over cached keys: log-probs [N, 1, V] in float32."""
    import torch

    y = math_(x, pk, pv, None, None, True, ck, cv, None, None, None, None, x.size(0), 0)[0]
    if getattr(dec, "layer_norm", None) is not None:
        y = dec.layer_norm(y)
    return torch.log_softmax(dec.output_layer(y).float(), dim=-1)


def lean_step_cost(path: str, data: str, src_lang: str, tgt_lang: str, rows: Sequence[int], cache: int = 16,
                   source: int = 24, steps: int = 30, device: str = "cuda", fp16: bool = False) -> List[dict]:
    """The plugin's decoder step (runtime.lean_layer.LayerMath, the final norm, the output projection
    and a float32 log-softmax) for each number of rows, on random inputs of the model's shapes: a
    self-attention cache of `cache` positions, cross-attention keys of `source` positions per row.
    Milliseconds per step, medians of `steps`: eager (each step synchronized), and on CUDA the same
    step captured once as a CUDA graph and replayed: the floor a static-shape step would reach
    with no host work, against the eager step's host-bound cost."""
    import torch

    from fairseq_streambeam.loader import load_models, load_task
    from fairseq_streambeam.runtime.lean_layer import LayerMath

    task = load_task(data, src_lang, tgt_lang)
    model = load_models(task, path, device == "cuda", fp16)[0]
    dec = model.decoder
    math_ = LayerMath(dec.layers)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    d = dec.layers[0].self_attn.embed_dim
    out = []

    def timed(fn) -> float:
        times = []
        for _ in range(steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return round(1000 * sorted(times)[len(times) // 2], 4)

    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for n in rows:
            def rand(*shape):
                return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dev, dtype)

            x = rand(n, 1, d)
            shapes = [(layer.self_attn.num_heads, layer.self_attn.head_dim) for layer in dec.layers]
            pk = [rand(n, h, cache, hd) for h, hd in shapes]
            pv = [rand(n, h, cache, hd) for h, hd in shapes]
            ck = [rand(n, h, source, hd) for h, hd in shapes]
            cv = [rand(n, h, source, hd) for h, hd in shapes]

            step = functools.partial(_lean_step, math_, dec, x, pk, pv, ck, cv)
            for _ in range(3):
                step()
            row = {"rows": n, "eager_ms": timed(step)}
            if dev.type == "cuda":
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            step()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    row["graph_ms"] = timed(graph.replay)
                    del graph
                except RuntimeError as e:  # a host sync inside the step cannot be captured
                    row["graph_error"] = str(e).splitlines()[0][:200]
            out.append(row)
            print(f"lean step: {row}", flush=True)
    return out


def profile_steps(data: str, path: str, src_lang: str, tgt_lang: str, beam: int = 5, sources: int = 64,
                  methods: Sequence[str] = ("fairseq", "beam", "var-stream"), device: str = "cuda",
                  fp16: bool = False, top: int = 8, subset: str = "test") -> dict:
    """Host time against device time per decoder step: one batch of `sources` test sentences of
    about the median length (sources x beam rows), decoded by fairseq's SequenceGenerator and the
    plugin's decodings. Per method: wall ms per step (unprofiled, after one warm-up decode), and
    under torch.profiler the device's busy ms per step (the kernels' time, each kernel once: the ops
    that launch kernels carry their time too), the host's ms per step in synchronizing calls and
    copies, synchronizing calls and copies per step (a copy to the host is one of each), and the top
    kernels by device time and operators by host time. A method named `<decoding>+compile` runs
    with --compile (on CUDA: its steps replayed as CUDA graphs, captured in the warm-up);
    `<decoding>+compile-quarter` the same with the graphs' rows past 64 padded to quarter octaves,
    not powers of two (`quarter_octave_rows` for graph_step._row_bucket during the method's
    decodes: an A/B of the padding, a candidate the package does not take unmeasured)."""
    import torch
    from fairseq import utils
    from fairseq.sequence_generator import SequenceGenerator
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fairseq_streambeam import StreamBeamGenerator
    from fairseq_streambeam.loader import load_models, load_task
    from fairseq_streambeam.runtime import graph_step

    cuda = device == "cuda"
    task = load_task(data, src_lang, tgt_lang)
    models = load_models(task, path, cuda, fp16)
    task.load_dataset(subset)
    ds = task.dataset(subset)
    order = sorted(range(len(ds)), key=lambda i: ds.src_sizes[i])
    mid = len(order) // 2
    picked = order[max(0, mid - sources // 2): max(0, mid - sources // 2) + sources]
    sample = ds.collater([ds[i] for i in picked])
    if cuda:
        sample = utils.move_to_cuda(sample)
    sync_calls = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    copy_calls = ("cudaMemcpyAsync", "cudaMemcpy")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def decode(gen) -> int:
        """Decoder steps: the plugin's counters; fairseq's generator steps until its longest
        finished hypothesis (EOS included) ends."""
        before = gen.counters.decoder_steps if hasattr(gen, "counters") else 0
        with torch.no_grad():
            hyps = gen.generate(models, sample)
        if cuda:
            torch.cuda.synchronize()
        if hasattr(gen, "counters"):
            return gen.counters.decoder_steps - before
        return max(len(h["tokens"]) for nbest in hyps for h in nbest)

    def us(e, kind: str) -> float:  # torch renamed cuda_* to device_* timings
        return float(getattr(e, f"self_{kind}_time_total", 0) or 0)

    out = {"sources": len(picked), "beam": beam, "rows": len(picked) * beam, "fp16": fp16, "methods": {}}
    row_bucket = graph_step._row_bucket
    for name in methods:
        decoding, _, extra = name.partition("+")
        if extra not in ("", "compile", "compile-quarter"):
            raise SystemExit(f"profile: unknown method {name}")
        if name == "fairseq":
            gen = SequenceGenerator(models, task.target_dictionary, beam_size=beam, max_len_b=200)
        else:
            gen = StreamBeamGenerator(models, task.target_dictionary, beam_size=beam, decoding=decoding,
                                      max_len_b=200, compile=extra.startswith("compile"))
        if extra == "compile-quarter":
            graph_step._row_bucket = quarter_octave_rows
        try:
            # warm-up: first calls, allocator, cuBLAS handles; with --compile until a decode captures
            # no graph (buffers that grew in one drop the graphs captured before it)
            for _ in range(4 if extra else 1):
                before = _captures(gen)
                decode(gen)
                if _captures(gen) == before:
                    break
            t0 = time.perf_counter()
            steps = max(decode(gen), 1)
            wall = time.perf_counter() - t0
            with profile(activities=activities) as prof:
                decode(gen)
        finally:
            graph_step._row_bucket = row_bucket
        events = prof.key_averages()
        kernels = [e for e in events if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
                   and not getattr(e, "is_user_annotation", False)]
        device_us = sum(us(e, "device") or us(e, "cuda") for e in kernels)
        syncs = [e for e in events if e.key in sync_calls]
        copies = [e for e in events if e.key in copy_calls]
        by_device = sorted(kernels, key=lambda e: -(us(e, "device") or us(e, "cuda")))[:top]
        by_host = sorted(events, key=lambda e: -us(e, "cpu"))[:top]
        out["methods"][name] = {
            "steps": steps, "wall_ms_per_step": round(1000 * wall / steps, 3),
            "device_ms_per_step": round(device_us / 1000 / steps, 3),
            "sync_wait_ms_per_step": round(sum(us(e, "cpu") for e in syncs + copies) / 1000 / steps, 3),
            "syncs_per_step": round(sum(e.count for e in syncs) / steps, 2),
            "copies_per_step": round(sum(e.count for e in copies) / steps, 2),
            "top_device": [[e.key, round((us(e, "device") or us(e, "cuda")) / 1000 / steps, 3)] for e in by_device],
            "top_host": [[e.key, round(us(e, "cpu") / 1000 / steps, 3)] for e in by_host]}
        m = out["methods"][name]
        print(f"profile: {name}: {steps} steps, {m['wall_ms_per_step']} ms a step, device busy "
              f"{m['device_ms_per_step']} ms, waiting in syncs {m['sync_wait_ms_per_step']} ms, "
              f"{m['syncs_per_step']} syncs and {m['copies_per_step']} copies a step", flush=True)
    return out


def quarter_octave_rows(n: int) -> int:
    """Rows padded to powers of two up to 64 (at least 8), then to multiples of an eighth of the
    next power of two (80, 96, ..., 320, 384, ...): padding under a quarter, 320 rows stay 320."""
    b = max(8, 1 << max(0, n - 1).bit_length())
    return b if b <= 64 else -(-n // (b // 8)) * (b // 8)


def _captures(gen) -> int:
    """CUDA graphs `gen`'s steps have captured (0 for fairseq's generator and eager steps)."""
    return sum(getattr(getattr(b, "graph", None), "captures", 0) for b in getattr(gen, "blocks", []))


def builtin_methods() -> set:
    """The benchmark's built-in method names, read from the checkout's
    fairseq_streambeam/bench/variants.py (standard library only) without importing the package,
    which imports fairseq."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_variants", VARIANTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up while building Variant
    spec.loader.exec_module(module)
    return set(module.BUILTIN)


# ---- bench-config -------------------------------------------------------------------------------

def _variant_names(v) -> List[str]:
    """Names of a config's variant entry: built-in names (a string, possibly comma-separated) or
    an object's `name`."""
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return [v.get("name", "")]


def bench_config(src: Path, dst: Path, drop: Sequence[str] = ()) -> List[str]:
    """Benchmark config `src` (configs/*.json) copied to `dst` without the variants named in `drop`
    (e.g. ct2 where CTranslate2 cannot run: the benchmark refuses a config asking for it), settings
    and comments as they are. Returns the names of the variants kept."""
    cfg = json.loads(src.read_text())
    if "sweep" in cfg and drop:
        raise SystemExit(f"bench-config: {src} has a sweep; only listed variants can be dropped")
    gone = set(drop)
    kept = []
    for v in cfg.get("variants", []):
        names = [n for n in _variant_names(v) if n not in gone]
        if isinstance(v, str):
            if names:
                kept.append(",".join(names))
        elif names:
            kept.append(v)
    cfg["variants"] = kept
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(cfg, indent=1) + "\n")
    return [n for v in kept for n in _variant_names(v)]


# ---- summarize ----------------------------------------------------------------------------------

BENCH_COLUMNS = [("method", "method"), ("bleu", "BLEU"), ("seconds_median", "time s"),
                 ("ratio_to_baseline", "x baseline"), ("sentences_per_second", "sent/s"),
                 ("decoder_steps", "steps"), ("expansions_per_step", "exp/step"),
                 ("accepted_per_pass", "acc/pass"), ("peak_mb", "peak MB"), ("identical_to_exact_ref", "identical")]


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _stage_status(work: Path) -> List[dict]:
    """Rows of WORK/stages.tsv (stage, command label, exit status, seconds) written by gpu_check.sh."""
    p = work / "stages.tsv"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            rows.append({"stage": parts[0], "what": parts[1], "rc": int(parts[2]), "seconds": int(parts[3])})
    return rows


def _tests_summary(work: Path) -> Optional[dict]:
    """Counts from the tests stage's JUnit XML (pytest --junitxml)."""
    import xml.etree.ElementTree as ET

    p = work / "tests.xml"
    if not p.exists():
        return None
    try:
        root = ET.parse(p).getroot()
    except ET.ParseError:
        return {"error": "tests.xml unreadable (pytest cut off?)"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "failed": failed}


def summarize(work: Path, out: Path) -> dict:
    """Gather WORK's outputs (env.json, stages.tsv, tests.xml, bench-*/results.json,
    step_cost*.json, lean_step*.json, profile*.json, serve/serve.json) into OUT/results.json,
    OUT/results.md and OUT/gpu_check.png."""
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"env": _read_json(work / "env.json") or {}, "stages": _stage_status(work),
                    "tests": _tests_summary(work), "bench": {}, "step_cost": {}}
    for p in sorted(work.glob("bench-*/results.json")):
        j = _read_json(p)
        if j is not None:
            result["bench"][p.parent.name[len("bench-"):]] = {
                "sentences": j.get("sentences"), "device": j.get("device"), "path": j.get("path"),
                "settings": {k: j.get("settings", {}).get(k) for k in ("beam", "batch_size", "repeats", "limit")},
                "rows": [{k: r.get(k) for k, _ in BENCH_COLUMNS} for r in j.get("rows", [])]}
    for p in sorted(work.glob("step_cost*.json")):
        j = _read_json(p)
        if j is not None:
            result["step_cost"][p.stem] = j
    for p in sorted(work.glob("lean_step*.json")):
        j = _read_json(p)
        if j is not None:
            result.setdefault("lean_step", {})[p.stem] = j
    for p in sorted(work.glob("profile*.json")):
        j = _read_json(p)
        if j is not None:
            result.setdefault("profile", {})[p.stem] = j
    j = _read_json(work / "serve" / "serve.json")
    if j is not None:
        result["serve"] = {"meta": j.get("meta"), "rows": [{k: v for k, v in r.items() if k != "report"}
                                                           for r in j.get("rows", [])]}
        md = work / "serve" / "serve.md"
        result["serve_md"] = md.read_text(encoding="utf-8") if md.exists() else ""
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result))
    plot(result, out / "gpu_check.png")
    return result


def markdown(result: dict) -> str:
    env = result.get("env") or {}
    lines = ["# GPU check", "", " | ".join(f"{k}: {v}" for k, v in env.items()) or "(no environment recorded)", ""]
    if result.get("stages"):
        lines += ["| stage | what | exit | seconds |", "|---|---|---|---|"]
        lines += [f"| {s['stage']} | {s['what']} | {s['rc']} | {s['seconds']} |" for s in result["stages"]]
        lines.append("")
    t = result.get("tests")
    if t:
        if "error" in t:
            lines += [f"tests: {t['error']}", ""]
        else:
            lines += [f"tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped",
                      *[f"- FAILED {name}" for name in t["failed"]], ""]
    for name, b in result.get("bench", {}).items():
        s = b["settings"]
        lines += [f"## {name}: {b['sentences']} sentences on {b['device']}, beam {s['beam']}, batch {s['batch_size']}, "
                  f"{s['repeats']} repeat(s)", "",
                  "| " + " | ".join(t for _, t in BENCH_COLUMNS) + " |", "|" + "---|" * len(BENCH_COLUMNS)]
        lines += ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k, _ in BENCH_COLUMNS) + " |"
                  for r in b["rows"]]
        lines.append("")
    if result.get("serve_md"):
        lines += ["#" + result["serve_md"].rstrip(), ""]  # serve_bench's own report, one level down
    for name, curve in result.get("step_cost", {}).items():
        lines += [f"## {name}: one decoder step (ms) by rows", "",
                  "| rows | " + " | ".join(str(c["rows"]) for c in curve) + " |", "|---|" + "---|" * len(curve),
                  "| ms | " + " | ".join(str(c["ms_per_step"]) for c in curve) + " |", ""]
    for name, curve in result.get("lean_step", {}).items():
        lines += [f"## {name}: the plugin's decoder step (ms) by rows, eager and replayed as a CUDA graph", "",
                  "| rows | " + " | ".join(str(c["rows"]) for c in curve) + " |", "|---|" + "---|" * len(curve)]
        for key in ("eager_ms", "graph_ms"):
            cells = (str(c.get(key, c.get("graph_error", "-"))) for c in curve)
            lines.append(f"| {key[:-3]} | " + " | ".join(cells) + " |")
        lines.append("")
    for name, prof in result.get("profile", {}).items():
        lines += [f"## {name}: per decoder step, {prof['sources']} sources x beam {prof['beam']} = {prof['rows']} rows"
                  f"{', fp16' if prof.get('fp16') else ''}", "",
                  "| method | steps | wall ms | device busy ms | waiting in syncs and copies ms | syncs | copies |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {m} | {r['steps']} | {r['wall_ms_per_step']} | {r['device_ms_per_step']} | "
                  f"{r['sync_wait_ms_per_step']} | {r['syncs_per_step']} | {r.get('copies_per_step', '-')} |"
                  for m, r in prof["methods"].items()]
        for m, r in prof["methods"].items():
            lines += ["", f"{m}, top operators (ms a step): device " + ", ".join(f"{k} {v}" for k, v in r["top_device"])
                      + "; host " + ", ".join(f"{k} {v}" for k, v in r["top_host"])]
        lines.append("")
    return "\n".join(lines) + "\n"


def short_table(result: dict) -> str:
    """A few lines for the end of a run: failed commands, test counts, each bench's speed ratios."""
    lines = [f"FAILED {s['stage']} {s['what']} (exit {s['rc']})" for s in result.get("stages", []) if s["rc"]]
    t = result.get("tests")
    if t and "error" not in t:
        lines.append(f"tests: {t['tests']} run, {t['failures'] + t['errors']} failed, {t['skipped']} skipped")
    lines.append(f"{'bench':16s} {'method':16s} {'x base':>7s} {'BLEU':>6s} {'acc/pass':>8s} {'identical':>9s}")
    for name, b in result.get("bench", {}).items():
        for r in b["rows"]:
            cells = [r.get(k) for k in ("ratio_to_baseline", "bleu", "accepted_per_pass", "identical_to_exact_ref")]
            lines.append(f"{name:16s} {r['method']:16s} " + " ".join(
                f"{'' if c is None else c!s:>{w}s}" for c, w in zip(cells, (7, 6, 8, 9))))
    for r in (result.get("serve") or {}).get("rows", []):
        p99 = "n/a" if r.get("p99_ms") is None else f"{r['p99_ms']:.0f}"
        lines.append(f"serve {r['mode']:10s} {r['clients']:>4} clients {r['throughput']:.2f} sent/s, p99 {p99} ms, "
                     f"{r['identical']} of {r['lines']} identical")
    for name, curve in result.get("step_cost", {}).items():
        lines.append(f"{name}: " + ", ".join(f"{c['rows']} rows {c['ms_per_step']} ms" for c in curve))
    for name, curve in result.get("lean_step", {}).items():
        lines.append(f"{name}: " + ", ".join(f"{c['rows']} rows {c['eager_ms']} ms" + (
            f" (graph {c['graph_ms']})" if "graph_ms" in c else "") for c in curve))
    for name, prof in result.get("profile", {}).items():
        for m, r in prof["methods"].items():
            lines.append(f"{name} {m}: {r['steps']} steps, {r['wall_ms_per_step']} ms a step, device busy "
                         f"{r['device_ms_per_step']} ms, syncs {r['syncs_per_step']}, copies "
                         f"{r.get('copies_per_step', '-')} ({r['sync_wait_ms_per_step']} ms)")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Optional[Path]:
    """Step cost against rows (log-log) and each bench's time ratios to its baseline, in one PNG."""
    try:
        import logging

        import matplotlib

        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq, when imported, logs at DEBUG
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    benches = [(n, b) for n, b in result.get("bench", {}).items() if b["rows"]]
    panels = (1 if result.get("step_cost") else 0) + len(benches)
    if not panels:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), squeeze=False)
    axes = list(axes[0])
    if result.get("step_cost"):
        ax = axes.pop(0)
        for name, curve in result["step_cost"].items():
            ax.plot([c["rows"] for c in curve], [c["ms_per_step"] for c in curve], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("ms per decoder step")
        ax.legend(fontsize=7)
    for ax, (name, b) in zip(axes, benches):
        rows = [r for r in b["rows"] if r.get("ratio_to_baseline") is not None]
        ax.bar([r["method"] for r in rows], [r["ratio_to_baseline"] for r in rows])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("time / baseline")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- command line -------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim-wheel", help="drop members under the given prefixes from a wheel (in place)")
    s.add_argument("wheel", type=Path)
    s.add_argument("prefixes", nargs="+")
    s = sub.add_parser("slim-checkpoint", help="weights only, fp16 by default")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    s.add_argument("--dtype", choices=["fp16", "fp32"], default="fp16")
    s = sub.add_parser("check-wheels", help="every requirement of the carried wheels is carried or on the GPU image")
    s.add_argument("folder", type=Path)
    s = sub.add_parser("spm-encode", help="segment text with a sentencepiece model")
    s.add_argument("model")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    s.add_argument("--lines", type=int, default=0)
    def model_parser(name: str, help: str):  # the commands that load a model and write a JSON file
        s = sub.add_parser(name, help=help)
        s.add_argument("--data", required=True)
        s.add_argument("--path", required=True)
        s.add_argument("-s", "--source-lang", required=True)
        s.add_argument("-t", "--target-lang", required=True)
        s.add_argument("--device", default="cuda")
        s.add_argument("--out", type=Path, required=True)
        return s

    s = model_parser("step-cost", "time of one decoder step by number of rows")
    s.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    s.add_argument("--prefix", type=int, default=16)
    s.add_argument("--steps", type=int, default=20)
    s = model_parser("lean-step-cost", "the plugin's decoder step by rows: eager, and replayed as a CUDA graph")
    s.add_argument("--rows", default="1,8,64,320,1024,3200")
    s.add_argument("--fp16", action="store_true")
    s = model_parser("profile", "host time against device time per decoder step, by method")
    s.add_argument("--beam", type=int, default=5)
    s.add_argument("--sources", type=int, default=64)
    s.add_argument("--methods", default="fairseq,beam,var-stream")
    s.add_argument("--fp16", action="store_true")
    s = sub.add_parser("has-method", help="exit 0 when the benchmark has this built-in method")
    s.add_argument("name")
    s = sub.add_parser("bench-config", help="a copy of a benchmark config without some of its variants")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    s.add_argument("--drop", nargs="*", default=[], help="variant names to leave out (e.g. ct2)")
    s = sub.add_parser("summarize", help="results.json, results.md and gpu_check.png from a work folder")
    s.add_argument("work", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--print", action="store_true", help="print a short table of the results")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parser().parse_args(argv)

    if a.cmd == "slim-wheel":
        if not a.wheel.exists():
            raise SystemExit(f"slim-wheel: no such wheel {a.wheel}")
        n, before, after = slim_wheel(a.wheel, a.prefixes)
        print(f"{a.wheel.name}: dropped {n} members, {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    elif a.cmd == "slim-checkpoint":
        if not a.src.exists():
            raise SystemExit(f"slim-checkpoint: no such checkpoint {a.src}")
        before, after = slim_checkpoint(a.src, a.dst, a.dtype)
        print(f"{a.dst}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB ({a.dtype} weights, no optimizer state)")
    elif a.cmd == "check-wheels":
        if not any(a.folder.glob("*.whl")):
            raise SystemExit(f"check-wheels: no wheels in {a.folder}")
        problems = check_wheels(a.folder)
        for line in problems:
            print(f"check-wheels: {line}", file=sys.stderr)
        if problems:
            return 1
        print(f"check-wheels: {len(list(a.folder.glob('*.whl')))} wheels; every requirement is carried or on the "
              "GPU image")
    elif a.cmd == "spm-encode":
        if not a.src.exists():
            raise SystemExit(f"spm-encode: no such file {a.src}")
        print(f"{a.dst}: {spm_encode(a.model, a.src, a.dst, a.lines)} lines")
    elif a.cmd == "step-cost":
        rows = [int(x) for x in a.rows.split(",") if x.strip()]
        curve = step_cost(a.data, a.path, a.source_lang, a.target_lang, rows, a.prefix, a.steps, a.device)
        a.out.write_text(json.dumps(curve, indent=1))
    elif a.cmd == "lean-step-cost":
        rows = [int(x) for x in a.rows.split(",") if x.strip()]
        curve = lean_step_cost(a.path, a.data, a.source_lang, a.target_lang, rows, device=a.device, fp16=a.fp16)
        a.out.write_text(json.dumps(curve, indent=1))
    elif a.cmd == "profile":
        prof = profile_steps(a.data, a.path, a.source_lang, a.target_lang, a.beam, a.sources,
                             [m for m in a.methods.split(",") if m], a.device, a.fp16)
        a.out.write_text(json.dumps(prof, indent=1))
    elif a.cmd == "has-method":
        return 0 if a.name in builtin_methods() else 1
    elif a.cmd == "bench-config":
        if not a.src.exists():
            raise SystemExit(f"bench-config: no such config {a.src}")
        kept = bench_config(a.src, a.dst, a.drop)
        if not kept:
            raise SystemExit(f"bench-config: no variant of {a.src} left")
        print(f"{a.dst}: {', '.join(kept)}")
    elif a.cmd == "summarize":
        result = summarize(a.work, a.out)
        if a.print:
            print(short_table(result))
        print(f"wrote {a.out / 'results.json'}, {a.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
