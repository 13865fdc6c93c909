"""Overload: more clients than the server can serve, then a burst of requests at once.

1. Saturation: closed loops of 1, 2, 4, ... clients (short completions) until throughput stops
   rising; the saturating concurrency is the smallest that reaches 90% of the best throughput
   (or give it with --saturation).
2. Closed loop at 4x that concurrency for --loop-s seconds: mixed completions, chats and
   streams; a refused client waits its Retry-After and tries again.
3. A burst of --burst requests sent at once (loopback only).

Throughout, /health is polled and the server's RSS sampled. Every request must end as one of:
completed, refused with 503 + Retry-After, or (accepted, then) a clear error; none may hang.
At the end the server must hold no KV block and no queued request.

    .venv/bin/python bench/overload.py --out bench/results/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

from bucketserve.bench.loadlib import (
    Tally,
    make_request,
    peak_rss_mib,
    rss_mib,
    scrape,
    send,
    watch_health,
)

OVERLOAD_TOML = "[kv_cache]\ncpu_memory_gib = 0.5\n"


async def closed_loop(client: httpx.AsyncClient, clients: int, seconds: float, max_tokens: int,
                      tally: Tally, seed: int, embeddings: bool, limit_s: float) -> float:
    """`clients` loops for `seconds`; returns completed requests per second."""
    rng = random.Random(seed)
    stop = time.monotonic() + seconds

    async def worker() -> None:
        local = random.Random(rng.random())
        while time.monotonic() < stop:
            kind, path, body, mode = make_request(local, max_tokens, embeddings)
            before = tally.outcomes["refused"]
            await send(client, kind, path, body, mode, tally, limit_s)
            if tally.outcomes["refused"] > before:
                await asyncio.sleep(1.0)  # Retry-After

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return tally.outcomes["ok"] / (time.monotonic() - t0)


async def find_saturation(client: httpx.AsyncClient, seconds: float, max_tokens: int,
                          log) -> tuple[int, dict]:
    rates: dict[int, float] = {}
    c = 1
    while c <= 256:
        tally = Tally()
        rates[c] = await closed_loop(client, c, seconds, max_tokens, tally, c, False, 300)
        log(f"  {c} clients: {rates[c]:.2f} requests/s")
        if len(rates) >= 3 and rates[c] < 1.1 * max(v for k, v in rates.items() if k < c):
            break
        c *= 2
    best = max(rates.values())
    saturating = min(k for k, v in rates.items() if v >= 0.9 * best)
    return saturating, {str(k): round(v, 3) for k, v in rates.items()}


async def burst(client: httpx.AsyncClient, n: int, max_tokens: int, tally: Tally,
                limit_s: float) -> None:
    rng = random.Random(7)
    reqs = [make_request(rng, max_tokens, False) for _ in range(n)]
    await asyncio.gather(*(send(client, kind, path, body, mode, tally, limit_s)
                           for kind, path, body, mode in reqs))


async def run_overload(base_url: str, pid: int, saturation: int | None, loop_s: float,
                       burst_n: int, max_tokens: int, factor: int = 4, limit_s: float = 900,
                       embeddings: bool = True, log=print) -> dict:
    limits = httpx.Limits(max_connections=max(burst_n, 64) + 64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=limit_s) as client:
        rss_before = rss_mib(pid)
        rates = None
        if saturation is None:
            log("finding the saturating concurrency")
            saturation, rates = await find_saturation(client, 10.0, max_tokens, log)
        stop = asyncio.Event()
        health: dict = {}
        watcher = asyncio.create_task(watch_health(client, stop, 0.5, health))
        peak = {"rss_mib": rss_before}

        async def rss_sampler() -> None:
            while not stop.is_set():
                peak["rss_mib"] = max(peak["rss_mib"], rss_mib(pid))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(rss_sampler())
        loop_tally, burst_tally = Tally(), Tally()
        clients = factor * saturation
        log(f"closed loop: {clients} clients ({factor}x {saturation}) for {loop_s:.0f} s")
        t0 = time.monotonic()
        await closed_loop(client, clients, loop_s, max_tokens, loop_tally, 1, embeddings, limit_s)
        loop_wall = time.monotonic() - t0
        log(f"burst: {burst_n} requests at once")
        t0 = time.monotonic()
        await burst(client, burst_n, max_tokens, burst_tally, limit_s)
        burst_wall = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while True:
            m = await scrape(client)
            idle = (m.get("bucketserve_kv_blocks_used", 0) == 0
                    and m.get("bucketserve_requests_running", 0) == 0
                    and m.get("bucketserve_requests_waiting", 0) == 0)
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        stop.set()
        await watcher
        await sampler
        health_end = (await client.get("/health")).status_code

    def phase(t: Tally, wall: float) -> dict:
        s = t.summary()
        o = s["outcomes"]
        offered = sum(o.values())
        refused = o.get("refused", 0)
        return {"offered": offered, "accepted": offered - refused, "refused": refused,
                "completed": o.get("ok", 0), "wall_s": round(wall, 1), **s}

    return {"saturating_clients": saturation, "saturation_probe_rps": rates, "factor": factor,
            "closed_loop": phase(loop_tally, loop_wall), "burst": phase(burst_tally, burst_wall),
            "health": health, "health_at_end": health_end,
            "rss_mib": {"before": round(rss_before, 1), "peak_sampled": round(peak["rss_mib"], 1),
                        "peak_vmhwm": round(peak_rss_mib(pid), 1)},
            "kv_blocks_used_end": m.get("bucketserve_kv_blocks_used", 0),
            "requests_running_end": m.get("bucketserve_requests_running", 0),
            "requests_waiting_end": m.get("bucketserve_requests_waiting", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saturation", type=int, default=None, help="skip the probe")
    ap.add_argument("--loop-s", type=float, default=60.0)
    ap.add_argument("--burst", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--out", default="bench/results/overload.json")
    args = ap.parse_args()
    server = None
    if args.base_url is None:
        from bucketserve.bench.launch import start_server

        server = start_server(Path("/tmp/bucketserve-overload"), "overload", OVERLOAD_TOML,
                              "--embedding-model", "all-minilm-l6-v2")
        base_url, pid = server.base_url, server.proc.pid
    else:
        base_url, pid = args.base_url, args.pid
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    try:
        result = asyncio.run(run_overload(base_url, pid, args.saturation, args.loop_s,
                                          args.burst, args.max_tokens))
    finally:
        if server is not None:
            server.stop()
    result.update(started=started, loadavg_at_start=load, command=" ".join(sys.argv))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name in ("closed_loop", "burst"):
        p = result[name]
        print(f"{name}: offered {p['offered']}, accepted {p['accepted']}, refused {p['refused']} "
              f"(without Retry-After: {p['refused_without_retry_after']}), completed "
              f"{p['completed']}, outcomes {p['outcomes']}")
    print(f"health: {result['health']}, RSS {result['rss_mib']}, KV at end "
          f"{result['kv_blocks_used_end']}")


if __name__ == "__main__":
    main()
