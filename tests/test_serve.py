"""The translation server (serve.py), run as `streambeam-serve` on a free port and driven over HTTP:
answers equal offline decoding (decode_corpus's decoder, same options) for concurrent clients and
per-request options; every bad input is refused with its status and one line, and the server keeps
serving; a client that goes away frees its place; SIGTERM answers every accepted request, then exits."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from typing import List, Optional

import pytest
from helpers import BIN, run_cli, shared_path

aiohttp = pytest.importorskip("aiohttp")

LINES = 24


def _model_args() -> List[str]:
    m = shared_path("models", "deen-tiny")
    return ["--data", str(m / "data-bin"), "--path", str(m / "checkpoint_best.pt"), "-s", "de", "-t", "en",
            "--bpe", "sentencepiece", "--sentencepiece-model", str(m / "spm8k.model"), "--beam", "4"]


def _sources() -> List[str]:
    path = shared_path("data", "wmt", "de-en", "newstest2017.de")
    return path.read_text(encoding="utf-8").splitlines()[:LINES]


class Served:
    def __init__(self, *extra: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([str(BIN / "streambeam-serve"), *_model_args(), "--port", "0", "--device", "cpu",
                                      *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out: List[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited: " + self.proc.stderr.read()[-3000:])
            self.out.append(line)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                return
        raise RuntimeError("server did not start")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.out += self.proc.stdout.read().splitlines(keepends=True)
        return rc


@pytest.fixture(scope="module")
def server():
    s = Served("--batch-size", "4", "--max-queue", "10", "--max-sentences-per-request", "12", "--max-beam", "4",
               "--max-lanes", "2", "--max-request-bytes", "8192", "--max-tokens-per-sentence", "100")
    yield s
    assert s.stop() == 0
    # the last line counts the sentences of every lane (the requests with options of their own too)
    m = re.search(r"stopped after \d+ requests, (\d+) sentences; all lanes: (\d+) sentences", "".join(s.out))
    assert m and int(m.group(2)) >= int(m.group(1)), s.out[-3:]


@pytest.fixture(scope="module")
def offline():
    """decode_corpus's decoder over the same sources: {beam 4 best, beam 2 2-best lines}."""
    from fairseq_streambeam.decode_corpus import ShardDecoder, parse_args

    class Bar:
        def update(self, n):
            pass

    raw = [s.encode() for s in _sources()]
    base = ["--input", __file__, "--output-dir", "unused", *_model_args(), "--cpu"]
    best = ShardDecoder(parse_args(base)).decode(raw, Bar())[0]
    two = ShardDecoder(parse_args(base + ["--beam", "2", "--nbest", "2"])).decode(raw, Bar())[0]
    return best, [line.split("\t") for line in two]


async def _post(session, url: str, body, retry_429: bool = True):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    while True:
        async with session.post(url + "/translate", data=data) as r:
            payload = await r.json()
            if r.status == 429 and retry_429:
                assert r.headers["Retry-After"] == "1"
                await asyncio.sleep(0.05)
                continue
            return r.status, payload


def _run(coro):
    return asyncio.run(coro)


def test_concurrent_clients_get_offline_output(server, offline):
    """8 clients, one sentence per request (refusals are retried): every answer equals offline
    decoding."""
    sources, best = _sources(), offline[0]

    async def go():
        async with aiohttp.ClientSession() as s:
            todo = list(range(LINES))
            got = {}

            async def client():
                while todo:
                    i = todo.pop(0)
                    status, payload = await _post(s, server.url, {"text": sources[i]})
                    assert status == 200, payload
                    got[i] = payload["translations"][0]["text"]

            await asyncio.gather(*[client() for _ in range(8)])
            return got

    got = _run(go())
    assert [got[i] for i in range(LINES)] == best


def test_request_options_and_lists(server, offline):
    """A list of sentences in one request, with its own beam and nbest (a second lane), equals
    offline decoding with those options; the server's own options still hold beside it."""
    sources, two = _sources(), offline[1]

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(
                _post(s, server.url, {"text": sources[:5], "beam": 2, "nbest": 2}),
                _post(s, server.url, {"text": sources[5:8]}))

    (st1, p1), (st2, p2) = _run(go())
    assert st1 == st2 == 200
    assert [[h["text"] for h in t["hypotheses"]] for t in p1["translations"]] == two[:5]
    assert all(t["text"] == t["hypotheses"][0]["text"] and t["score"] == t["hypotheses"][0]["score"]
               for t in p1["translations"])
    assert any(len(t["hypotheses"]) == 2 for t in p1["translations"])
    assert [t["text"] for t in p2["translations"]] == offline[0][5:8]


