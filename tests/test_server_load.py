"""The real server under contention: back-pressure (503 + Retry-After), queue timeouts,
priority admission, and graceful shutdown on SIGTERM.

Each behaviour needs its own scheduler limits, so each gets its own server, started from
a buckets TOML with max_running = 1. A long "blocker" stream holds the only running slot
while the test arranges the queue behind it; closing the blocker's connection aborts it,
which is also how the tests release the slot. No assertion depends on speed: the tests
wait on /metrics for the states they need.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import httpx
import openai
import pytest

from bucketserve.bench.launch import LiveServer, start_server

PROMPT = "Write a long story about a lighthouse keeper."
BLOCKER = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
KV = "[kv_cache]\ncpu_memory_gib = 0.1\n"


def contention_toml(max_waiting: int, queue_timeout_s: float) -> str:
    return (f"[scheduler]\nmax_running = 1\nmax_waiting = {max_waiting}\n"
            f"queue_timeout_s = {queue_timeout_s}\npolicy = \"priority\"\n" + KV)


@pytest.fixture(scope="module")
def contended(tmp_path_factory) -> LiveServer:
    srv = start_server(tmp_path_factory.mktemp("contended"), "contended", contention_toml(2, 600.0))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def impatient(tmp_path_factory) -> LiveServer:
    srv = start_server(tmp_path_factory.mktemp("impatient"), "impatient", contention_toml(8, 1.0))
    yield srv
    srv.stop()


async def metric(c: httpx.AsyncClient, name: str) -> float:
    for line in (await c.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def wait_metric(c: httpx.AsyncClient, name: str, predicate, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate(value := await metric(c, name)):
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        await asyncio.sleep(0.05)


class SSEReader:
    """Reads an SSE response line by line. It holds its line iterator: an abandoned async
    iterator would be finalized by the garbage collector, closing the connection."""

    def __init__(self, resp: httpx.Response) -> None:
        assert resp.status_code == 200
        self.lines = resp.aiter_lines()

    async def next_data(self) -> str:
        async for line in self.lines:
            if line.startswith("data: "):
                return line[len("data: "):]
        raise AssertionError("stream ended without data")

    async def rest(self) -> list[str]:
        return [line[len("data: "):] async for line in self.lines if line.startswith("data: ")]


async def blocker_running(c: httpx.AsyncClient, resp: httpx.Response) -> SSEReader:
    reader = SSEReader(resp)
    await reader.next_data()
    assert await metric(c, "bucketserve_requests_running") == 1
    return reader


def test_priority_changes_admission_order(contended) -> None:
    events: list[tuple[str, str]] = []

    async def stream(c: httpx.AsyncClient, name: str, priority: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
                "priority": priority, "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    if (name, "first token") not in events:
                        events.append((name, "first token"))
        events.append((name, "done"))

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=contended.base_url, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=BLOCKER) as blocker:
                _reader = await blocker_running(c, blocker)
                low = asyncio.create_task(stream(c, "low", 10))  # arrives first
                await wait_metric(c, "bucketserve_requests_waiting", lambda v: v == 1)
                high = asyncio.create_task(stream(c, "high", 0))
                await wait_metric(c, "bucketserve_requests_waiting", lambda v: v == 2)
            # The blocker's connection is closed: its slot frees and the queue is admitted.
            await asyncio.gather(low, high)
            await wait_metric(c, "bucketserve_kv_blocks_used", lambda v: v == 0)

    asyncio.run(scenario())
    # max_running = 1: whoever is admitted first runs to the end before the other starts.
    assert events.index(("high", "done")) < events.index(("low", "first token")), events


def test_a_client_leaving_while_queued_is_dropped_from_the_queue(contended) -> None:
    abort = 'bucketserve_request_success_total{finish_reason="abort"}'

    async def queued_stream(c: httpx.AsyncClient) -> None:
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            await resp.aread()

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=contended.base_url, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=BLOCKER) as blocker:
                _reader = await blocker_running(c, blocker)
                aborted = await metric(c, abort)
                task = asyncio.create_task(queued_stream(c))
                await wait_metric(c, "bucketserve_requests_waiting", lambda v: v == 1)
                task.cancel()  # closes its connection before any byte of the response
                await asyncio.gather(task, return_exceptions=True)
                await wait_metric(c, "bucketserve_requests_waiting", lambda v: v == 0)
                assert await metric(c, abort) == aborted + 1
                assert await metric(c, "bucketserve_requests_running") == 1  # blocker untouched
            await wait_metric(c, "bucketserve_kv_blocks_used", lambda v: v == 0)

    asyncio.run(scenario())


def test_past_max_waiting_the_server_answers_503_with_retry_after(contended) -> None:
    async def waiter(c: httpx.AsyncClient) -> int:
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        return r.status_code

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=contended.base_url, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=BLOCKER) as blocker:
                _reader = await blocker_running(c, blocker)
                waiters = [asyncio.create_task(waiter(c)) for _ in range(2)]
                await wait_metric(c, "bucketserve_requests_waiting", lambda v: v == 2)
                for stream in (False, True):
                    r = await c.post("/v1/completions",
                                     json={"prompt": PROMPT, "max_tokens": 2, "stream": stream})
                    assert r.status_code == 503
                    assert int(r.headers["retry-after"]) >= 1
                    err = r.json()["error"]
                    assert err["code"] == "queue_full" and err["message"]
                sdk = openai.AsyncOpenAI(base_url=contended.base_url + "/v1", api_key="x",
                                         max_retries=0)
                with pytest.raises(openai.APIStatusError) as info:
                    await sdk.chat.completions.create(model="smollm2-135m-instruct", max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])
                assert info.value.status_code == 503
            # Blocker gone: the two queued requests are served normally.
            assert await asyncio.gather(*waiters) == [200, 200]
            ok = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert ok.status_code == 200

    asyncio.run(scenario())


def test_queue_timeout_ends_with_an_error_not_silence(impatient) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=impatient.base_url, timeout=300) as c:
            timeouts = await metric(c, 'bucketserve_request_success_total{finish_reason="timeout"}')
            async with c.stream("POST", "/v1/completions", json=BLOCKER) as blocker:
                _reader = await blocker_running(c, blocker)
                for stream in (False, True):
                    r = await c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "stream": stream})
                    assert r.status_code == 503
                    err = r.json()["error"]
                    assert err["code"] == "queue_timeout" and "queue" in err["message"]
                    assert "retry-after" in r.headers
                # The blocker was never disturbed by the timeouts behind it.
                assert await metric(c, "bucketserve_requests_running") == 1
            after = await metric(c, 'bucketserve_request_success_total{finish_reason="timeout"}')
            assert after == timeouts + 2

    asyncio.run(scenario())


def test_sigterm_finishes_or_aborts_in_flight_requests_and_exits_0(tmp_path) -> None:
    grace_s = 10  # the short request needs 8 decode steps: well under a second here
    srv = start_server(tmp_path, "sigterm", KV, "--shutdown-timeout", str(grace_s))
    exit_bound_s = grace_s + 5 + 60  # shutdown timeout + engine stop + slack for a busy machine
    short_body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True}

    async def scenario() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=BLOCKER) as long_resp, \
                    c.stream("POST", "/v1/completions", json=short_body) as short_resp:
                long_reader, short_reader = SSEReader(long_resp), SSEReader(short_resp)
                await long_reader.next_data()
                await short_reader.next_data()  # both are running now
                srv.proc.send_signal(signal.SIGTERM)
                return await long_reader.rest(), await short_reader.rest()

    long_tail, short_tail = asyncio.run(scenario())
    try:
        code = srv.proc.wait(exit_bound_s)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        raise
    assert code == 0, srv.log()
    # A request that can finish within the shutdown timeout does, normally.
    assert short_tail[-1] == "[DONE]"
    assert json.loads(short_tail[-2])["choices"][0]["finish_reason"] == "length"
    # The long one kept streaming after the signal, then (shutdown timeout over) got an error
    # event, unless it managed to finish; either way the stream is closed properly.
    assert long_tail[-1] == "[DONE]"
    assert "text" in json.loads(long_tail[0])["choices"][0]
    last = json.loads(long_tail[-2])
    assert last.get("error", {}).get("code") == "shutting_down" or \
        last["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.base_url + "/health", timeout=5)
    assert "shutting down" in srv.log()
