"""The load generator (fairseq_streambeam.bench.load) against a fake translation server: an aiohttp app
in a background thread that "translates" by upper-casing, refuses every k-th request with 429, answers
400/413/503 for marked lines, hangs on "hang" and serves /metrics."""

import asyncio
import json
import threading
from collections import Counter

import pytest
from aiohttp import web

from fairseq_streambeam.bench.load import LoadReport, main, percentile, read_lines, run_load

CONFIG = web.AppKey("config", dict)
LINES = [f"sentence number {i}" for i in range(12)]
UPPER = [s.upper() for s in LINES]


def _defaults() -> dict:
    return {"delay": 0.01, "every_429": 0, "hang_s": 3.0, "metrics": True, "count": 0,
            "seen": [], "payloads": [], "in_flight": 0, "max_in_flight": 0}


async def _translate(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    payload = await request.json()
    cfg["count"] += 1
    cfg["payloads"].append(payload)
    text = payload.get("text")
    if not isinstance(text, (str, list)) or text == "":
        return web.json_response({"error": "empty text"}, status=400)
    if cfg["every_429"] and cfg["count"] % cfg["every_429"] == 0:
        return web.json_response({"error": "queue full"}, status=429, headers={"Retry-After": "0"})
    if text == "bye":
        return web.json_response({"error": "shutting down"}, status=503)
    if text == "oops":
        return web.json_response({"error": "internal"}, status=500)
    if len(text) > 1000:
        return web.json_response({"error": "too large"}, status=413)
    cfg["seen"].append(text)
    cfg["in_flight"] += 1
    cfg["max_in_flight"] = max(cfg["max_in_flight"], cfg["in_flight"])
    try:
        await asyncio.sleep(cfg["hang_s"] if text == "hang" else cfg["delay"])
    finally:
        cfg["in_flight"] -= 1
    texts = [text] if isinstance(text, str) else text
    out = [{"text": t.upper(), "score": -1.0, "hypotheses": [{"text": t.upper(), "score": -1.0}]} for t in texts]
    return web.json_response({"translations": out})


async def _metrics(request: web.Request) -> web.Response:
    if not request.app[CONFIG]["metrics"]:
        raise web.HTTPNotFound()
    body = "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 1.5e+08\nrequests_total 3\n"
    return web.Response(text=body, content_type="text/plain")


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@pytest.fixture(scope="module")
def fake_server():
    """(base url, config dict) of a fake server running in its own thread and event loop."""
    app = web.Application()
    app[CONFIG] = _defaults()
    app.router.add_post("/translate", _translate)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
    started = threading.Event()
    port = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port.append(runner.addresses[0][1])
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port[0]}", app[CONFIG]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def server(fake_server):
    url, cfg = fake_server
    cfg.clear()
    cfg.update(_defaults())
    return url, cfg


def _accounted(r: LoadReport) -> None:
    assert r.sent == r.answered + sum(r.refused.values()) + r.errors + r.hung


def test_closed_loop_clean(server):
    url, cfg = server
    r = asyncio.run(run_load(url, LINES, expect=UPPER, clients=4, options={"beam": 3}))
    _accounted(r)
    assert (r.sent, r.answered, r.errors, r.hung, r.mismatches, r.checked) == (12, 12, 0, 0, 0, 12)
    assert r.refused == {400: 0, 413: 0, 429: 0, 503: 0}
    assert Counter(cfg["seen"]) == Counter(LINES)  # each line exactly once
    assert all(p["beam"] == 3 and set(p) == {"text", "beam"} for p in cfg["payloads"])
    assert 0 < r.latency_p50_ms <= r.latency_p95_ms <= r.latency_p99_ms
    assert r.latency_p50_ms >= 10  # the server sleeps 10 ms
    assert r.throughput == pytest.approx(r.answered / r.wall_s)
    assert r.rss_before == r.rss_after == 1.5e8
    assert r.exit_code == 0


def test_single_client_sends_in_order_and_cycles(server):
    url, cfg = server
    r = asyncio.run(run_load(url, LINES[:3], clients=1, duration=0.25))
    assert r.sent == r.answered > 3
    assert cfg["seen"] == [LINES[i % 3] for i in range(r.sent)]
    assert r.checked == 0 and r.exit_code == 0


def test_mismatch_detected(server):
    url, _ = server
    expect = list(UPPER)
    expect[5] = "SOMETHING ELSE"
    r = asyncio.run(run_load(url, LINES, expect=expect, clients=3))
    assert (r.checked, r.mismatches) == (12, 1)
    assert r.mismatch_examples == [{"line": 6, "expected": "SOMETHING ELSE", "got": UPPER[5]}]
    assert r.exit_code == 1


