"""The soak (bench/soak.py) for 60 seconds against the real server: mixed completions, chats
and embeddings at saturation, with cancelled streams and abandoned requests. Nothing may
answer 5xx or hang, and once the load stops the server must hold no KV block, no queued
request and no extra file descriptor. (The 30-minute run's figures are in the README.)
"""

from __future__ import annotations

import asyncio

import pytest

from bench import soak
from bucketserve.bench.launch import start_server

DURATION_S = 60.0
WARMUP_S = 15.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("soak"), "soak", soak.SOAK_TOML,
                       "--embedding-model", "all-minilm-l6-v2")
    yield srv
    srv.stop()


def test_soak_60_seconds(server):
    result = asyncio.run(soak.run_soak(server.base_url, server.proc.pid, DURATION_S, clients=8,
                                       warmup_s=WARMUP_S, sample_every_s=5.0, max_tokens=16,
                                       log=lambda _: None))
    soak.print_verdict(result)
    outcomes = result["outcomes"]
    assert result["requests"] > 0 and outcomes.get("ok", 0) > 0
    assert outcomes.get("cancelled", 0) > 0 and outcomes.get("abandoned", 0) > 0
    assert result["http_5xx"] == 0, result["unexpected_samples"]
    for bad in ("hung", "stream_error", "transport", "server_error", "client_error"):
        assert outcomes.get(bad, 0) == 0, (bad, result["unexpected_samples"])
    assert result["kv_blocks_used_end"] == 0
    assert result["samples"][-1]["running"] == 0 and result["samples"][-1]["waiting"] == 0
    assert result["samples"][-1]["embedding_waiting"] == 0
    assert result["fd_growth"] <= 5
    assert result["health_at_end"] == 200
    # A minute is short for memory: only runaway growth (a leak per request) is caught here;
    # the 30-minute soak holds it to 5%.
    assert result["rss_growth_after_warmup_pct"] < 20.0
