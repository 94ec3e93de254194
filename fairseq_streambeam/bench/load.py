"""Load generator for the HTTP translation server (`python -m fairseq_streambeam.serve`).

Sends the lines of an input file to `POST /translate`, one sentence per request, in input order
(cycling over the file when --duration asks for more requests), and reports how many requests
were answered, refused (400/413/429/503, each counted), failed to connect or hung past --timeout,
the throughput, latency percentiles, mismatches against the offline output (--expect) and the
server's resident memory (`process_resident_memory_bytes` from /metrics) before and after.

Two modes, mutually exclusive:
  --clients N  closed loop: N clients, each waits for its answer before taking the next line
               (default: 1 client); with --retry-429 a refused line is retried after Retry-After.
  --rate R     open loop: a request starts every 1/R s whatever is in flight; never retries.

Exit code 0 when every request was answered or refused cleanly, 1 if any hung, errored or mismatched.

  python -m fairseq_streambeam.bench.load --url http://127.0.0.1:8000 --input test.src \\
      --expect offline.hyp --clients 8 --duration 30 --beam 5 --json load.json
"""

import argparse
import asyncio
import itertools
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, List, Optional

import aiohttp

CLEAN_REFUSALS = (400, 413, 429, 503)
MAX_RETRIES = 100  # per line, with --retry-429
SHOWN = 5  # mismatches / errors kept as examples
OPTIONS = {"beam": int, "nbest": int, "lenpen": float, "max_len_a": float, "max_len_b": int}
_RSS = re.compile(r"^process_resident_memory_bytes(?:\{[^}]*\})?\s+(\S+)", re.M)


@dataclass
class LoadReport:
    url: str
    mode: str  # "closed" (--clients) or "open" (--rate)
    clients: Optional[int]
    rate: Optional[float]
    sent: int = 0  # HTTP requests, retries included: answered + sum(refused) + errors + hung
    answered: int = 0
    refused: dict = field(default_factory=lambda: {code: 0 for code in CLEAN_REFUSALS})
    errors: int = 0  # connection errors, other status codes, malformed answers
    hung: int = 0
    wall_s: float = 0.0
    throughput: float = 0.0  # answered sentences per second of wall time
    latency_p50_ms: Optional[float] = None
    latency_p95_ms: Optional[float] = None
    latency_p99_ms: Optional[float] = None
    checked: int = 0
    mismatches: int = 0
    mismatch_examples: List[dict] = field(default_factory=list)
    error_examples: List[str] = field(default_factory=list)
    rss_before: Optional[float] = None
    rss_after: Optional[float] = None

    @property
    def exit_code(self) -> int:
        return 1 if self.hung or self.errors or self.mismatches else 0

    def summary(self) -> str:
        how = f"{self.clients} clients" if self.mode == "closed" else f"{self.rate:g} req/s open loop"
        refused = ", ".join(f"{code}: {n}" for code, n in self.refused.items())
        lat = "n/a" if self.latency_p50_ms is None else (
            f"p50 {self.latency_p50_ms:.1f} / p95 {self.latency_p95_ms:.1f} / p99 {self.latency_p99_ms:.1f} ms")
        mb = ["n/a" if v is None else f"{v / 2**20:.1f} MB" for v in (self.rss_before, self.rss_after)]
        lines = [f"{self.url} ({how}), {self.wall_s:.2f} s",
                 f"sent {self.sent}, answered {self.answered}, refused ({refused}), "
                 f"errors {self.errors}, hung {self.hung}",
                 f"throughput {self.throughput:.2f} sent/s, latency {lat}",
                 f"server RSS {mb[0]} -> {mb[1]}"]
        if self.checked:
            lines.append(f"mismatches {self.mismatches} of {self.checked} checked")
        lines += [f"  line {m['line']}: expected {m['expected']!r}, got {m['got']!r}" for m in self.mismatch_examples]
        lines += [f"  error: {e}" for e in self.error_examples]
        return "\n".join(lines)


