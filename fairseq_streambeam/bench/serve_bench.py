"""Serving benchmark: the HTTP server's continuous batching against its two baselines, in one command.

Decodes the input once offline (streambeam-decode-corpus, the same model and decoding options) as
the reference; then for each --modes batching (continuous, static, single) starts ONE server
(`python -m fairseq_streambeam.serve --port 0 --batching MODE ...`), warms it up, and for each
--clients count sends every input line once with that many closed-loop clients (bench/load.py),
checking each answer against the reference; then stops the server with SIGTERM and checks that it
exits 0. With --overload-seconds, a continuous server with a small --max-queue is then driven open
loop at --overload-factor times its capacity (continuous throughput at 32 clients) and must refuse
cleanly (429) and answer everything it accepted, without hanging.

The model and decoding options come after `--` and go to both the reference and every server;
--server-args go to the servers only. Prints a Markdown table (and, with --out DIR, writes
DIR/serve.md, DIR/serve.json and the servers' logs):

  python -m fairseq_streambeam.bench.serve_bench --input newstest2017.de --limit 300 \\
      --clients 1,8,32,128 --modes continuous,static,single --out serve_bench -- \\
      --data DICT_DIR --path model.pt -s de -t en --bpe sentencepiece --sentencepiece-model spm.model --beam 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..frontend import fairseq_log_level
from .load import LoadReport, positive, read_lines, run_load

MODES = ("continuous", "static", "single")
_LISTENING = re.compile(r"^streambeam-serve: .* on http://(\S+):(\d+) \(", re.M)
STARTUP_TIMEOUT = 600.0  # s for a server to load its model and listen
STOP_TIMEOUT = 180.0  # s for a server to answer what it accepted and exit after SIGTERM


@dataclass
class ServerRun:
    """One server process: its command line, address, logs and how it ended."""

    name: str
    cmd: List[str]
    log_dir: Path
    url: str = ""
    exit_code: Optional[int] = None  # None: still running, or killed after STOP_TIMEOUT
    killed: bool = False
    startup_s: float = 0.0
    proc: Any = field(default=None, repr=False)

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"server-{self.name}.out"

    @property
    def stderr_path(self) -> Path:
        return self.log_dir / f"server-{self.name}.err"

    def start(self, env: Dict[str, str]) -> None:
        t0 = time.perf_counter()
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        deadline = t0 + STARTUP_TIMEOUT
        while True:
            m = _LISTENING.search(self.stdout_path.read_text(encoding="utf-8", errors="replace"))
            if m:
                self.url = f"http://{m.group(1)}:{m.group(2)}"
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode} before listening:\n"
                                   + _tail(self.stderr_path))
            if time.perf_counter() > deadline:
                self.kill()
                raise RuntimeError(f"server {self.name} did not listen within {STARTUP_TIMEOUT:.0f} s")
            time.sleep(0.1)
        while not health_ok(self.url):
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                self.kill()
                raise RuntimeError(f"server {self.name} at {self.url} never answered /health:\n"
                                   + _tail(self.stderr_path))
            time.sleep(0.1)
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> Optional[int]:
        """SIGTERM, then wait for the exit (killed after STOP_TIMEOUT); the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            self.exit_code = None if self.proc is None else self.proc.returncode
            return self.exit_code
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.exit_code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.killed = True


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _counts(value: str) -> List[int]:
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return counts


