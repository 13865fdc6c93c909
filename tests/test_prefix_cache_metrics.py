"""The prefix-cache counters flow from the block manager through EngineStats to /metrics."""

from __future__ import annotations

import re

from bucketserve.engine.stats import EngineStats
from bucketserve.server.metrics import ServerMetrics


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][^ ]*) ([^ ]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_prefix_cache_series_on_metrics():
    stats = EngineStats()
    assert stats.prefix_cache_hit_rate == 0.0
    stats.set_prefix_cache(queries_total=400, hits_total=300, cached_blocks=9)
    assert stats.prefix_cache_hit_rate == 0.75
    snap = stats.snapshot()
    assert (snap["prefix_cache_queries_total"], snap["prefix_cache_hits_total"],
            snap["prefix_cache_blocks"]) == (400, 300, 9)
    got = samples(ServerMetrics(lambda: stats).render().decode())
    assert got["bucketserve_prefix_cache_queries_total"] == 400
    assert got["bucketserve_prefix_cache_hits_total"] == 300
    assert got["bucketserve_prefix_cache_blocks"] == 9
