"""The engine core in its own process, seen from outside: killed during a streaming request,
the front end fails the stream with an error event, stops answering /health with 200 and
exits non-zero; with the front end killed, the core exits too (no orphan)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bucketserve.bench.launch import LiveServer, start_server

KV = "[kv_cache]\ncpu_memory_gib = 0.1\n"
LONG = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 1500,
        "ignore_eos": True, "stream": True}
EXIT_BOUND_S = 60.0  # a bound on a busy machine, not a measurement


def core_pid(server: LiveServer) -> int:
    # --api-workers N: the supervisor's line is there at once; worker 0's "ready" line may come
    # after another worker already answered /health
    m = re.search(r"engine core (?:ready|started) in process (\d+)", server.log())
    assert m, server.log()
    return int(m.group(1))


def gone(pid: int) -> bool:
    """True once the process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_until(predicate, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def server(tmp_path) -> LiveServer:
    srv = start_server(tmp_path, "core", KV)
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()


def test_killing_the_core_fails_the_stream_and_the_server_exits_non_zero(server) -> None:
    pid = core_pid(server)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=LONG, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        os.kill(pid, signal.SIGKILL)
        rest = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["code"] == "engine_dead" and err["type"] == "server_error" and err["message"]
    try:
        health = httpx.get(server.base_url + "/health", timeout=10).status_code
    except httpx.TransportError:
        health = None  # already gone: not answering is also not 200
    assert health != 200
    try:
        code = server.proc.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after its core died:\n{server.log()}")
    assert code != 0
    assert "engine core died" in server.log()


def test_killing_the_front_end_ends_the_core(server) -> None:
    # no --api-workers: sized for the CPU engine, and the start-up log says so
    assert re.search(r"front end: 1 API worker process \(--api-workers auto: cpu engine, \d+ "
                     r"CPU cores", server.log()), server.log()
    pid = core_pid(server)
    assert not gone(pid)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    assert wait_until(lambda: gone(pid), EXIT_BOUND_S), "the engine core outlived its front end"