def test_scores_that_are_not_finite_are_null(server):
    """An extreme lenpen overflows the score: the answer is still JSON (null, not -Infinity)."""
    async def go():
        async with aiohttp.ClientSession() as s:
            return await _post(s, server.url, {"text": "Hallo", "lenpen": -100.0})

    status, body = _run(go())
    assert status == 200
    t = body["translations"][0]
    assert t["text"] and t["score"] is None and all(h["score"] is None for h in t["hypotheses"])


def test_alignments_equal_offline(server):
    """"alignment": "hard" answers fairseq's hard alignment of each hypothesis (the offline
    generator's, with --print-alignment hard) over the subword tokens it returns; "soft" a row per
    target token and EOS over the source tokens and EOS."""
    from fairseq.data import LanguagePairDataset

    from fairseq_streambeam.decode_corpus import ShardDecoder, parse_args

    sources = _sources()[:6]
    sd = ShardDecoder(parse_args(["--input", __file__, "--output-dir", "unused", *_model_args(), "--cpu"]))
    sd.args.print_alignment = "hard"
    src = [sd.codec.encode(t) for t in sources]
    ds = LanguagePairDataset(src, [len(x) for x in src], sd.task.source_dictionary, tgt_dict=sd.task.target_dictionary)
    sample = ds.collater([ds[i] for i in range(len(src))])
    hypos = sd.task.inference_step(sd.task.build_generator(sd.models, sd.args), sd.models, sample)
    ref = {sid: hypos[i][0] for i, sid in enumerate(sample["id"].tolist())}

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(_post(s, server.url, {"text": sources, "alignment": "hard"}),
                                        _post(s, server.url, {"text": sources[0], "alignment": "soft"}))

    (st, hard), (st2, soft) = _run(go())
    assert st == st2 == 200, (hard, soft)
    for i, t in enumerate(hard["translations"]):
        h = t["hypotheses"][0]
        assert h["tokens"] == [sd.codec.tgt_dict[x] for x in ref[i]["tokens"][:-1].tolist()]
        assert t["source_tokens"] == [sd.codec.src_dict[x] for x in src[i][:-1].tolist()]
        assert h["alignment"] == [list(p) for p in ref[i]["alignment"]], i
    assert all(0 <= a < len(t["source_tokens"]) and 0 <= b < len(t["hypotheses"][0]["tokens"])
               for t in hard["translations"] for a, b in t["hypotheses"][0]["alignment"])
    sh = soft["translations"][0]
    rows = sh["hypotheses"][0]["alignment"]
    assert len(rows) == len(sh["hypotheses"][0]["tokens"]) + 1
    assert all(len(r) == len(sh["source_tokens"]) + 1 and abs(sum(r) - 1) < 1e-3 for r in rows)