def _modes(value: str) -> List[str]:
    modes = [v.strip() for v in value.split(",") if v.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {value!r}")
    return modes


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, model_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="python -m fairseq_streambeam.bench.serve_bench", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --input FILE [options] -- MODEL_AND_DECODING_OPTIONS",
        epilog="After `--`: the model and decoding options of streambeam-serve and streambeam-decode-corpus "
               "(--data --path -s -t --bpe --sentencepiece-model --beam --decoding ...).")
    p.add_argument("--input", required=True, type=Path, help="source sentences, one per line")
    p.add_argument("--limit", type=positive(int), help="use the first N lines only")
    p.add_argument("--single-limit", type=positive(int),
                   help="single mode sends only the first N of those lines (it is the slow one)")
    p.add_argument("--clients", type=_counts, default=[1, 8, 32, 128], help="closed-loop client counts")
    p.add_argument("--modes", type=_modes, default=list(MODES), help="server batching modes")
    p.add_argument("--batch-wait-ms", type=float, default=20.0, help="static mode's collection window")
    p.add_argument("--server-args", default="",
                   help='extra arguments for every server (not the reference), e.g. '
                        '--server-args="--stream-order continuous"')
    p.add_argument("--threads", type=positive(int), default=1,
                   help="torch threads of the servers and the reference (also OMP_NUM_THREADS)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--warmup", type=int, default=8, help="lines sent (1 client, not measured) after a server starts")
    p.add_argument("--timeout", type=positive(float), default=120.0, help="per request, s; longer counts as hung")
    p.add_argument("--overload-seconds", type=positive(float), help="run the overload stage for S s")
    p.add_argument("--overload-factor", type=positive(float), default=10.0,
                   help="open-loop rate as a multiple of the continuous server's capacity")
    p.add_argument("--overload-max-queue", type=positive(int), default=256, help="--max-queue of that server")
    p.add_argument("--overload-timeout", type=positive(float), default=30.0, help="per request in that stage, s")
    p.add_argument("--out", type=Path, help="write serve.md, serve.json and the servers' logs here")
    args = p.parse_args(own)
    if not model_args:
        p.error("the model options go after `--` (--data --path -s -t ...)")
    args.model_args = model_args
    args.server_extra = shlex.split(args.server_args)
    return args


# ---- the steps ---------------------------------------------------------------------------------