def percentile(values: List[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def read_lines(path: Path) -> List[str]:
    """One entry per line (empty lines kept); a final newline does not add an empty line."""
    text = Path(path).read_text(encoding="utf-8")
    return text.removesuffix("\n").split("\n") if text else []


async def read_rss(session: aiohttp.ClientSession, url: str) -> Optional[float]:
    """`process_resident_memory_bytes` from the server's /metrics, None if unavailable."""
    try:
        async with asyncio.timeout(5):
            async with session.get(url.rstrip("/") + "/metrics") as resp:
                if resp.status != 200:
                    return None
                m = _RSS.search(await resp.text())
        return float(m.group(1)) if m else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def run_load(url: str, lines: List[str], expect: Optional[List[str]] = None, clients: Optional[int] = None,
                   rate: Optional[float] = None, duration: Optional[float] = None, timeout: Optional[float] = 60.0,
                   options: Optional[dict] = None, retry_429: bool = False) -> LoadReport:
    """Run the load: closed loop with `clients` (default 1) or open loop at `rate` requests/s (never both).
    Without `duration` each line is sent once; with it, lines cycle until `duration` s have passed."""
    if clients is not None and rate is not None:
        raise ValueError("clients and rate are mutually exclusive")
    if not lines:
        raise ValueError("no input lines")
    if expect is not None and len(expect) < len(lines):
        raise ValueError(f"expect has {len(expect)} lines for {len(lines)} input lines")
    if rate is None:
        clients = clients or 1
    report = LoadReport(url=url, mode="closed" if rate is None else "open", clients=clients, rate=rate)
    endpoint, options, latencies = url.rstrip("/") + "/translate", options or {}, []

    def fail(message: str) -> None:
        report.errors += 1
        if len(report.error_examples) < SHOWN:
            report.error_examples.append(message)

    async def one(session: aiohttp.ClientSession, idx: int) -> Optional[float]:
        """Send line `idx`; returns the Retry-After delay (s) when refused with 429, else None."""
        report.sent += 1
        t0 = perf_counter()
        try:
            async with asyncio.timeout(timeout):
                async with session.post(endpoint, json={"text": lines[idx], **options}) as resp:
                    status, retry_after = resp.status, resp.headers.get("Retry-After")
                    body = await resp.json(content_type=None) if status == 200 else await resp.text()
        except TimeoutError:
            report.hung += 1
            return None
        except (aiohttp.ClientError, ValueError, OSError) as e:
            fail(f"line {idx + 1}: {type(e).__name__}: {e}")
            return None
        if status != 200:
            if status not in report.refused:
                fail(f"line {idx + 1}: HTTP {status}: {str(body)[:200]}")
                return None
            report.refused[status] += 1
            if status != 429:
                return None
            try:
                return max(0.0, float(retry_after))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return 1.0
        try:
            got = body["translations"][0]["text"]
        except (KeyError, IndexError, TypeError):
            fail(f"line {idx + 1}: malformed answer: {str(body)[:200]}")
            return None
        latencies.append((perf_counter() - t0) * 1000)
        report.answered += 1
        if expect is not None:
            report.checked += 1
            if got != expect[idx]:
                report.mismatches += 1
                if len(report.mismatch_examples) < SHOWN:
                    report.mismatch_examples.append({"line": idx + 1, "expected": expect[idx], "got": got})
        return None

    connector = aiohttp.TCPConnector(limit=0 if rate is not None else max(100, clients + 4))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        report.rss_before = await read_rss(session, url)
        start = perf_counter()
        deadline = None if duration is None else start + duration

        def more(k: int) -> bool:
            return k < len(lines) if deadline is None else perf_counter() < deadline

        if rate is None:
            counter = itertools.count()  # shared: each client takes the next line

            async def client() -> None:
                while more(k := next(counter)):
                    for _ in range(MAX_RETRIES + 1):
                        wait = await one(session, k % len(lines))
                        if wait is None or not retry_429:
                            break
                        await asyncio.sleep(wait)
                        if deadline is not None and perf_counter() >= deadline:
                            break

            await asyncio.gather(*(client() for _ in range(clients)))
        else:
            tasks = set()
            for k in itertools.count():
                due = start + k / rate
                if (deadline is None and k >= len(lines)) or (deadline is not None and due >= deadline):
                    break
                if due > perf_counter():
                    await asyncio.sleep(due - perf_counter())
                task = asyncio.create_task(one(session, k % len(lines)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        report.wall_s = perf_counter() - start
        report.rss_after = await read_rss(session, url)
    report.throughput = report.answered / report.wall_s if report.wall_s > 0 else 0.0
    report.latency_p50_ms, report.latency_p95_ms, report.latency_p99_ms = (
        percentile(latencies, q) for q in (50, 95, 99))
    return report


def positive(kind: type) -> Any:
    """An argparse type: `kind` values above 0."""
    def parse(value: str) -> Any:
        v = kind(value)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {value}")
        return v
    return parse


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fairseq_streambeam.bench.load", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--input", required=True, type=Path, help="source sentences, one per line")
    p.add_argument("--expect", type=Path, help="offline output, one line per input line, to compare with")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--clients", type=positive(int), help="closed loop: concurrent clients (default 1)")
    mode.add_argument("--rate", type=positive(float), help="open loop: requests started per second")
    p.add_argument("--duration", type=positive(float),
                   help="stop starting requests after S s (default: each line once)")
    p.add_argument("--limit", type=positive(int), help="use the first N lines only")
    p.add_argument("--timeout", type=positive(float), default=60.0, help="per request, s; longer counts as hung")
    p.add_argument("--retry-429", action="store_true", help="closed loop: retry a refused line after Retry-After")
    p.add_argument("--json", type=Path, help="write the report as JSON")
    for name, kind in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, help="passed to the server with each request")
    args = p.parse_args(argv)
    if args.retry_429 and args.rate is not None:
        p.error("--retry-429 is for closed loop (--clients) only")
    lines = read_lines(args.input)[: args.limit]
    expect = read_lines(args.expect)[: args.limit] if args.expect else None
    if not lines or (expect is not None and len(expect) < len(lines)):
        p.error("empty --input" if not lines else f"--expect has {len(expect or [])} lines for {len(lines)} inputs")
    options = {k: getattr(args, k) for k in OPTIONS if getattr(args, k) is not None}
    report = asyncio.run(run_load(args.url, lines, expect, clients=args.clients, rate=args.rate,
                                  duration=args.duration, timeout=args.timeout, options=options,
                                  retry_429=args.retry_429))
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps({**asdict(report), "exit_code": report.exit_code}, indent=1) + "\n")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
