"""Peak memory of one benchmark run: CUDA allocator peak, or resident set size sampled on CPU."""

import os
import threading

import torch


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:  # Linux only, where os.sysconf exists
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class PeakMemory:
    """`with PeakMemory(cuda) as m: ...; m.peak_mb` -- CPU: max RSS sampled every `interval` seconds,
    which counts what earlier methods left resident (compare methods' memory in separate runs).
    `cuda` is the run's device, not the machine's."""

    def __init__(self, cuda: bool, interval: float = 0.02):
        self.cuda = cuda
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak = _rss_bytes()
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())
        self.peak_mb: float = round(self.peak / 2**20, 1)