def reference(args: argparse.Namespace, lines: List[str], work: Path, env: Dict[str, str]) -> dict:
    """Decode `lines` offline with the model options; the output lines and how they were made."""
    src = work / "reference-input.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    out_dir = work / "reference"
    cmd = [sys.executable, "-m", "fairseq_streambeam.decode_corpus", "--input", str(src), "--output-dir",
           str(out_dir), *args.model_args, "--threads", str(args.threads), "--quiet"]
    if args.device == "cpu":
        cmd.append("--cpu")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    (work / "reference.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        raise RuntimeError(f"reference decoding failed ({done.returncode}):\n{done.stderr[-3000:]}")
    expect = read_lines(out_dir / "output.txt")
    if len(expect) != len(lines):
        raise RuntimeError(f"reference has {len(expect)} lines for {len(lines)} inputs")
    return {"cmd": cmd, "seconds": seconds, "lines": expect}


def server_cmd(args: argparse.Namespace, mode: str, extra: Optional[List[str]] = None) -> List[str]:
    return [sys.executable, "-m", "fairseq_streambeam.serve", *args.model_args, "--threads", str(args.threads),
            "--device", args.device, "--host", "127.0.0.1", "--port", "0", "--batching", mode,
            "--batch-wait-ms", f"{args.batch_wait_ms:g}", *args.server_extra, *(extra or [])]


def load(url: str, lines: List[str], expect: Optional[List[str]], **kw: Any) -> LoadReport:
    return asyncio.run(run_load(url, lines, expect, **kw))


def cell_row(mode: str, report: LoadReport, lines: int) -> dict:
    refused = sum(report.refused.values())
    return {"mode": mode, "clients": report.clients, "lines": lines, "answered": report.answered,
            "throughput": report.throughput, "p50_ms": report.latency_p50_ms, "p95_ms": report.latency_p95_ms,
            "p99_ms": report.latency_p99_ms, "identical": report.checked - report.mismatches,
            "errors": report.errors, "hung": report.hung, "refused": refused, "wall_s": report.wall_s,
            "ok": report.exit_code == 0 and refused == 0 and report.answered == lines,
            "report": {**asdict(report), "exit_code": report.exit_code}}


def add_ratios(rows: List[dict]) -> None:
    by = {(r["mode"], r["clients"]): r["throughput"] for r in rows}
    for r in rows:
        for base in ("single", "static"):
            b = by.get((base, r["clients"]))
            r[f"x_{base}"] = r["throughput"] / b if b else None


def overload(args: argparse.Namespace, lines: List[str], expect: List[str], rows: List[dict], log_dir: Path,
             env: Dict[str, str], servers: List[ServerRun]) -> dict:
    """Open loop at factor x capacity against a continuous server with a small --max-queue."""
    srv = ServerRun("overload", server_cmd(args, "continuous", ["--max-queue", str(args.overload_max_queue)]),
                    log_dir)
    servers.append(srv)
    srv.start(env)
    result: Dict[str, Any] = {"cmd": srv.cmd, "max_queue": args.overload_max_queue,
                              "seconds": args.overload_seconds, "factor": args.overload_factor,
                              "timeout_s": args.overload_timeout}
    try:
        if args.warmup:
            load(srv.url, lines[:args.warmup], None, clients=1, timeout=args.timeout)
        cap = next((r for r in rows if r["mode"] == "continuous" and r["clients"] == 32), None)
        if cap is not None:
            capacity, source = cap["throughput"], "continuous server at 32 clients (table)"
        else:
            rep = load(srv.url, lines, expect, clients=32, timeout=args.timeout)
            capacity, source = rep.throughput, "this server at 32 clients (measured here)"
        rate = args.overload_factor * capacity
        result.update(capacity=capacity, capacity_source=source, rate=rate)
        print(f"overload: capacity {capacity:.2f} sent/s ({source}); open loop at {rate:.1f} req/s "
              f"for {args.overload_seconds:g} s", flush=True)
        rep = load(srv.url, lines, expect, rate=rate, duration=args.overload_seconds, timeout=args.overload_timeout)
        print(rep.summary(), flush=True)
        result["report"] = {**asdict(rep), "exit_code": rep.exit_code}
        result["healthy_after"] = health_ok(srv.url)
        after = lines[:min(len(lines), 64)]
        check = load(srv.url, after, expect, clients=8, timeout=args.timeout)
        result["check_after"] = {"lines": len(after), "answered": check.answered, "identical":
                                 check.checked - check.mismatches, "errors": check.errors, "hung": check.hung,
                                 "refused": sum(check.refused.values())}
    finally:
        srv.stop()
    result["exit_code"] = srv.exit_code
    r, c = result.get("report"), result.get("check_after")
    result["ok"] = bool(r and not r["errors"] and not r["hung"] and not r["mismatches"]
                        and set(k for k, v in r["refused"].items() if v) <= {429} and result["healthy_after"]
                        and c and c["answered"] == c["identical"] == c["lines"] and srv.exit_code == 0)
    return result


# ---- output ------------------------------------------------------------------------------------


def _f(value: Optional[float], fmt: str = ".1f") -> str:
    return "—" if value is None else format(value, fmt)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _version(package: str) -> str:
    """The installed version of the distribution that provides import package `package`."""
    for dist in [*metadata.packages_distributions().get(package, []), package]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def machine() -> dict:
    return {"processor": platform.processor(), "cpu_model": _cpu_model(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": _version("torch"), "fairseq": _version("fairseq"), "aiohttp": _version("aiohttp")}


def markdown(meta: dict, rows: List[dict], servers: List[dict], over: Optional[dict]) -> str:
    m = meta["machine"]
    out = ["# streambeam-serve: continuous batching against static and single", "",
           f"- machine: {m['cpu_model'] or m['processor'] or m['machine']} ({m['machine']}, "
           f"processor {m['processor'] or 'n/a'}), {m['cpu_count']} CPUs, {m['platform']}",
           f"- python {m['python']}, torch {m['torch']}, fairseq {m['fairseq']}, aiohttp {m['aiohttp']}",
           f"- threads: every server and the reference `--threads {meta['threads']}` (torch.set_num_threads), "
           f"OMP_NUM_THREADS={meta['threads']}, device {meta['device']}; the load generator is one asyncio "
           "process on the same machine",
           f"- input: {meta['input']}, first {meta['lines']} lines"
           + (f" (single mode: first {meta['single_lines']})" if meta["single_lines"] != meta["lines"] else ""),
           f"- each cell sends every line once, one sentence per request, with N closed-loop clients; "
           f"{meta['warmup']} warm-up lines per server first (not measured); per-request timeout {meta['timeout']:g} s",
           f"- reference ({meta['reference_seconds']:.1f} s): `OMP_NUM_THREADS={meta['threads']} "
           f"{shlex.join(meta['reference_cmd'])}`",
           "- servers:"]
    for s in servers:
        status = f"exit {s['exit_code']}" + (" (killed)" if s["killed"] else "")
        out.append(f"  - {s['name']} ({status}, ready in {s['startup_s']:.1f} s): "
                   f"`OMP_NUM_THREADS={meta['threads']} {shlex.join(s['cmd'])}`")
    out += ["", "| mode | clients | answered | throughput (sent/s) | p50 ms | p95 ms | p99 ms | identical to offline "
                "| x single | x static | errors / hung / refused |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['clients']} | {r['answered']} | {r['throughput']:.2f} | {_f(r['p50_ms'])} "
                   f"| {_f(r['p95_ms'])} | {_f(r['p99_ms'])} | {r['identical']} of {r['lines']} "
                   f"| {_f(r['x_single'], '.2f')} | {_f(r['x_static'], '.2f')} "
                   f"| {r['errors']} / {r['hung']} / {r['refused']} |")
    if over is not None:
        out += ["", f"## Overload: open loop at {over['factor']:g} x capacity for {over['seconds']:g} s", ""]
        if "report" not in over:
            out.append(f"not completed: {over.get('error', 'see the log')}")
        else:
            r = over["report"]
            refused = ", ".join(f"{k}: {v}" for k, v in r["refused"].items() if v) or "none"
            mb = ["n/a" if v is None else f"{v / 2**20:.1f}" for v in (r["rss_before"], r["rss_after"])]
            c = over["check_after"]
            out += [f"- capacity {over['capacity']:.2f} sent/s ({over['capacity_source']}); offered "
                    f"{over['rate']:.1f} req/s; server `--max-queue {over['max_queue']}`; per-request timeout "
                    f"{over['timeout_s']:g} s",
                    "",
                    "| sent | sent/s | answered | answered/s | refused | errors | hung | identical | "
                    "p50 ms | p95 ms | p99 ms | RSS before MB | RSS after MB |",
                    "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
                    f"| {r['sent']} | {r['sent'] / over['seconds']:.1f} | {r['answered']} | {r['throughput']:.2f} "
                    f"| {refused} | {r['errors']} | {r['hung']} | {r['checked'] - r['mismatches']} of "
                    f"{r['checked']} | {_f(r['latency_p50_ms'])} | {_f(r['latency_p95_ms'])} "
                    f"| {_f(r['latency_p99_ms'])} | {mb[0]} | {mb[1]} |",
                    "",
                    f"- /health after: {'ok' if over['healthy_after'] else 'NOT ok'}; then {c['lines']} lines with "
                    f"8 clients: {c['answered']} answered, {c['identical']} identical to offline, errors "
                    f"{c['errors']}, hung {c['hung']}, refused {c['refused']}",
                    f"- server exit status after SIGTERM: {over['exit_code']}"]
    problems = meta["problems"]
    out += ["", "Problems: " + ("none" if not problems else "; ".join(problems))]
    return "\n".join(out) + "\n"


# ---- main --------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    fairseq_log_level()
    lines = read_lines(args.input)[:args.limit]
    if not lines:
        print("serve_bench: empty --input", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    tmp = tempfile.TemporaryDirectory(prefix="serve_bench-")
    work = Path(tmp.name)
    log_dir = args.out / "logs" if args.out else work
    log_dir.mkdir(parents=True, exist_ok=True)
    single_lines = min(len(lines), args.single_limit or len(lines))
    meta: Dict[str, Any] = {"machine": machine(), "threads": args.threads, "device": args.device,
                            "input": str(args.input), "lines": len(lines), "single_lines": single_lines,
                            "warmup": args.warmup, "timeout": args.timeout, "clients": args.clients,
                            "modes": args.modes, "batch_wait_ms": args.batch_wait_ms,
                            "server_args": args.server_extra, "model_args": args.model_args, "problems": []}
    problems: List[str] = meta["problems"]
    rows: List[dict] = []
    servers: List[ServerRun] = []
    over: Optional[dict] = None
    try:
        print(f"reference: decoding {len(lines)} lines offline", flush=True)
        ref = reference(args, lines, work, env)
        expect = ref["lines"]
        meta.update(reference_cmd=ref["cmd"], reference_seconds=ref["seconds"])
        print(f"reference: {ref['seconds']:.1f} s", flush=True)
        for mode in args.modes:
            srv = ServerRun(mode, server_cmd(args, mode), log_dir)
            servers.append(srv)
            print(f"{mode}: starting {shlex.join(srv.cmd)}", flush=True)
            srv.start(env)
            print(f"{mode}: listening on {srv.url} after {srv.startup_s:.1f} s", flush=True)
            try:
                if args.warmup:
                    warm = load(srv.url, lines[:args.warmup], None, clients=1, timeout=args.timeout)
                    if warm.exit_code or warm.answered != min(args.warmup, len(lines)):
                        problems.append(f"{mode}: warm-up: {warm.summary()}")
                cell_lines = lines[:single_lines] if mode == "single" else lines
                for clients in args.clients:
                    rep = load(srv.url, cell_lines, expect, clients=clients, timeout=args.timeout)
                    row = cell_row(mode, rep, len(cell_lines))
                    rows.append(row)
                    print(f"{mode} x {clients} clients: {rep.summary()}", flush=True)
                    if not row["ok"]:
                        problems.append(f"{mode} at {clients} clients: answered {rep.answered} of "
                                        f"{len(cell_lines)}, mismatches {rep.mismatches}, errors {rep.errors}, "
                                        f"hung {rep.hung}, refused {row['refused']}")
            finally:
                code = srv.stop()
            print(f"{mode}: server exit status {code}", flush=True)
            if code != 0:
                problems.append(f"{mode}: server exit status {code}" + (" (killed)" if srv.killed else ""))
        if args.overload_seconds:
            try:
                over = overload(args, lines, expect, rows, log_dir, env, servers)
            except RuntimeError as e:
                over = {"factor": args.overload_factor, "seconds": args.overload_seconds, "error": str(e)}
            if not over.get("ok"):
                problems.append("overload stage: see its table" if "report" in over
                                else f"overload stage: {over.get('error')}")
    except RuntimeError as e:
        problems.append(str(e))
        print(f"serve_bench: {e}", file=sys.stderr)
    finally:
        for srv in servers:
            srv.kill()  # only a server still running after an error
    meta.setdefault("reference_cmd", [])
    meta.setdefault("reference_seconds", 0.0)
    add_ratios(rows)
    server_info = [{"name": s.name, "cmd": s.cmd, "url": s.url, "exit_code": s.exit_code, "killed": s.killed,
                    "startup_s": s.startup_s} for s in servers]
    text = markdown(meta, rows, server_info, over)
    print()
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve.md").write_text(text, encoding="utf-8")
        (args.out / "serve.json").write_text(json.dumps({"meta": meta, "servers": server_info, "rows": rows,
                                                         "overload": over}, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out / 'serve.md'} and {args.out / 'serve.json'}")
    tmp.cleanup()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