@pytest.mark.parametrize("body,status,message", [
    (b"{not json", 400, "invalid JSON"),
    (b'{"text": "\xff\xfe"}', 400, "not UTF-8"),
    ({"text": "  "}, 400, "sentence 1 is empty"),
    ({"text": []}, 400, "non-empty"),
    ({"text": ["ok", 3]}, 400, "non-empty"),
    ([1, 2], 400, 'JSON object with "text"'),
    ({"text": "Hallo", "beems": 3}, 400, "unknown option 'beems'"),
    ({"text": "Hallo", "beam": 5}, 400, "above the server's limit 4"),
    ({"text": "Hallo", "beam": 2.5}, 400, '"beam" must be an integer'),
    ({"text": "Hallo", "beam": float("inf")}, 400, '"beam" must be an integer'),  # JSON's Infinity
    ({"text": "Hallo", "lenpen": float("nan")}, 400, '"lenpen" must be a finite number'),  # JSON's NaN
    ({"text": "Hallo", "beam": 10 ** 400}, 400, "above the server's limit 4"),
    ({"text": "Hallo", "nbest": 3, "beam": 2}, 400, '"nbest"'),
    ({"text": "Hallo", "alignment": True}, 400, '"alignment" must be one of'),
    ({"text": ["Hallo"] * 13}, 413, "13 sentences in one request; the limit is 12"),
    ({"text": "Hallo " * 1500}, 413, "request body over 8192 bytes"),
    (b'{"text": "Hallo", "beam": ' + b"1" * 4400 + b"}", 400, "invalid JSON: Exceeds the limit"),  # valid JSON
    (b'{"text": "Hallo \\ud800"}', 400, "sentence 1 is not valid Unicode"),
    (b'{"text": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400, "invalid JSON: nested too deeply"),
    ({"text": "Hallo " * 150}, 413, "tokens; the limit is 100"),
    ({"text": ["Hallo"] * 11}, 429, "queue full"),
    ({"text": "Hallo", "max_len_a": 0.1, "max_len_b": 0}, 400, "sentence 1: --min-len 1 exceeds"),
])
def test_bad_requests_are_refused_in_one_line(server, body, status, message):
    async def go():
        async with aiohttp.ClientSession() as s:
            refused = await _post(s, server.url, body, retry_429=False)
            after = await _post(s, server.url, {"text": "Guten Morgen."})
            return refused, after

    (st, payload), (st2, _) = _run(go())
    assert st == status and message in payload["error"] and "\n" not in payload["error"], payload
    assert st2 == 200  # and the server goes on serving


def test_unknown_paths_and_methods_are_json_errors(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/nope") as a, s.get(server.url + "/translate") as b:
                return (a.status, await a.json()), (b.status, await b.json(), b.headers.get("Allow"))

    (st, payload), (st2, payload2, allow) = _run(go())
    assert st == 404 and payload == {"error": "GET /nope: not found"}
    assert st2 == 405 and payload2 == {"error": "GET /translate: method not allowed"} and allow == "POST"


def test_a_client_that_goes_away_frees_its_place(server):
    """A request whose client disconnects as soon as the server has taken it: its sentences that
    wait (8 against a live budget of 4) never enter decoding, the in-flight count goes back to 0 and
    the server answers the next request. (Waiting a fixed time instead lets a fast server decode
    all 8 before the client goes.)"""
    body = json.dumps({"text": _sources()[:8]}).encode()
    host, port = server.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        for _ in range(1000):
            with urllib.request.urlopen(server.url + "/metrics") as r:
                if not re.search(r"^streambeam_inflight_sentences 0$", r.read().decode(), re.M):
                    break
            time.sleep(0.002)

    async def go():
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                async with s.get(server.url + "/metrics") as r:
                    text = await r.text()
                if re.search(r"^streambeam_inflight_sentences 0$", text, re.M):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the disconnected request's sentences are still in flight:\n" + text)
            return await _post(s, server.url, {"text": "Guten Morgen."}), text

    (status, _), text = _run(go())
    assert status == 200
    assert int(re.search(r"^streambeam_dropped_sentences_total (\d+)$", text, re.M).group(1)) > 0
    assert "streambeam_request_latency_seconds_bucket" in text and "process_resident_memory_bytes" in text


def test_sigterm_answers_every_accepted_request(offline):
    """Static batching (a baseline mode) with SIGTERM while requests are in flight: each accepted
    request is answered with the offline output, later ones are refused or find no server, and the
    process exits 0."""
    srv = Served("--batching", "static", "--batch-wait-ms", "200", "--batch-size", "4")
    sources, best = _sources(), offline[0]

    async def go():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(_post(s, srv.url, {"text": sources[i]})) for i in range(10)]
            for _ in range(200):  # until every request is accepted
                async with s.get(srv.url + "/metrics") as r:
                    m = re.search(r"^streambeam_inflight_sentences (\d+)$", await r.text(), re.M)
                if m and int(m.group(1)) == 10:
                    break
                await asyncio.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            late: Optional[int]
            try:
                late = (await _post(s, srv.url, {"text": "Hallo"}, retry_429=False))[0]
            except aiohttp.ClientConnectionError:
                late = None
            return results, late

    try:
        results, late = _run(go())
        srv.proc.wait(timeout=60)  # the test's SIGTERM ends the server; stop() would send a second one
    finally:
        rc = srv.stop()
    assert [st for st, _ in results] == [200] * 10
    assert [p["translations"][0]["text"] for _, p in results] == best[:10]
    assert late in (503, None)
    assert rc == 0 and any("stopped after" in line for line in srv.out), srv.out


def test_a_failed_step_answers_its_requests_with_500():
    """A decoding step that raises: the lane's requests are answered 500 (none waits forever), the
    in-flight count returns to 0, and the server's own lane is open again for the next request."""
    from types import SimpleNamespace

    from fairseq_streambeam.runtime.counters import Counters
    from fairseq_streambeam.serve import DecodeLoop, Job, Refused

    class Failing:
        waiting, live_sources, live_candidates = 0, 0, 0

        def __init__(self):
            self.rows = 0
            self.gen = SimpleNamespace(counters=Counters(decoder_steps=3))

        @property
        def busy(self):
            return self.rows > 0

        def check(self, tokens):
            return None

        def add(self, tokens):
            self.rows += 1
            return self.rows

        def step(self):
            raise RuntimeError("CUDA error: out of memory\nmore lines")

    class Loop(DecodeLoop):
        def lane_for(self, spec):
            return self.lanes.setdefault(spec, Failing())

    async def go():
        loop = Loop(model=None, base_spec="spec")
        aio = asyncio.get_running_loop()
        job = Job([[4, 2], [5, 2]], "spec", aio.create_future(), aio)
        loop.lane_for("spec")
        loop.thread.start()
        loop.submit(job)
        with pytest.raises(Refused) as e:
            await asyncio.wait_for(job.done, 10)
        loop.stop()
        await aio.run_in_executor(None, loop.thread.join, 10)
        return e.value, loop

    err, loop = _run(go())
    assert err.status == 500 and str(err) == "decoding failed: RuntimeError: CUDA error: out of memory"
    assert loop.inflight == 0 and not loop.thread.is_alive()
    assert loop.lanes["spec"].rows == 0  # the server's own lane, open again and empty
    assert loop.counters().decoder_steps == 6  # the failed lane's counts are kept


def test_a_servers_finish_count_is_capped_by_a_smaller_request_beam():
    """A server started with calibrate's --finish-count 5 and --max-beam 8: a request for beam 3
    decodes as offline --beam 3 --finish-count 3, where it was refused (finish count above beam)."""
    from types import SimpleNamespace

    from fairseq_streambeam.serve import Server
    from fairseq_streambeam.spec import DecodeSpec

    base = DecodeSpec(decoding="var-stream", beam_size=5, finish_count=5)
    fake = SimpleNamespace(loop=SimpleNamespace(base_spec=base), args=SimpleNamespace(max_beam=8))
    assert Server._spec(fake, {"text": "x", "beam": 3}).finish_count == 3
    assert Server._spec(fake, {"text": "x", "beam": 7}).finish_count == 5
    assert Server._spec(fake, {"text": "x", "lenpen": 0.5}).finish_count == 5


def test_an_address_it_cannot_listen_on_is_one_line_before_the_model_loads():
    """A port in use or an unknown --host: one line and status 2 (it was a traceback after loading)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        for extra, message in ((["--port", port], f"cannot listen on 127.0.0.1:{port}"),
                               (["--host", "no-such-host.invalid", "--port", "0"], "cannot listen on no-such-host")):
            r = run_cli([str(BIN / "streambeam-serve"), *_model_args(), "--device", "cpu", *extra], timeout=120)
            err = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(err) == 1 and message in err[0], r.stderr[-2000:]
            assert "Traceback" not in r.stderr and "streambeam-serve: --decoding" not in r.stdout


def test_ipv6_hosts_pass_the_listen_check():
    """The check before loading tries the host's own address family: ::1 is not refused."""
    import socket

    from fairseq_streambeam.serve import listen_problem

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    assert listen_problem("::1", 0) is None and listen_problem("127.0.0.1", 0) is None


def test_a_negative_batch_wait_is_one_line(capsys):
    """--batching static with --batch-wait-ms -5 started and served as if it were 0."""
    from fairseq_streambeam.serve import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args([*_model_args(), "--batching", "static", "--batch-wait-ms", "-5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == ["streambeam-serve: error: --batch-wait-ms must be >= 0, got -5"]
