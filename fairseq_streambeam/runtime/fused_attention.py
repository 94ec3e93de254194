"""Fused attention for decoder steps on the CPU: scores, float32 softmax and the weighted sum of
values in one pass per (row, head), in C++ (fused_attention.cc).

A beam step's attention is many tiny products: per row and head one query (self-attention) or a
source's few rows (cross-attention, lean_layer.SourceGroups) against tens of keys of 64 floats.
torch's batched products run these far below a core's peak (docs/benchmarks.md, "What the
engine's parts save"). The kernel is compiled once per machine with the system's C++ compiler
(`CXX`, else `c++`), for the CPU it runs on (`-march=native`), into `$XDG_CACHE_HOME/fairseq_streambeam`
(default ~/.cache), keyed by source, flags, compiler and CPU. Without a compiler, or with
`STREAMBEAM_FUSED_ATTENTION=0`, the eager products run. It rounds otherwise than torch's
products, in a score's last float32 bits, so it runs where the repacked weights do
(lean_layer.RepackedLinears: float32 calls over many sources); other calls keep `attention`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_attention.cc")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]
HEAD_DIM = 64  # the kernel's head dimension (fairseq's transformers: base, big, and the tiny models)


def attention(q: Tensor, k: Tensor, v: Tensor, add: Optional[Tensor]) -> Tensor:
    """Queries [B, M, d] over keys and values [B, L, d], `add` broadcast to [B, M, L] (None:
    nothing added): torch's products, softmax in float32 as fairseq's utils.softmax."""
    scores = torch.bmm(q, k.transpose(1, 2)) if add is None else torch.baddbmm(add, q, k.transpose(1, 2))
    return torch.bmm(F.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores), v)


class FusedAttention:
    """`attention` by the compiled kernel where it applies (float32 on the CPU, head dim 64,
    contiguous keys and values, no autograd), else by `attention` itself. Built by `load`."""

    def __init__(self, library: ctypes.CDLL):
        fn = library.attend64_f32
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p, ctypes.c_int]
        self._fn = fn

    @classmethod
    def load(cls) -> Optional[FusedAttention]:
        """The kernel, compiled on first use on each machine; None (with one log line) where it
        cannot be built or is switched off."""
        if os.environ.get("STREAMBEAM_FUSED_ATTENTION", "1") == "0":
            return None
        try:
            return cls(ctypes.CDLL(str(_build())))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("fused attention unavailable (%s); attention runs on torch's products", e)
            return None

    def applies(self, q: Tensor, k: Tensor, v: Tensor, add: Optional[Tensor]) -> bool:
        return (q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == "cpu"
                and q.size(-1) == HEAD_DIM and k.is_contiguous() and v.is_contiguous()
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and (add is None or (add.dtype == torch.float32 and add.dim() == 3)))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, add: Optional[Tensor]) -> Tensor:
        if not self.applies(q, k, v, add):
            return attention(q, k, v, add)
        q = q.contiguous()  # a reshaped view for a single source (lean_layer._attend)
        b, m, length = q.size(0), q.size(1), k.size(1)
        out = q.new_empty(b, m, HEAD_DIM)
        scores = q.new_empty(b * m * length)
        a_ptr, a_b, a_m = None, 0, 0
        if add is not None:
            add = add.expand(b, m, length)
            if add.stride(2) != 1:
                add = add.contiguous()
            a_ptr, a_b, a_m = add.data_ptr(), add.stride(0), add.stride(1)
        self._fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), a_ptr, a_b, a_m, out.data_ptr(), b, m, length,
                 scores.data_ptr(), torch.get_num_threads())
        return out


def _cpu_id() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _build() -> Path:
    """The kernel's shared library for the running machine: compiled once, then reused from the cache."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX)")
    real = os.path.realpath(cxx)
    st = os.stat(real)  # the compiler's identity, without running it for every generator built
    compiler = f"{real} {st.st_size} {st.st_mtime_ns}"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), compiler, _cpu_id()]).encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fairseq_streambeam"
    lib = cache / f"fused_attention-{key[:16]}.so"
    failed = lib.with_suffix(".failed")  # a build that failed is not tried again with the same compiler
    if lib.exists():
        return lib
    if failed.exists():
        raise RuntimeError(failed.read_text().strip())
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # a whole file or none: parallel builds race
        out = Path(tmp) / lib.name
        r = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            lines = r.stderr.strip().splitlines()
            message = f"{Path(cxx).name} failed: {lines[-1] if lines else f'exit code {r.returncode}'}"
            failed.write_text(message + "\n")
            raise RuntimeError(message)
        os.replace(out, lib)
    return lib
