"""An HTTP translation server whose running batch takes new sentences between decoder steps.

One decoding thread owns the model. It steps an online decoder (generators/online.py) and, whenever
the scheduler refills, admits the sentences that arrived meanwhile; each request is answered as soon
as its last sentence finishes. Every sentence gets exactly the output offline decoding gives it with
the same options. Requests with their own options (beam, nbest, lenpen, max_len_a, max_len_b) go to
a lane of their own (one online decoder per option set; lanes are stepped in turn).

  streambeam-serve --data DICT_DIR --path model.pt -s de -t en --bpe sentencepiece \\
      --sentencepiece-model spm.model --decoding var-stream --beam 5 --port 8000
  curl -s localhost:8000/translate -d '{"text": ["Guten Morgen.", "Wie geht es?"]}'

`--batching static` (collect requests for --batch-wait-ms, decode them as one batch, answer them
together) and `--batching single` (one request at a time, as fairseq-interactive) are the baselines
of docs/benchmarks.md. The HTTP side is aiohttp (docs/serve.md says why).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from . import malloc
from .frontend import (
    DefaultsHelp,
    add_generation_options,
    add_model_options,
    add_task_options,
    check_model_options,
    fairseq_log_level,
    load_model,
)
from .runtime.counters import Counters
from .spec import DECODINGS, OneLineParser, UsageError, from_cli

logger = logging.getLogger("fairseq_streambeam.serve")

# per-request options: JSON name -> (DecodeSpec field, type)
REQUEST_OPTIONS = {"beam": ("beam_size", int), "nbest": ("nbest", int), "lenpen": ("len_penalty", float),
                   "max_len_a": ("max_len_a", float), "max_len_b": ("max_len_b", int),
                   "alignment": ("print_alignment", str)}
ALIGNMENTS = ("hard", "soft")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Refused(Exception):
    """A request the server answers with an error status and a one-line message."""

    def __init__(self, status: int, message: str, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


@dataclasses.dataclass(eq=False)
class Job:
    """One request's sentences on their way through the decoding thread."""

    sources: List[List[int]]  # token ids with EOS
    spec: Any  # spec.DecodeSpec of its lane
    done: Any  # asyncio.Future, resolved on the event loop with `results`
    loop: asyncio.AbstractEventLoop
    results: List[Optional[list]] = dataclasses.field(default_factory=list)
    rows: List[int] = dataclasses.field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False
    submitted: float = 0.0  # time.monotonic() when the decoding thread took it


