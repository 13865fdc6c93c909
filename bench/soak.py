"""Soak: drive the server at saturation for a long time and watch what it leaks.

Closed-loop clients send a mix of completions and chats (plain and streamed) and embeddings;
some streams are cancelled after their first events and some plain requests abandoned by
their client (random cancellations and disconnects). Every `--sample-every` seconds the script
records the server's resident memory (the process and any child processes), its open file
descriptors, and from /metrics the KV blocks in use and the queues. At the end it waits for
the server to go idle and prints a verdict:

    5xx answers, requests that hung, RSS growth after the warm-up (end vs. the first sample
    after warm-up, %), KV blocks in use at the end, file-descriptor growth.

The 30-minute run on the merged code (SmolLM2 + MiniLM, this CPU):

    .venv/bin/python bench/soak.py --duration 1800 --out bench/results/soak_30min.json

It starts its own `bucketserve serve` (default buckets TOML, 0.5 GiB KV pool); `--base-url URL
--pid PID` attaches to a running server instead. A 60-second version runs in `make test`
(tests/test_soak_short.py).
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

from bucketserve.bench.loadlib import Tally, make_request, open_fds, rss_mib, scrape, send

GAUGES = {"kv_blocks_used": "bucketserve_kv_blocks_used",
          "running": "bucketserve_requests_running",
          "waiting": "bucketserve_requests_waiting",
          "embedding_waiting": "bucketserve_embedding_requests_waiting"}
SOAK_TOML = "[kv_cache]\ncpu_memory_gib = 0.5\n"


async def sample(client: httpx.AsyncClient, pid: int, t0: float) -> dict:
    metrics = await scrape(client)
    row = {"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(rss_mib(pid), 1),
           "fds": open_fds(pid)}
    row.update({k: metrics.get(v, 0.0) for k, v in GAUGES.items()})
    return row


async def run_soak(base_url: str, pid: int, duration_s: float, clients: int,
                   warmup_s: float, sample_every_s: float = 5.0, max_tokens: int = 32,
                   embeddings: bool = True, cancel_rate: float = 0.1,
                   abandon_rate: float = 0.05, seed: int = 0, log=print) -> dict:
    """Runs the soak against a live server (process `pid`); returns the result dict."""
    rng = random.Random(seed)
    tally = Tally()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=clients * 2 + 8, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300) as client:
        t0 = time.monotonic()
        samples = [await sample(client, pid, t0)]

        async def worker(k: int) -> None:
            local = random.Random(rng.random())
            while not stop.is_set():
                kind, path, body, mode = make_request(local, max_tokens, embeddings,
                                                      cancel_rate, abandon_rate)
                await send(client, kind, path, body, mode, tally, limit_s=300)

        async def sampler() -> None:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), sample_every_s)
                except asyncio.TimeoutError:
                    samples.append(await sample(client, pid, t0))
                    s = samples[-1]
                    log(f"[{s['t_s']:7.1f} s] rss {s['rss_mib']:.0f} MiB, fds {s['fds']}, "
                        f"kv {s['kv_blocks_used']:.0f}, running {s['running']:.0f}, "
                        f"waiting {s['waiting']:.0f}, done {sum(tally.outcomes.values())}")

        tasks = [asyncio.create_task(worker(k)) for k in range(clients)]
        sampler_task = asyncio.create_task(sampler())
        await asyncio.sleep(duration_s)
        stop.set()
        await asyncio.wait(tasks, timeout=310)
        await sampler_task
        # idle: every request answered; the server must hold nothing any more
        deadline = time.monotonic() + 60
        while True:
            end = await sample(client, pid, t0)
            if (end["kv_blocks_used"] == 0 and end["running"] == 0 and end["waiting"] == 0
                    and end["embedding_waiting"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        health = (await client.get("/health")).status_code
    samples.append(end)
    return verdict(samples, tally, warmup_s, duration_s, clients, health)


def verdict(samples: list[dict], tally: Tally, warmup_s: float, duration_s: float,
            clients: int, health: int) -> dict:
    after = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    base, end = after[0], samples[-1]
    peak = max(s["rss_mib"] for s in after)
    summary = tally.summary()
    result = {
        "duration_s": duration_s, "clients": clients, "warmup_s": warmup_s,
        "requests": sum(tally.outcomes.values()), **summary,
        "rss_mib": {"start": samples[0]["rss_mib"], "after_warmup": base["rss_mib"],
                    "peak_after_warmup": peak, "end": end["rss_mib"]},
        "rss_growth_after_warmup_pct": round(100 * (end["rss_mib"] / base["rss_mib"] - 1), 2),
        "rss_peak_over_warmup_pct": round(100 * (peak / base["rss_mib"] - 1), 2),
        "fds": {"start": samples[0]["fds"], "after_warmup": base["fds"], "end": end["fds"],
                "max": max(s["fds"] for s in samples)},
        "fd_growth": end["fds"] - base["fds"],
        "kv_blocks_used_end": end["kv_blocks_used"],
        "health_at_end": health,
        "samples": samples,
    }
    result["pass"] = bool(result["http_5xx"] == 0 and summary["outcomes"].get("hung", 0) == 0
                          and summary["outcomes"].get("stream_error", 0) == 0
                          and abs(result["rss_growth_after_warmup_pct"]) <= 5.0
                          and result["kv_blocks_used_end"] == 0 and result["fd_growth"] <= 5
                          and health == 200)
    return result


def print_verdict(r: dict) -> None:
    o = r["outcomes"]
    print(f"soak {r['duration_s']:.0f} s, {r['clients']} clients: {r['requests']} requests "
          f"({o.get('ok', 0)} ok, {o.get('cancelled', 0)} cancelled, "
          f"{o.get('abandoned', 0)} abandoned, {o.get('client_error', 0)} 4xx)")
    print(f"  5xx: {r['http_5xx']}   hung: {o.get('hung', 0)}   stream errors: "
          f"{o.get('stream_error', 0)}   transport errors: {o.get('transport', 0)}")
    m = r["rss_mib"]
    print(f"  RSS after warm-up {m['after_warmup']:.0f} MiB -> end {m['end']:.0f} MiB "
          f"({r['rss_growth_after_warmup_pct']:+.2f}%), peak {m['peak_after_warmup']:.0f} MiB")
    print(f"  KV blocks in use at end: {r['kv_blocks_used_end']:.0f}   fds {r['fds']['after_warmup']}"
          f" -> {r['fds']['end']} ({r['fd_growth']:+d})   /health: {r['health_at_end']}")
    print(f"  latency of completed requests p50 {r['latency_s']['p50']} s, "
          f"p99 {r['latency_s']['p99']} s")
    print("VERDICT:", "PASS" if r["pass"] else "FAIL")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before the RSS baseline (default: 10%% of the run, <= 300)")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--base-url", default=None, help="attach to this server (needs --pid)")
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else min(300.0, args.duration * 0.1)
    server = None
    if args.base_url is None:
        from bucketserve.bench.launch import start_server

        server = start_server(Path("/tmp/bucketserve-soak"), "soak", SOAK_TOML,
                              "--embedding-model", "all-minilm-l6-v2")
        base_url, pid = server.base_url, server.proc.pid
    else:
        if args.pid is None:
            ap.error("--base-url needs --pid (the server process, for RSS and fds)")
        base_url, pid = args.base_url, args.pid
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()
    try:
        result = asyncio.run(run_soak(base_url, pid, args.duration, args.clients, warmup,
                                      args.sample_every, args.max_tokens))
    finally:
        if server is not None:
            result_exit = server.stop()
            print(f"server exited with {result_exit}")
    result.update(started=started, loadavg_at_start=load, command=" ".join(sys.argv))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_verdict(result)
    print(f"written: {args.out}")
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
