"""Sends bench requests: closed loop at a concurrency, open loop at given arrival times.

Per-request timing (the definitions of vLLM's serving benchmark):
  TTFT  send -> first event that carries a token (a chunk with a choice; a closing chunk of
        empty text with a finish reason is not a token; chat: non-empty delta content).
  ITL   gaps between consecutive token events after the first.
  E2E   send -> last token event (non-streaming: -> end of the response).
Events that arrive in one socket read share its timestamp (the client cannot tell them apart).

Only the bytes needed are looked at: each SSE event is classified by substring tests; JSON is
parsed only for the usage chunk and error events. With `workers > 1` the requests are dealt
round-robin to that many processes (each its own event loop) that start at one shared instant.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import re
import time
from dataclasses import dataclass, field

from bucketserve.bench.http import Connection, build_request
from bucketserve.bench.workload import ENDPOINTS, BenchRequest, payload

_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
_EMPTY_TEXT = (b'"text":""', b'"text": ""')
_FINISH_NULL = (b'"finish_reason":null', b'"finish_reason": null')
_CONTENT = (b'"content":"', b'"content": "')
_EMPTY_CONTENT = (b'"content":""', b'"content": ""')
_USAGE_NULL = (b'"usage":null', b'"usage": null')
_FINISH = re.compile(rb'"finish_reason":\s*"([^"]*)"')


@dataclass
class RunConfig:
    host: str
    port: int
    model: str
    stream: bool = True
    ignore_eos: bool = True
    extra: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    concurrency: int | None = None  # closed loop (or the cap of an open loop)
    open_loop: bool = False  # requests go at their `arrival` offsets (scaled by 1/speed)
    speed: float = 1.0
    request_timeout_s: float = 600.0
    workers: int = 1
    embedding_model: str | None = None  # None: no "model" field in embedding requests


def new_result(i: int, req: BenchRequest) -> dict:
    return {"i": i, "kind": req.kind, "prompt_tokens": req.prompt_tokens,
            "max_tokens": req.max_tokens, "scheduled": None, "start": None, "status": 0,
            "error": None, "ttft": None, "e2e": None, "itl": [], "chunks": 0,
            "usage_completion_tokens": None, "usage_prompt_tokens": None, "finish": None,
            "inputs": len(req.input_lengths)}


class StreamHandler:
    """Consumes one SSE response into a result dict."""

    __slots__ = ("res", "chat", "start", "last", "buf", "sep", "itl", "chunks", "err")

    def __init__(self, res: dict, chat: bool, start: float) -> None:
        self.res, self.chat, self.start = res, chat, start
        self.last = 0.0
        self.buf = b""
        self.sep: bytes | None = None
        self.itl = res["itl"]
        self.chunks = 0
        self.err: list[bytes] | None = None

    def head(self, status: int, ts: float) -> None:
        self.res["status"] = status
        if status != 200:
            self.err = []

    def body(self, data: bytes) -> None:
        if self.err is not None:
            self.err.append(data)
        else:
            self.buf = self.buf + data if self.buf else data

    def flush(self, ts: float) -> None:
        buf = self.buf
        if not buf:
            return
        sep = self.sep
        if sep is None:
            j = buf.find(b"\n")
            if j < 0:
                return
            sep = self.sep = b"\r\n\r\n" if j > 0 and buf[j - 1] == 13 else b"\n\n"
        events = buf.split(sep)
        self.buf = events.pop()
        for ev in events:
            self.event(ev, ts)

    def event(self, ev: bytes, ts: float) -> None:
        i = ev.find(b"data:")
        if i < 0:
            return  # a comment (ping) or an event without data
        data = ev[i + 5:]
        # The common case first: a chunk whose choice is still open (finish_reason null) is a
        # token event (completions; chat: when its delta has content).
        if _FINISH_NULL[0] in data or _FINISH_NULL[1] in data:
            if not self.chat or ((_CONTENT[0] in data or _CONTENT[1] in data) and not (
                    _EMPTY_CONTENT[0] in data or _EMPTY_CONTENT[1] in data)):
                if self.chunks:
                    self.itl.append(ts - self.last)
                else:
                    self.res["ttft"] = ts - self.start
                self.last = ts
                self.chunks += 1
            if b'"usage"' not in data:
                return
        elif data.strip() == b"[DONE]":
            return
        elif b'"choices"' in data and not (_EMPTY_CHOICES[0] in data or
                                           _EMPTY_CHOICES[1] in data):
            # a closing choice: a token unless its text / content is empty
            if self.chat:
                token = (_CONTENT[0] in data or _CONTENT[1] in data) and not (
                    _EMPTY_CONTENT[0] in data or _EMPTY_CONTENT[1] in data)
            else:
                token = not (_EMPTY_TEXT[0] in data or _EMPTY_TEXT[1] in data)
            m = _FINISH.search(data)
            if m:
                self.res["finish"] = m.group(1).decode()
            if token:
                if self.chunks:
                    self.itl.append(ts - self.last)
                else:
                    self.res["ttft"] = ts - self.start
                self.last = ts
                self.chunks += 1
        if b'"usage"' in data and not (_USAGE_NULL[0] in data or _USAGE_NULL[1] in data):
            usage = (json.loads(data).get("usage") or {})
            self.res["usage_completion_tokens"] = usage.get("completion_tokens")
            self.res["usage_prompt_tokens"] = usage.get("prompt_tokens")
        elif b'"error"' in data and b'"choices"' not in data:
            try:
                self.res["error"] = str(json.loads(data).get("error"))[:300]
            except json.JSONDecodeError:
                self.res["error"] = data[:300].decode("utf-8", "replace")

    def end(self, ts: float) -> None:
        self.flush(ts)
        if self.buf.strip():
            self.event(self.buf, ts)
            self.buf = b""
        res = self.res
        res["chunks"] = self.chunks
        if self.err is not None:
            res["error"] = f"HTTP {res['status']}: " + b"".join(self.err)[:300].decode(
                "utf-8", "replace")
        elif self.chunks and res["error"] is None:
            res["e2e"] = self.last - self.start
        elif res["error"] is None:
            res["error"] = "no token event received"

    def fail(self, message: str) -> None:
        self.res["chunks"] = self.chunks
        self.res["error"] = message


class PlainHandler:
    """A non-streaming response (embeddings, or completions with stream off)."""

    __slots__ = ("res", "start", "parts", "keep")

    def __init__(self, res: dict, start: float, keep: bool) -> None:
        self.res, self.start, self.parts, self.keep = res, start, [], keep

    def head(self, status: int, ts: float) -> None:
        self.res["status"] = status
        self.keep = self.keep or status != 200

    def body(self, data: bytes) -> None:
        if self.keep:
            self.parts.append(data)

    def flush(self, ts: float) -> None:
        pass

    def end(self, ts: float) -> None:
        res = self.res
        body = b"".join(self.parts)
        if res["status"] != 200:
            res["error"] = f"HTTP {res['status']}: " + body[:300].decode("utf-8", "replace")
            return
        res["e2e"] = res["ttft"] = ts - self.start
        res["chunks"] = 1
        if self.keep and body:
            d = json.loads(body)
            usage = d.get("usage") or {}
            res["usage_completion_tokens"] = usage.get("completion_tokens")
            res["usage_prompt_tokens"] = usage.get("prompt_tokens")
            if d.get("choices"):
                res["finish"] = d["choices"][0].get("finish_reason")

    def fail(self, message: str) -> None:
        self.res["error"] = message


class Client:
    """Sends prepared requests over keep-alive connections (one per concurrent request)."""

    def __init__(self, cfg: RunConfig, reqs: list[tuple[int, BenchRequest]]) -> None:
        self.cfg = cfg
        self.reqs = reqs
        self.idle: list[Connection] = []
        # bodies are built before the clock starts
        self.wire = {i: build_request(cfg.host, cfg.port, ENDPOINTS[r.kind],
                                      payload(r, cfg.model, cfg.stream, cfg.ignore_eos,
                                              cfg.extra, embedding_model=cfg.embedding_model),
                                      cfg.headers)
                     for i, r in reqs}

    async def _conn(self) -> Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return await Connection.open(self.cfg.host, self.cfg.port)

    async def send(self, i: int, req: BenchRequest, t0: float) -> dict:
        res = new_result(i, req)
        for attempt in range(2):
            try:
                conn = await self._conn()
            except OSError as exc:
                res["error"] = f"connect failed: {exc}"
                return res
            start = time.perf_counter()
            res["start"] = start - t0
            if req.kind == "embedding" or not self.cfg.stream:
                handler: StreamHandler | PlainHandler = PlainHandler(
                    res, start, keep=req.kind != "embedding")
            else:
                handler = StreamHandler(res, req.kind == "chat", start)
            try:
                await asyncio.wait_for(conn.request(self.wire[i], handler),
                                       self.cfg.request_timeout_s)
            except asyncio.TimeoutError:
                conn.handler = None  # the close below must not overwrite the error
                conn.close()
                res["error"] = f"timed out after {self.cfg.request_timeout_s} s"
                return res
            # A kept-alive connection the server had closed: retry once on a fresh one.
            if res["error"] == "connection closed before any response byte" and attempt == 0:
                res["error"] = None
                continue
            if not conn.closed:
                self.idle.append(conn)
            return res
        return res

    async def closed_loop(self, concurrency: int, t0: float) -> list[dict]:
        todo = iter(self.reqs)
        out: list[dict] = []

        async def lane() -> None:
            for i, req in todo:
                out.append(await self.send(i, req, t0))

        await asyncio.gather(*(lane() for _ in range(max(1, concurrency))))
        return out

    async def open_loop(self, t0: float, speed: float, cap: int | None) -> list[dict]:
        sem = asyncio.Semaphore(cap) if cap else None
        loop = asyncio.get_running_loop()

        async def one(i: int, req: BenchRequest, at: float) -> dict:
            if sem is None:
                res = await self.send(i, req, t0)
            else:
                async with sem:
                    res = await self.send(i, req, t0)
            res["scheduled"] = at
            return res

        tasks = []
        for i, req in self.reqs:
            at = (req.arrival or 0.0) / speed
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(i, req, at)))
        return list(await asyncio.gather(*tasks))


def _worker(conn, cfg: RunConfig, reqs: list[tuple[int, BenchRequest]],
            concurrency: int | None) -> None:
    """A worker process: says it is ready, waits for the start instant, sends its share."""

    async def main() -> list[dict]:
        client = Client(cfg, reqs)  # request bytes built before the start
        conn.send("ready")
        t0 = await asyncio.to_thread(conn.recv)
        cpu = time.process_time()
        results = await client_run(client, cfg, t0, concurrency)
        return results, time.process_time() - cpu

    conn.send(asyncio.run(main()))
    conn.close()


async def client_run(client: Client, cfg: RunConfig, t0: float,
                     concurrency: int | None) -> list[dict]:
    delay = t0 - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if cfg.open_loop:
        results = await client.open_loop(t0, cfg.speed, concurrency)
    else:
        results = await client.closed_loop(concurrency or 1, t0)
    for c in client.idle:
        c.close()
    return results


async def run(cfg: RunConfig, reqs: list[BenchRequest]
              ) -> tuple[list[dict], float, float, float]:
    """All requests; returns (results in request order, t0, duration, client CPU seconds).
    t0 is on the perf_counter clock (CLOCK_MONOTONIC: the same in every process of this
    machine); the CPU time is the sending processes' own, from the start to the end."""
    indexed = list(enumerate(reqs))
    n = max(1, min(cfg.workers, len(reqs)))
    if n == 1:
        client = Client(cfg, indexed)
        t0 = time.perf_counter() + 0.01
        cpu = time.process_time()
        results = await client_run(client, cfg, t0, cfg.concurrency)
        cpu_s = time.process_time() - cpu
    else:
        conc = cfg.concurrency
        # fork: the workers inherit the imported modules (spawn would import them again,
        # torch included when started from the `bucketserve` CLI); asyncio drops the
        # parent's running loop in a forked child
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pipes, procs = [], []
        for w in range(n):
            per = None if conc is None else conc // n + (w < conc % n)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, cfg, indexed[w::n], per or None),
                               daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for p in pipes:  # every worker has built its requests
            await asyncio.to_thread(p.recv)
        t0 = time.perf_counter() + 0.05
        for p in pipes:
            p.send(t0)
        parts = [await asyncio.to_thread(p.recv) for p in pipes]
        for proc in procs:
            proc.join()
        results = [r for part, _ in parts for r in part]
        cpu_s = sum(c for _, c in parts)
    results.sort(key=lambda r: r["i"])
    ends = [r["start"] + (r["e2e"] if r["e2e"] is not None else 0.0)
            for r in results if r["start"] is not None]
    duration = max(ends) if ends else 0.0
    return results, t0, duration, cpu_s
