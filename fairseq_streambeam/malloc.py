"""glibc's malloc set to keep the memory a decoding frees, for the plugin's own commands.

A decoder step allocates and frees buffers of megabytes (logits, log-probs, caches). glibc's
defaults give such buffers back to the kernel, by unmapping them or by trimming the heap's top, so
a later step faults their pages in again: deen-tiny's beam over 300 sentences on the CPU takes
587K page faults, 172K with this setting, and about 0.94x the time (docs/benchmarks.md, "What the
engine's parts save"). Raising the mmap threshold to its maximum and the trim threshold out of
reach keeps those pages in the process. The commands and
the bench call this once, at start; a library imported into someone else's process does not
(fairseq-generate --user-dir: set the environment variables below yourself).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks above it are still mapped apart
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # and glibc.malloc.* in GLIBC_TUNABLES


def retain_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (above) for this process, unless the environment sets
    malloc's own (`ENVIRONMENT`, or malloc tunables: the user's choice stands) or the C library is
    not glibc. Returns whether they were set. The cost: the process keeps its peak heap (deen-tiny
    at k = 50: 1.9 GB resident at most, against 1.6 GB)."""
    if any(name in os.environ for name in ENVIRONMENT) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
