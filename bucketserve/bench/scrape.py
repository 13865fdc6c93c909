"""Scrapes a bucketserve /metrics page during a bench run (skipped for other servers)."""

from __future__ import annotations

import asyncio
import re
import time

from bucketserve.bench.http import get


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        key, _, value = line.rpartition(" ")
        if not key:
            continue
        try:
            out[key.strip()] = float(value)
        except ValueError:
            continue
    return out


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")


def engine_info(sample: dict[str, float]) -> dict[str, str] | None:
    """The labels of bucketserve_engine_info (model, device, dtype, quantization,
    kv_cache_dtype), or None for a server that does not export it."""
    for key in sample:
        if key.startswith("bucketserve_engine_info{"):
            return {k: _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
                    for k, v in _LABEL.findall(key)}
    return None


def labelled(sample: dict[str, float], name: str) -> dict[str, float]:
    """Samples of one metric family: the label text (e.g. 'kind="decode",bucket="8"') -> value."""
    prefix = name + "{"
    return {k[len(prefix):-1]: v for k, v in sample.items() if k.startswith(prefix)}


class Scraper:
    """Polls /metrics every `interval_s`; gives up quietly when the target has no bucketserve
    metrics (another server) or does not answer."""

    def __init__(self, host: str, port: int, interval_s: float = 0.5) -> None:
        self.host, self.port, self.interval_s = host, port, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (perf_counter, metrics)
        self.available: bool | None = None
        self.reason = ""

    async def scrape_once(self) -> dict[str, float] | None:
        try:
            got = await get(self.host, self.port, "/metrics", timeout_s=5.0)
        except (OSError, asyncio.TimeoutError) as exc:
            self.reason = f"/metrics unreachable: {exc}"
            return None
        if got.status != 200 or "bucketserve_" not in got.text:
            self.reason = f"no bucketserve metrics at /metrics (HTTP {got.status})"
            return None
        return parse_prometheus(got.text)

    async def run(self, stop: asyncio.Event) -> None:
        while True:
            t = time.perf_counter()
            sample = await self.scrape_once()
            if sample is None:
                if self.available is None:
                    self.available = False
                    return
            else:
                self.available = True
                self.samples.append((t, sample))
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
                final = await self.scrape_once()  # the state right after the run
                if final is not None:
                    self.samples.append((time.perf_counter(), final))
                return
            except asyncio.TimeoutError:
                continue
