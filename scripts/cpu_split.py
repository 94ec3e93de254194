"""Where a decoding's CPU time goes, by kind of work, sampled with Linux `perf`: matrix products,
copies, softmax, top-k, Python, torch's dispatch, the allocator and the kernel. Runs the bench once
per method (`python -m fairseq_streambeam.bench ... --methods M --repeats R`), each in its own
process, samples it from the end of its first timed pass to the end of its last (loading,
converting and warming up are left out), and gives each kind's share of a sampled pass in seconds.
`ct2` (CTranslate2) is a method like the others, so the split shows where the plugin's step spends
what CTranslate2's does not.

  python scripts/cpu_split.py --methods beam,var-stream,ct2 --repeats 3 -- BENCH ARGS

BENCH ARGS are the bench's (--data, --path, -s, -t, --beam, --limit, --threads, ...). Needs `perf`
(linux-tools) and kernel.perf_event_paranoid <= 2. A symbol's kind is read from its name by the
patterns of `KINDS`, first match: a guide to where time goes, not an exact account (a product's
own bookkeeping counts as a product; "other torch" is the rest of libtorch: the dispatcher, views,
small operators).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

KINDS = [  # (kind, pattern over "dso symbol"): the first that matches
    ("products", r"\[JIT\]|mkl_blas|sgemm|gemm|brgemm|dnnl|mkldnn|gemv"),
    ("copies", r"memmove|memcpy|direct_copy|index_select|copy_kernel|Gather|Concat|gather|cat_serial|transpose"),
    ("softmax", r"softmax|expf|Sleef"),
    ("top-k", r"topk|TopK|adjust_heap|sort"),
    ("Python, numpy", r"libpython|_multiarray|numpy"),
    ("allocator", r"malloc|_int_free|\bfree\b|unlink_chunk|consolidate|cfree"),
    ("kernel", r"kernel\.kallsyms"),
    ("element-wise", r"VectorizedLoop|vectorized_loop|layer_norm|LayerNorm|RowwiseMoments|add<|relu|BiasAdd"),
    ("other torch", r"libtorch|libc10"),
]


def kind_of(line: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, line):
            return kind
    return "other"


def split(perf_data: str) -> dict:
    """Share of samples by kind, from `perf report` over `perf_data` (sample counts: JIT-compiled
    products spread over thousands of addresses, each under a printed 0.01%)."""
    report = subprocess.run(["perf", "report", "-i", perf_data, "--no-children", "-n", "--sort", "dso,symbol",
                             "-g", "none", "--percent-limit", "0", "--stdio"], capture_output=True, text=True,
                            check=True).stdout
    counts: collections.Counter = collections.Counter()
    for line in report.splitlines():
        m = re.match(r"\s+[\d.]+%\s+(\d+)\s+(.*)", line)
        if m:
            counts[kind_of(m.group(2))] += int(m.group(1))
    total = sum(counts.values()) or 1
    return {kind: n / total for kind, n in counts.items()}


def sample(method: str, repeats: int, bench_args: list, perf_data: str, freq: int, tmp: str) -> list:
    """Runs the bench for `method` under `perf record`, sampling only from the end of its first
    timed pass to the end of its last, switched by perf's control fifo (attaching perf to the
    running bench with -p instead made its passes 1.2x slower on an EPYC of CPU family 26); returns
    every pass's seconds."""
    ctl = os.path.join(tmp, f"{method}.ctl")
    os.mkfifo(ctl)
    cmd = ["perf", "record", "-q", "-F", str(freq), "-D", "-1", "--control", f"fifo:{ctl}", "-o", perf_data, "--",
           sys.executable, "-m", "fairseq_streambeam.bench", *bench_args, "--methods", method, "--baseline", method,
           "--exact-ref", method, "--repeats", str(repeats), "--quiet", "--no-plots",
           "--out", os.path.join(tmp, f"{method}-bench")]  # last: a bench --out among bench_args is overridden
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    control = open(ctl, "w")  # noqa: SIM115 (open for the run's life; perf opens its end at start)
    times = []
    for line in run.stdout:  # type: ignore[union-attr]
        m = re.match(rf"\s+repeat (\d+)/{repeats}\s+\S+\s+([\d.]+)s", line)
        if m:
            times.append(float(m.group(2)))
            if int(m.group(1)) in (1, repeats):
                control.write("enable\n" if m.group(1) == "1" else "disable\n")
                control.flush()
    control.close()
    if run.wait() != 0 or len(times) != repeats:
        sys.exit(f"cpu_split.py: the bench for {method} failed (exit {run.returncode})")
    return times


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="beam,var-stream,ct2")
    p.add_argument("--repeats", type=int, default=3, help="passes per method; the first is not sampled")
    p.add_argument("--freq", type=int, default=1000, help="samples a second")
    p.add_argument("--keep", help="a folder to keep each method's perf.data in (METHOD.perf), for perf report")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the bench's arguments")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.repeats < 2:
        p.error("--repeats must be at least 2 (the first pass is not sampled)")
    bench_args = [a for a in args.bench_args if a != "--"]
    rows = {}
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            data = os.path.join(args.keep or tmp, f"{method}.perf")
            times = sample(method, args.repeats, bench_args, data, args.freq, tmp)
            sampled = sum(times[1:]) / len(times[1:])
            rows[method] = (sampled, {k: s * sampled for k, s in split(data).items()})
            print(f"{method}: {times[0]:.2f} s unsampled, then {len(times) - 1} sampled passes of {sampled:.2f} s",
                  flush=True)
    kinds = [k for k, _ in KINDS] + ["other"]
    print("\n| kind | " + " | ".join(f"{m} (s)" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{r[1].get(k, 0.0):.2f}" for r in rows.values()) + " |")
    print("| pass | " + " | ".join(f"{r[0]:.2f}" for r in rows.values()) + " |")


if __name__ == "__main__":
    main()