class Metrics:
    """What /metrics reports (Prometheus text format); written by both threads, as plain numbers."""

    def __init__(self) -> None:
        self.requests = 0
        self.refused: Dict[int, int] = {}
        self.sentences = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.started = time.monotonic()

    def observe(self, seconds: float) -> None:
        i = next((j for j, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        self.latency_counts[i] += 1
        self.latency_sum += seconds

    def text(self, loop: DecodeLoop) -> str:
        c = loop.counters()
        steps, secs = c.decoder_steps, max(time.monotonic() - self.started, 1e-9)
        lines = [
            "# TYPE streambeam_queue_sentences gauge", f"streambeam_queue_sentences {loop.waiting}",
            "# TYPE streambeam_inflight_sentences gauge", f"streambeam_inflight_sentences {loop.inflight}",
            "# TYPE streambeam_live_sources gauge", f"streambeam_live_sources {loop.live_sources}",
            "# TYPE streambeam_live_rows gauge", f"streambeam_live_rows {loop.live_rows}",
            "# TYPE streambeam_lanes gauge", f"streambeam_lanes {len(loop.lanes)}",
            "# TYPE streambeam_decoder_steps_total counter", f"streambeam_decoder_steps_total {steps}",
            "# TYPE streambeam_steps_per_second gauge", f"streambeam_steps_per_second {steps / secs:.3f}",
            "# TYPE streambeam_expansions_per_step gauge",
            f"streambeam_expansions_per_step {c.expansions_per_step:.3f}",
            "# TYPE streambeam_sentences_total counter", f"streambeam_sentences_total {self.sentences}",
            "# TYPE streambeam_requests_total counter", f"streambeam_requests_total {self.requests}",
            "# TYPE streambeam_dropped_sentences_total counter", f"streambeam_dropped_sentences_total {loop.dropped}",
            "# TYPE streambeam_refused_requests_total counter",
            *[f'streambeam_refused_requests_total{{code="{k}"}} {v}' for k, v in sorted(self.refused.items())],
            "# TYPE streambeam_request_latency_seconds histogram",
        ]
        total = 0
        for b, n in zip([*LATENCY_BUCKETS, "+Inf"], self.latency_counts):
            total += n
            lines.append(f'streambeam_request_latency_seconds_bucket{{le="{b}"}} {total}')
        lines += [f"streambeam_request_latency_seconds_sum {self.latency_sum:.6f}",
                  f"streambeam_request_latency_seconds_count {total}",
                  "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {_rss_bytes()}"]
        return "\n".join(lines) + "\n"


class DecodeLoop:
    """The decoding thread: lanes of online decoders, fed from an inbox of jobs (see module doc)."""

    def __init__(self, model, base_spec, batching: str = "continuous", batch_wait: float = 0.02,
                 max_lanes: int = 4):
        self.model, self.base_spec = model, base_spec
        self.batching, self.batch_wait, self.max_lanes = batching, batch_wait, max_lanes
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lanes: Dict[Any, Any] = {}  # spec -> OnlineDecoder
        self.owner: Dict[Tuple[Any, int], Tuple[Job, int]] = {}  # (spec, row) -> (job, sentence index)
        self.held: List[Job] = []  # static/single: jobs waiting for the next batch
        self.finished: List[Job] = []  # static/single: answered together when the batch ends
        self.inflight = 0  # sentences accepted and not yet answered
        self.dropped = 0  # sentences whose client went away before they entered decoding
        self._lock = threading.Lock()  # inflight and the closed lanes' counts change in both threads
        self.stopping = False
        self._retired = Counters()  # counters of lanes that were closed
        self.thread = threading.Thread(target=self._run, name="streambeam-decode", daemon=True)

    # ---- called from the event loop ---------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self._count(len(job.sources))
        self.inbox.put(("job", job))

    def _count(self, n: int) -> None:
        with self._lock:
            self.inflight += n

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def stop(self) -> None:
        self.inbox.put(("stop", None))

    @property
    def waiting(self) -> int:
        return sum(d.waiting for d in list(self.lanes.values())) + sum(len(j.sources) for j in list(self.held))

    @property
    def live_sources(self) -> int:
        return sum(d.live_sources for d in list(self.lanes.values()))

    @property
    def live_rows(self) -> int:
        return sum(d.live_candidates for d in list(self.lanes.values()))

    def counters(self) -> Counters:
        """The counts of every lane, open or closed."""
        with self._lock:
            total = Counters().add(self._retired)
            for d in list(self.lanes.values()):
                total.add(d.gen.counters)
        return total

    def lane_for(self, spec) -> Optional[Any]:
        """The lane of `spec`, opened if there is room (None: too many option sets in flight);
        lanes are opened and closed in the decoding thread only (and the first before it starts)."""
        if spec in self.lanes:
            return self.lanes[spec]
        if len(self.lanes) >= self.max_lanes:
            return None
        from .generators.online import OnlineDecoder

        gen = self.model.task.generator_for(self.model.models, spec, report_at_exit=False)
        self.lanes[spec] = OnlineDecoder(gen)
        return self.lanes[spec]

    # ---- the decoding thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            busy = any(d.busy for d in list(self.lanes.values()))
            if not self._take_inbox(block=not busy and not (self.held and self.batching == "single")):
                return
            if not busy:
                self._release_held()
            for spec, dec in list(self.lanes.items()):
                if dec.busy:
                    try:
                        done = dec.step()
                    except Exception as e:  # noqa: BLE001 (a failed step must not leave requests waiting)
                        self._fail_lane(spec, e)
                        continue
                    self._deliver(spec, done)
            if not any(d.busy for d in self.lanes.values()):
                if self.finished:  # static/single: the batch is over
                    for job in self.finished:
                        self._answer(job)
                    self.finished = []
                self._close_idle_lanes()

    def _take_inbox(self, block: bool) -> bool:
        """Move new jobs and cancellations in; False once stopped with nothing left to do."""
        timeout = None
        if self.held and self.batching == "static":
            timeout = max(0.0, self.batch_wait - (time.monotonic() - self.held[0].submitted))
        while True:
            try:
                if block:
                    kind, job = self.inbox.get(timeout=timeout)
                else:
                    kind, job = self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                self.stopping = True
            elif kind == "cancel":
                self._cancel(job)
            elif self.batching == "continuous":
                self._admit(job)
            else:
                job.submitted = time.monotonic()
                self.held.append(job)
            if self.stopping and not self.inflight and not self.held:
                return False

    def _release_held(self) -> None:
        """static: once the oldest held job waited --batch-wait-ms, all held jobs form the batch;
        single: the next job alone."""
        if not self.held:
            return
        if self.batching == "single":
            self._admit(self.held.pop(0))
        elif time.monotonic() - self.held[0].submitted >= self.batch_wait or self.stopping:
            for job in self.held:
                self._admit(job)
            self.held = []

    def _admit(self, job: Job) -> None:
        """The job's sentences join its lane's queue; a job that cannot is refused, never lost."""
        try:
            self._enter(job)
        except Exception as e:  # noqa: BLE001 (the decoding thread must survive any one job)
            logger.exception("admitting a request failed")
            dec = self.lanes.get(job.spec)
            for row in dec.drop(job.rows) if dec is not None else []:
                self.owner.pop((job.spec, row), None)
            self._refuse(job, Refused(500, f"admitting the request failed: {type(e).__name__}"))

    def _enter(self, job: Job) -> None:
        try:
            dec = self.lane_for(job.spec)
        except (UsageError, ValueError) as e:
            return self._refuse(job, Refused(400, str(e)))
        if dec is None:
            return self._refuse(job, Refused(429, f"{self.max_lanes} option sets are in flight; retry, or use "
                                                  "the server's own options", retry_after=1))
        for i, src in enumerate(job.sources):  # e.g. --min-len above a short source's length limit
            why = dec.check(src)
            if why:
                return self._refuse(job, Refused(400, f"sentence {i + 1}: {why}"))
        job.results = [None] * len(job.sources)
        job.remaining = len(job.sources)
        for i, src in enumerate(job.sources):
            row = dec.add(src)
            job.rows.append(row)
            self.owner[(job.spec, row)] = (job, i)

    def _cancel(self, job: Job) -> None:
        """A client went away: its sentences that have not entered decoding leave the queue; those
        already decoding finish, and nobody is answered."""
        job.cancelled = True
        if job in self.held:
            self.held.remove(job)
            self._count(-len(job.sources))
            self.dropped += len(job.sources)
            return
        dec = self.lanes.get(job.spec)
        if dec is None:
            return
        for row in dec.drop(job.rows):
            self.owner.pop((job.spec, row), None)
            job.remaining -= 1
            self._count(-1)
            self.dropped += 1

    def _deliver(self, spec, done: Dict[int, list]) -> None:
        for row, hypos in done.items():
            job, i = self.owner.pop((spec, row))
            job.results[i] = [{"tokens": h["tokens"].tolist(), "score": _json_number(float(h["score"])),
                               "alignment": _listed(h["alignment"]) if spec.print_alignment else None}
                              for h in hypos[:spec.nbest]]
            job.remaining -= 1
            self._count(-1)
            if job.remaining == 0 and not job.cancelled:
                if self.batching == "continuous":
                    self._answer(job)
                else:
                    self.finished.append(job)

    def _answer(self, job: Job) -> None:
        def resolve() -> None:
            if not job.done.done():
                job.done.set_result(job.results)

        job.loop.call_soon_threadsafe(resolve)

    def _refuse(self, job: Job, why: Refused) -> None:
        self._count(-len(job.sources))

        def resolve() -> None:
            if not job.done.done():
                job.done.set_exception(why)

        job.loop.call_soon_threadsafe(resolve)

    def _fail_lane(self, spec, error: Exception) -> None:
        """A decoding step raised: every request in that lane is answered 500 and the lane is
        closed (its cohorts may be half-updated); the server's own lane reopens empty."""
        logger.exception("decoding failed; answering its lane's requests with 500")
        first = str(error).splitlines()[0] if str(error) else ""
        why = Refused(500, f"decoding failed: {type(error).__name__}: {first}")
        jobs = {id(job): job for (lane, _), (job, _) in self.owner.items() if lane == spec}
        self.owner = {k: v for k, v in self.owner.items() if k[0] != spec}
        for job in jobs.values():
            job.cancelled = True
            self._count(len(job.sources) - job.remaining)  # _refuse takes the whole job off the count
            self._refuse(job, why)
        self._retire(spec)
        if spec == self.base_spec:
            self.lane_for(spec)

    def _close_idle_lanes(self) -> None:
        for spec in [s for s, d in self.lanes.items() if not d.busy and s != self.base_spec]:
            self._retire(spec)

    def _retire(self, spec) -> None:
        """Close lane `spec`, keeping its counts (/metrics reads every lane's under the lock)."""
        with self._lock:
            self._retired.add(self.lanes.pop(spec).gen.counters)


def _json_number(x: float) -> Optional[float]:
    """`x`, or None (JSON null) for an infinite or NaN score, which JSON cannot write."""
    return x if math.isfinite(x) else None


class Server:
    """The HTTP side: parses and checks requests, hands jobs to the decoding loop, answers."""

    def __init__(self, args: argparse.Namespace, model, loop: DecodeLoop):
        self.args, self.model, self.loop = args, model, loop
        self.metrics = Metrics()
        self.accepting = True
        self.max_src = min(m.max_positions()[0] for m in model.models)

    def app(self):
        from aiohttp import web

        @web.middleware
        async def json_errors(request, handler):
            """aiohttp's own refusals (an unknown path, a wrong method) as JSON, as the server's others."""
            try:
                return await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
                return web.json_response({"error": f"{request.method} {request.path}: {e.reason.lower()}"},
                                         status=e.status, headers=headers)

        app = web.Application(client_max_size=self.args.max_request_bytes, middlewares=[json_errors])
        app.router.add_post("/translate", self.translate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    async def health(self, request):
        from aiohttp import web

        status = "ok" if self.accepting else "stopping"
        return web.json_response({"status": status, "decoding": self.loop.base_spec.decoding,
                                  "live_sources": self.loop.live_sources, "inflight": self.loop.inflight},
                                 status=200 if self.accepting else 503)

    async def metrics_page(self, request):
        from aiohttp import web

        return web.Response(text=self.metrics.text(self.loop), content_type="text/plain")

    async def translate(self, request):
        from aiohttp import web

        t0 = time.perf_counter()
        self.metrics.requests += 1
        try:
            job = await self._job(request)
            self.loop.submit(job)
            try:
                results = await job.done
            except asyncio.CancelledError:  # the client disconnected
                self.loop.cancel(job)
                raise
        except Refused as e:
            self.metrics.refused[e.status] = self.metrics.refused.get(e.status, 0) + 1
            headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
            return web.json_response({"error": str(e)}, status=e.status, headers=headers)
        out = [self._translation(src, hypos, job.spec.print_alignment) for src, hypos in zip(job.sources, results)]
        self.metrics.sentences += len(out)
        self.metrics.observe(time.perf_counter() - t0)
        return web.json_response({"translations": out})

    def _translation(self, source: List[int], hypos: List[dict], kind: Optional[str]) -> dict:
        """One sentence's answer; with an alignment, the source and target subword tokens it indexes
        (EOS left out: hard pairs are 0-based over those tokens, as fairseq's A- lines; soft rows
        follow the target tokens and EOS, columns the source tokens and EOS)."""
        codec = self.model.codec
        hyps = []
        for h in hypos:
            hyp = {"text": codec.decode(h["tokens"]), "score": h["score"]}
            if kind:
                hyp["tokens"] = [codec.tgt_dict[t] for t in h["tokens"][:-1]]
                hyp["alignment"] = h["alignment"]
            hyps.append(hyp)
        out = {"text": hyps[0]["text"], "score": hyps[0]["score"], "hypotheses": hyps}
        if kind:
            out["source_tokens"] = [codec.src_dict[t] for t in source[:-1]]
        return out

    async def _job(self, request) -> Job:
        """The request as a job, or Refused with its status and one line."""
        from aiohttp import web

        if not self.accepting:
            raise Refused(503, "the server is shutting down")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Refused(413, f"request body over {self.args.max_request_bytes} bytes") from None
        try:
            data = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise Refused(400, "request body is not UTF-8") from None
        except json.JSONDecodeError as e:
            raise Refused(400, f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except ValueError as e:  # valid JSON that Python refuses, e.g. an integer of over 4300 digits
            raise Refused(400, f"invalid JSON: {str(e).splitlines()[0]}") from None
        except RecursionError:
            raise Refused(400, "invalid JSON: nested too deeply") from None
        if not isinstance(data, dict) or "text" not in data:
            raise Refused(400, 'expected a JSON object with "text": a string or a list of strings')
        unknown = sorted(set(data) - {"text", *REQUEST_OPTIONS})
        if unknown:
            raise Refused(400, f"unknown option {', '.join(map(repr, unknown))}; "
                               f"known: text, {', '.join(REQUEST_OPTIONS)}")
        text = data["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise Refused(400, '"text" must be a non-empty string or a non-empty list of strings')
        if len(texts) > self.args.max_sentences_per_request:
            raise Refused(413, f"{len(texts)} sentences in one request; the limit is "
                               f"{self.args.max_sentences_per_request}")
        spec = self._spec(data)
        limit = min(self.args.max_tokens_per_sentence or self.max_src, self.max_src)
        sources = []
        for i, t in enumerate(texts):
            if not t.strip():
                raise Refused(400, f"sentence {i + 1} is empty")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:  # JSON's escapes can spell a lone surrogate, which is no character
                raise Refused(400, f"sentence {i + 1} is not valid Unicode (a lone surrogate)") from None
            ids = self.model.codec.encode(t).tolist()
            if len(ids) > limit:
                raise Refused(413, f"sentence {i + 1} has {len(ids)} tokens; the limit is {limit}")
            sources.append(ids)
        if self.loop.inflight + len(sources) > self.args.max_queue:
            raise Refused(429, f"queue full ({self.loop.inflight} sentences in flight)", retry_after=1)
        aio = asyncio.get_running_loop()
        return Job(sources, spec, aio.create_future(), aio)

    def _spec(self, data: dict):
        """The request's decoding spec: the server's, with the request's options (checked)."""
        given = {k: v for k, v in data.items() if k in REQUEST_OPTIONS}
        changes = {}
        for name, value in given.items():
            field, kind = REQUEST_OPTIONS[name]
            if kind is str:
                if value not in ALIGNMENTS:
                    raise Refused(400, f'"{name}" must be one of {", ".join(map(repr, ALIGNMENTS))}, got {value!r}')
                changes[field] = value
                continue
            # JSON's NaN and Infinity parse as floats: refused here, not turned into NaN scores or overflows
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or (isinstance(value, float) and not math.isfinite(value))
                    or (kind is int and value != int(value))):
                raise Refused(400, f'"{name}" must be {"an integer" if kind is int else "a finite number"}, '
                                   f'got {value!r}')
            changes[field] = kind(value)
        beam = changes.get("beam_size", self.loop.base_spec.beam_size)
        if beam > self.args.max_beam:
            raise Refused(400, f'"beam" {beam} is above the server\'s limit {self.args.max_beam} (--max-beam)')
        z = self.loop.base_spec.finish_count
        if z is not None and z > beam:  # the server's --finish-count (var-*), capped by a smaller request beam
            changes["finish_count"] = beam
        if not changes:
            return self.loop.base_spec
        try:
            return dataclasses.replace(self.loop.base_spec, **changes)
        except UsageError as e:
            message = str(e)
            for name in REQUEST_OPTIONS:  # the request's names, not the command line's
                flag = "--print-alignment" if name == "alignment" else f"--{name.replace('_', '-')}"
                message = message.replace(flag, f'"{name}"')
            raise Refused(400, message) from None


def _listed(alignment) -> list:
    """fairseq's alignment of one hypothesis as JSON lists: hard [source, target] index pairs, soft
    rows of probabilities (fairseq formats them as strings); a hypothesis without one gets []."""
    if not isinstance(alignment, list):  # EOS alone: no attention, fairseq leaves an empty tensor
        return []
    return [[int(i) for i in p] if isinstance(p, tuple) else [float(x) for x in p] for p in alignment]


def _rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before the model loads: a mistake is one line and exit status 2."""
    p = OneLineParser(prog="streambeam-serve", description=__doc__.split("\n\n")[0],
                      formatter_class=DefaultsHelp)
    add_model_options(p)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="sentences accepted and not yet answered; more are refused with 429")
    s.add_argument("--max-sentences-per-request", type=int, default=64)
    s.add_argument("--max-tokens-per-sentence", type=int, help="source tokens (default: the model's positions)")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20)
    s.add_argument("--max-beam", type=int, help="largest per-request beam (default: --beam)")
    s.add_argument("--max-lanes", type=int, default=4, help="option sets decoded at once")
    s.add_argument("--batching", default="continuous", choices=["continuous", "static", "single"],
                   help="static and single are baselines: a batch collected for --batch-wait-ms, or one request")
    s.add_argument("--batch-wait-ms", type=float, default=20.0, help="--batching static: how long a batch collects")
    add_generation_options(p.add_argument_group("fairseq-generate's generation options (the defaults of requests)"))
    add_task_options(p.add_argument_group("decoding options of --task streambeam_translation"),
                     auto={"stream_order": "continuous for var-stream and fixed-stream, else min-length"})
    args = p.parse_args(argv)
    if args.stream_order == "auto":
        # online, new sources keep arriving: under min-length, the newest (shortest) cohorts always
        # step first and older ones wait; continuous steps every live source in each decoder call
        kind = DECODINGS[args.decoding]
        args.stream_order = "continuous" if kind.streaming and kind.family == "beam" else "min-length"
    try:
        check_model_options(args, ("batch_size", "max_tokens", "threads", "max_queue", "max_sentences_per_request",
                                   "max_tokens_per_sentence", "max_request_bytes", "max_beam", "max_lanes"))
        spec = from_cli(args, args)
        if spec.lmbr_posteriors or spec.token_masks:
            raise UsageError("--lmbr-posteriors and --token-masks are keyed by test-set sentence ids: "
                             "a server takes neither")
        if args.max_beam is None:
            args.max_beam = spec.beam_size
        elif args.max_beam < spec.beam_size:
            raise UsageError(f"--max-beam {args.max_beam} is below --beam {spec.beam_size}")
        if not 0 <= args.port < 65536:
            raise UsageError(f"--port must be in 0..65535, got {args.port}")
        if not args.batch_wait_ms >= 0:
            raise UsageError(f"--batch-wait-ms must be >= 0, got {args.batch_wait_ms:g}")
    except UsageError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    return args


async def serve(args: argparse.Namespace, model, ready=None) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, answer every accepted request, exit.
    `ready(port)` is called once the socket listens."""
    from aiohttp import web

    spec = from_cli(args, args)
    model.task.limits = (args.batch_size, args.max_tokens)
    loop = DecodeLoop(model, spec, args.batching, args.batch_wait_ms / 1000, args.max_lanes)
    loop.lane_for(spec)
    loop.thread.start()
    server = Server(args, model, loop)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:  # taken since listen_problem looked
        await runner.cleanup()
        loop.stop()
        raise UsageError(listen_problem(args.host, args.port, e)) from None
    port = runner.addresses[0][1]
    beam = f" --beam {spec.beam_size}" if spec.beam > 1 else ""  # greedy, iad and gad: one hypothesis
    print(f"streambeam-serve: --decoding {spec.decoding}{beam} on http://{args.host}:{port} "
          f"({'cuda' if model.cuda else 'cpu'}, {args.batching} batching, budget {args.batch_size} sentences)",
          flush=True)
    if ready is not None:
        ready(port)
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.accepting = False  # new requests: 503; accepted ones are answered below
    print(f"streambeam-serve: stopping; answering {loop.inflight} accepted sentences", flush=True)
    while loop.inflight:
        await asyncio.sleep(0.02)
    await runner.cleanup()
    loop.stop()
    await aio.run_in_executor(None, loop.thread.join)
    print(f"streambeam-serve: stopped after {server.metrics.requests} requests, {server.metrics.sentences} "
          f"sentences; all lanes: {loop.counters().summary()}", flush=True)


def listen_problem(host: str, port: int, error: Optional[OSError] = None) -> Optional[str]:
    """Why the server could not listen on host:port (a port in use, an unknown host), or None."""
    if error is None:
        try:  # the host's first address, in its own family (IPv6 hosts such as ::1 too)
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            with socket.create_server(address[:2], family=family):
                return None
        except OSError as e:
            error = e
    return f"cannot listen on {host}:{port}: {error.strerror or error}"


def main(argv=None) -> int:
    args = parse_args(argv)
    malloc.retain_freed_memory()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    fairseq_log_level()
    from .loader import wants_cuda

    try:
        cuda = wants_cuda(args.device)
    except UsageError as e:
        print(f"streambeam-serve: error: {e}", file=sys.stderr)
        return 2
    try:
        problem = listen_problem(args.host, args.port)  # before the model loads
        if problem:
            raise UsageError(problem)
        asyncio.run(serve(args, load_model(args, cuda)))
    except UsageError as e:
        print(f"streambeam-serve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
