"""Overload of the real server (bench/overload.py, CI-sized): a closed loop at 4x the
concurrency that saturates it, then a burst of requests at once. A server that runs at most 4
sequences and queues 8 saturates at 4 clients by construction. Every request must complete or
be refused with 503 + Retry-After; none may hang or fail otherwise; /health answers throughout;
the server ends idle. (The full-size figures, 2,000 requests in the burst, are in the README.)
"""

from __future__ import annotations

import asyncio

import pytest

from bench import overload
from bucketserve.bench.launch import start_server

TOML = ("[scheduler]\nmax_running = 4\nmax_waiting = 8\nqueue_timeout_s = 120.0\n"
        "[kv_cache]\ncpu_memory_gib = 0.1\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("overload"), "overload", TOML,
                       "--embedding-model", "all-minilm-l6-v2")
    yield srv
    srv.stop()


def test_overload_closed_loop_and_burst(server):
    result = asyncio.run(overload.run_overload(
        server.base_url, server.proc.pid, saturation=4, loop_s=15.0, burst_n=300, max_tokens=8,
        limit_s=300, log=lambda _: None))
    for name in ("closed_loop", "burst"):
        phase = result[name]
        outcomes = phase["outcomes"]
        assert set(outcomes) <= {"ok", "refused"}, (name, outcomes, phase["unexpected_samples"])
        assert phase["completed"] == phase["accepted"] > 0
        assert phase["refused"] > 0  # the queue did overflow ...
        assert phase["refused_without_retry_after"] == 0  # ... and said when to come back
    assert result["burst"]["offered"] == 300
    health = result["health"]
    assert health["checks"] > 0 and health["ok"] == health["checks"]
    assert result["health_at_end"] == 200
    assert result["kv_blocks_used_end"] == 0
    assert result["requests_running_end"] == 0 and result["requests_waiting_end"] == 0