def test_429_counted_and_retried(server):
    url, cfg = server
    cfg["every_429"] = 3
    r = asyncio.run(run_load(url, LINES, clients=2))
    _accounted(r)
    assert r.sent == 12 and r.refused[429] == 4 and r.answered == 8 and r.exit_code == 0
    cfg["count"], cfg["seen"] = 0, []
    r = asyncio.run(run_load(url, LINES, clients=2, retry_429=True))
    _accounted(r)
    assert r.answered == 12 and r.refused[429] > 0 and r.sent == 12 + r.refused[429]
    assert Counter(cfg["seen"]) == Counter(LINES)


def test_refusals_by_code_and_errors(server):
    url, _ = server
    lines = ["", "x" * 2000, "bye", "fine", "oops"]
    r = asyncio.run(run_load(url, lines, clients=2))
    _accounted(r)
    assert r.refused == {400: 1, 413: 1, 429: 0, 503: 1}
    assert r.answered == 1 and r.errors == 1 and "HTTP 500" in r.error_examples[0]
    assert r.exit_code == 1
    r = asyncio.run(run_load(url, lines[:4], clients=2))
    assert r.exit_code == 0  # refused cleanly


def test_open_loop_rate(server):
    url, cfg = server
    cfg["delay"] = 0.15
    cfg["every_429"] = 5
    r = asyncio.run(run_load(url, LINES, rate=50, duration=0.4))
    _accounted(r)
    assert r.mode == "open" and r.sent == 20  # 50/s for 0.4 s, never retried
    assert r.refused[429] == 4 and r.answered == 16
    assert cfg["max_in_flight"] > 3  # requests start whatever is in flight
    assert 0.4 <= r.wall_s < 1.5
    assert cfg["seen"][:3] == LINES[:3]


def test_open_loop_each_line_once(server):
    url, cfg = server
    r = asyncio.run(run_load(url, LINES, rate=200))
    assert r.sent == r.answered == 12 and Counter(cfg["seen"]) == Counter(LINES)


def test_timeout_is_hung(server, tmp_path):
    url, _ = server
    r = asyncio.run(run_load(url, ["a", "hang", "b"], clients=3, timeout=0.3))
    _accounted(r)
    assert (r.hung, r.answered, r.errors) == (1, 2, 0) and r.exit_code == 1
    src = tmp_path / "in.txt"
    src.write_text("a\nhang\n")
    assert main(["--url", url, "--input", str(src), "--timeout", "0.3"]) == 1


def test_connection_error_and_no_metrics(server):
    url, cfg = server
    cfg["metrics"] = False
    r = asyncio.run(run_load(url, LINES[:2]))
    assert r.rss_before is None and r.rss_after is None and r.exit_code == 0
    r = asyncio.run(run_load("http://127.0.0.1:9", LINES[:3], clients=2, timeout=2))
    _accounted(r)
    assert r.errors == 3 and r.answered == 0 and r.exit_code == 1


def test_main_clean_writes_json(server, tmp_path, capsys):
    url, cfg = server
    src, ref, out = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "report.json"
    src.write_text("\n".join(LINES) + "\n")
    ref.write_text("\n".join(UPPER) + "\n")
    rc = main(["--url", url, "--input", str(src), "--expect", str(ref), "--clients", "3", "--limit", "8",
               "--lenpen", "0.6", "--max-len-b", "20", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["sent"] == report["answered"] == report["checked"] == 8
    assert report["mismatches"] == 0 and report["exit_code"] == 0 and report["mode"] == "closed"
    assert report["refused"] == {"400": 0, "413": 0, "429": 0, "503": 0}
    assert report["latency_p99_ms"] >= report["latency_p50_ms"] > 0
    assert report["rss_before"] == 1.5e8
    assert all(p == {"text": p["text"], "lenpen": 0.6, "max_len_b": 20} for p in cfg["payloads"])
    assert "answered 8" in capsys.readouterr().out


def test_main_refuses_bad_combinations(server, tmp_path):
    url, _ = server
    src = tmp_path / "src.txt"
    src.write_text("a\n")
    for extra in (["--clients", "2", "--rate", "5"], ["--rate", "5", "--retry-429"], ["--clients", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["--url", url, "--input", str(src), *extra])
        assert e.value.code == 2
    with pytest.raises(ValueError):
        asyncio.run(run_load(url, ["a"], clients=2, rate=5))


def test_helpers(tmp_path):
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    f = tmp_path / "f.txt"
    f.write_text("a\n\nb\n")
    assert read_lines(f) == ["a", "", "b"]
    f.write_text("a\nb")
    assert read_lines(f) == ["a", "b"]
