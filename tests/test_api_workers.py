"""`serve --api-workers N`: several front-end processes, one engine core.

Unit: the core's Router splits each step's outputs by owning front end (one message per
step per front end, each with its own taken-in count) and only the last Shutdown ends it.
Live (two workers, the real default model): requests reach both workers and are all served,
/metrics counts every worker's requests, SIGTERM exits 0; killing the core fails a stream in
flight with an error event and the whole server exits non-zero with no worker left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from test_engine_process import EXIT_BOUND_S, LONG, core_pid, gone, wait_until

from bucketserve.bench.launch import LiveServer, start_server
from bucketserve.engine.core import Router
from bucketserve.engine.messages import AddRequest, SeqOutput, Shutdown, StepOutputs
from bucketserve.engine.sequence import SamplingParams
from bucketserve.server.cli import build_parser, frontend_workers, resolve_api_workers

KV = "[kv_cache]\ncpu_memory_gib = 0.1\n"


def _add(rid: str, client: int) -> AddRequest:
    return AddRequest(rid, [1, 2], SamplingParams(max_tokens=2), 0, 0.0, client)


def test_router_sends_each_front_end_only_its_outputs_every_step() -> None:
    r = Router(3)
    for rid, client in (("a", 0), ("b", 2), ("c", 2)):
        assert r.take(_add(rid, client))
    step = StepOutputs([SeqOutput("a", [5]), SeqOutput("b", [6]), SeqOutput("c", [7], "length")],
                       None, 0, 3, 4, 3)
    parts = r.split(step)
    assert [[o.request_id for o in p.outputs] for p in parts] == [["a"], [], ["b", "c"]]
    assert [p.num_added for p in parts] == [1, 0, 2]
    assert all(p.num_running == 3 and p.kv_blocks_used == 4 for p in parts)
    assert "c" not in r.owner and r.owner == {"a": 0, "b": 2}  # finished: forgotten
    # the plain one-token columns are split the same way, in order
    r.take(_add("d", 1))
    step = StepOutputs([], None, 0, 3, 4, 4, token_request_ids=["b", "a", "d"], tokens=[8, 9, 10])
    parts = r.split(step)
    assert [(p.token_request_ids, p.tokens) for p in parts] == [
        (["a"], [9]), (["d"], [10]), (["b"], [8])]
    assert [[(o.request_id, o.new_token_ids) for o in p.news()] for p in parts] == [
        [("a", [9])], [("d", [10])], [("b", [8])]]


def test_router_core_ends_on_the_last_shutdown_only() -> None:
    r = Router(2)
    assert not r.take(Shutdown())
    assert r.take(Shutdown())
    one = Router(1)
    assert one.take(Shutdown())
    step = StepOutputs([SeqOutput("x", [1])], None, 0, 1, 1, 0)
    assert one.split(step) == [step]


def test_api_workers_flag() -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).api_workers == "auto"
    assert parse(["serve", "--api-workers", "auto"]).api_workers == "auto"
    assert parse(["serve", "--api-workers", "3"]).api_workers == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parse(["serve", "--api-workers", bad])


def test_frontend_sizing_rule() -> None:
    # cuda: one front end per 2 cores, at most 8 (H200 host, 16 cores, 135M shape, 256
    # streams: 4 front ends gave 0.89x of 8's tok/s and 1.5 tokens per SSE event, 8 gave 1.0)
    assert [frontend_workers(c, "cuda")[0] for c in (1, 2, 3, 4, 7, 8, 12, 16, 32, 128)] == [
        1, 1, 1, 2, 3, 4, 6, 8, 8, 8]
    n, why = frontend_workers(16, "cuda")
    assert n == 8 and "16 CPU cores" in why and "cuda" in why
    # cpu: the engine's forward needs the cores; one front end, whatever the machine
    assert [frontend_workers(c, "cpu")[0] for c in (1, 2, 16, 128)] == [1, 1, 1, 1]
    assert "cpu engine" in frontend_workers(2, "cpu")[1]


def test_resolve_api_workers_logs_the_choice(caplog, monkeypatch) -> None:
    import logging

    from bucketserve.server import cli

    monkeypatch.setattr(cli, "usable_cores", lambda: 16)
    parse = build_parser().parse_args
    cases = ((["--device", "cuda"], 8, "--api-workers auto: cuda engine, 16 CPU cores"),
             (["--device", "cpu"], 1, "--api-workers auto: cpu engine, 16 CPU cores"),
             (["--device", "cuda", "--engine-in-process"], 1, "--engine-in-process"),
             (["--device", "cuda", "--api-workers", "3"], 3, "(--api-workers 3)"))
    for flags, n, why in cases:
        args = parse(["serve", *flags])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="bucketserve.server"):
            resolve_api_workers(args)
        assert args.api_workers == n
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"front end: {n} API worker process") and why in line, line


def test_two_workers_both_serve_embeddings(tmp_path) -> None:
    """Each worker loads its own encoder: requests on new connections reach both, and every
    answer is the vector of its own text."""
    srv = start_server(tmp_path, "emb-workers", KV + "[embedding]\nmax_queue_delay_ms = 1.0\n",
                       "--api-workers", "2", "--embedding-model", "all-minilm-l6-v2")
    try:
        texts = [f"text number {i} for the workers" for i in range(24)]

        def one(text: str) -> tuple[str, list[float]]:  # a new connection each
            r = httpx.post(srv.base_url + "/v1/embeddings", json={"input": [text, "same"]},
                           timeout=300)
            assert r.status_code == 200, r.text
            data = r.json()["data"]
            return r.headers["x-bucketserve-worker"], [d["embedding"] for d in data]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, texts))
        assert {w for w, _ in got} == {"w0", "w1"}
        import numpy as np

        vecs = np.array([v[0] for _, v in got])
        same = np.array([v[1] for _, v in got])
        assert np.allclose(same, same[0], atol=1e-5)  # both workers: the same encoder
        # every answer belongs to its own text: distinct texts, distinct vectors
        sims = vecs @ vecs.T / np.outer(np.linalg.norm(vecs, axis=1), np.linalg.norm(vecs, axis=1))
        assert (sims[~np.eye(len(texts), dtype=bool)] < 0.9999).all()
        # /metrics from either worker counts both workers' embeddings (each publishes its
        # batcher's totals every 50 ms; a scrape sums its own with the other's)
        time.sleep(0.5)
        for _ in range(8):  # new connections: the kernel spreads them over the workers
            text = httpx.get(srv.base_url + "/metrics", timeout=30).text
            values = {name: float(v) for name, v in re.findall(
                r"^(bucketserve_embedding_(?:inputs|requests)_total) (\S+)$", text, flags=re.M)}
            assert values == {"bucketserve_embedding_inputs_total": 2.0 * len(texts),
                              "bucketserve_embedding_requests_total": float(len(texts))}, values
        assert srv.stop() == 0, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


@pytest.fixture
def server(tmp_path) -> LiveServer:
    srv = start_server(tmp_path, "workers", KV, "--api-workers", "2")
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()


def _workers(server: LiveServer) -> list[psutil.Process]:
    core = core_pid(server)
    return [p for p in psutil.Process(server.proc.pid).children()
            if p.pid != core and "spawn_main" in " ".join(p.cmdline())]  # not the resource tracker


def test_two_workers_serve_count_and_stop_cleanly(server) -> None:
    assert len(_workers(server)) == 2
    assert "front end: 2 API worker processes (--api-workers 2)" in server.log()
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}

    def one(_: int) -> dict:  # a new connection each: the kernel picks the worker
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(24)))
    ids = [g["id"] for g in got]
    assert len(set(ids)) == 24
    assert {i.split("-")[1] for i in ids} == {"w0", "w1"}, ids
    assert all(g["usage"]["completion_tokens"] == 3 for g in got)
    values = [server.metric('bucketserve_request_success_total{finish_reason="length"}')
              for _ in range(6)]  # whichever worker answers, it counts both workers' requests
    assert values == [24.0] * 6
    assert server.metric("bucketserve_time_to_first_token_seconds_count") == 24.0
    assert server.metric("bucketserve_engine_steps_total") > 0

    def streamed(_: int) -> int:
        with httpx.stream("POST", server.base_url + "/v1/completions",
                          json={**body, "stream": True}, timeout=300) as r:
            return sum(1 for ln in r.iter_lines() if ln.startswith("data: {"))

    with ThreadPoolExecutor(8) as pool:
        assert all(n >= 1 for n in pool.map(streamed, range(8)))
    # streamed tokens are counted in whichever worker sent them, summed in every scrape
    values = [server.metric('bucketserve_sse_tokens_total{endpoint="completions"}')
              for _ in range(6)]
    assert values == [24.0] * 6
    assert 8 <= server.metric('bucketserve_sse_token_events_total{endpoint="completions"}') <= 24
    workers = _workers(server)
    core = core_pid(server)
    assert server.stop() == 0, server.log()
    assert all(gone(p.pid) for p in workers) and gone(core)


def test_killing_the_core_fails_streams_and_the_server_exits_non_zero(server) -> None:
    pid = core_pid(server)
    workers = _workers(server)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=LONG, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        os.kill(pid, signal.SIGKILL)
        rest = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["error"]["code"] == "engine_dead"
    try:
        code = server.proc.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after its core died:\n{server.log()}")
    assert code != 0
    assert wait_until(lambda: all(gone(p.pid) for p in workers), EXIT_BOUND_S)
    assert "engine core died" in server.log()


def test_one_choice_stream_that_is_not_read_is_bounded_and_aborted(monkeypatch) -> None:
    """The single-choice path has no merging task: AsyncEngine itself bounds what it holds
    for a consumer that stops reading, aborts the request and ends the stream with 408."""
    import asyncio

    from bucketserve.engine import async_engine
    from bucketserve.engine.async_engine import AsyncEngine
    from bucketserve.engine.messages import AbortRequests, RequestLimits
    from bucketserve.engine.stats import EngineStats
    from bucketserve.server.errors import APIError
    from bucketserve.server.generation import InFlight, Job, run_choices
    from bucketserve.server.metrics import ServerMetrics

    monkeypatch.setattr(async_engine, "MAX_QUEUED_OUTPUTS", 5)

    class Core:
        model_name, kv_blocks_total, tokenizer = "m", 100, None
        limits = RequestLimits(100, 1000, 100, 16, 100, 60.0)

        def __init__(self) -> None:
            self.sent: list = []

        def start(self, deliver, died) -> None:
            pass

        def send(self, msg) -> None:
            self.sent.append(msg)

        def is_alive(self) -> bool:
            return True

    async def scenario() -> None:
        core = Core()
        engine = AsyncEngine(core)
        engine.start()
        job = Job([1, 2], SamplingParams(max_tokens=50, detokenize=False))
        outputs = run_choices(engine, [job], "slow", 0, InFlight(),
                              ServerMetrics(lambda: EngineStats()))
        first = asyncio.ensure_future(anext(outputs))
        await asyncio.sleep(0)
        engine._on_step(StepOutputs([SeqOutput("slow-0", [7])], None, 0, 1, 1, 1))
        assert (await first)[1].new_token_ids == [7]
        for t in range(10):  # the consumer is stuck meanwhile
            engine._on_step(StepOutputs([SeqOutput("slow-0", [t])], None, 0, 1, 1, 1))
        assert any(isinstance(m, AbortRequests) and m.request_ids == ["slow-0"]
                   for m in core.sent)
        got = []
        with pytest.raises(APIError) as err:
            async for _, out in outputs:
                got += out.new_token_ids
        assert err.value.status == 408 and err.value.code == "client_too_slow"
        assert got == list(range(6))  # what was held (merged into one output), then the error

    asyncio.run(scenario())
