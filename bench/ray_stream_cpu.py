"""The Ray path's stream relay on the CPU: SSE events/s that reach clients through Ray Serve's
proxy, the Ingress and EngineReplica.asgi, with a stub app in place of the engine, at two
git revisions (before / after) in one command.

The real `Ingress` and `EngineReplica.asgi` of each revision run on a local Ray instance (an
old revision from `git archive` into a temporary directory, run with PYTHONPATH pointing at
it; the current tree as it is); only the replica's app is replaced (a subclass defined here
overrides `__init__`): a stub ASGI app that answers every request with an SSE stream of
--events events, one every --step-ms (0: as fast as the event loop turns), as an engine
stepping all its running sequences at once would. --clients concurrent streaming POSTs
(aiohttp) read them; each run reports events/s delivered to the clients (all events / wall
time from the first request to the last event), TTFT and each stream's mean time per event.
Then a lone stream (one client) gives its TTFT and mean time per event (the stub's step plus
what the relay adds), so that batching is seen not to hold a single stream's tokens back. Runs alternate the revisions (A B A B ...)
in fresh Ray instances; medians of --reps runs each.

    python bench/ray_stream_cpu.py --old a454bb1 --reps 3 --out FILE
        [--clients 256] [--events 64] [--step-ms 1] [--variant NAME=REV:BATCH_WAIT_MS:INGRESS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from before_after_cpu import _cpu, free_port

ROOT = Path(__file__).resolve().parent.parent


def stub_app(events: int, step_s: float, source: str):
    """An ASGI app streaming `events` SSE events (complete "data: ...\\n\\n" chunks); its
    x-source header names the ray_deploy module the replica runs."""

    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"x-source", source.encode())]})
        for i in range(events):
            await asyncio.sleep(step_s)
            body = b'data: {"choices": [{"index": 0, "text": " tok%d"}]}\n\n' % i
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    return app


async def read_stream(session, url: str, t0: float,
                      source: list | None = None) -> tuple[int, float, list[float]]:
    """(events, time to the first event, arrival times) of one streaming request."""
    events, pending, arrivals = 0, b"", []
    async with session.post(url, json={"prompt": "hi", "stream": True}) as resp:
        assert resp.status == 200, resp.status
        if source is not None:
            source.append(resp.headers.get("x-source"))
        async for chunk in resp.content.iter_any():
            pending += chunk
            parts = pending.split(b"\n\n")
            pending = parts[-1]
            now = time.perf_counter()
            arrivals.extend([now] * (len(parts) - 1))
            events += len(parts) - 1
    return events, arrivals[0] - t0, arrivals


def per_event(run: tuple[int, float, list[float]]) -> float:
    """A stream's mean time per event after its first (s)."""
    events, _, arrivals = run
    return (arrivals[-1] - arrivals[0]) / max(1, events - 1)


async def drive(url: str, clients: int) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        source: list = []
        await read_stream(session, url, time.perf_counter(), source)  # warm-up
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(read_stream(session, url, time.perf_counter())
                                      for _ in range(clients)))
        wall = time.perf_counter() - t0
        lone = await read_stream(session, url, time.perf_counter())
    total = sum(r[0] for r in runs)
    return {"events": total, "wall_s": wall, "events_per_s": total / wall,
            "ttft_p50_ms": 1e3 * statistics.median(r[1] for r in runs),
            "ms_per_event_p50": 1e3 * statistics.median(per_event(r) for r in runs),
            "lone_ttft_ms": 1e3 * lone[1], "lone_ms_per_event": 1e3 * per_event(lone),
            "replica_code": source[0]}


def one(cfg: dict) -> dict:
    """One run in a fresh local Ray instance, with the bucketserve on PYTHONPATH."""
    import ray
    from ray import serve

    from bucketserve.server.ray_deploy import EngineReplica, Ingress, MetricsHub

    class StubReplica(EngineReplica):
        def __init__(self, events: int, step_s: float, batch_wait_s: float) -> None:
            module = sys.modules[EngineReplica.__module__].__file__
            self.app = self.api = stub_app(events, step_s, module)  # old revisions: .app
            self.batch_wait_s = batch_wait_s  # (the old revision never reads it)

        def check_health(self) -> None:
            pass

        async def __del__(self) -> None:
            pass

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        zero = {"num_cpus": 0}
        hub = serve.deployment(MetricsHub, ray_actor_options=zero).bind()
        engine = serve.deployment(StubReplica).options(
            max_ongoing_requests=cfg["clients"] + 8, ray_actor_options=zero).bind(
            cfg["events"], cfg["step_ms"] / 1e3, cfg["batch_wait_ms"] / 1e3)
        ingress = serve.deployment(serve.ingress()(Ingress)).options(
            num_replicas=cfg["ingress"], max_ongoing_requests=100_000,
            ray_actor_options=zero).bind(engine, hub, {})
        serve.run(ingress, name="stub", route_prefix="/")
        return asyncio.run(drive(f"http://127.0.0.1:{port}/v1/completions", cfg["clients"]))
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="a454bb1", help="the revision before the change")
    ap.add_argument("--variant", action="append", metavar="NAME=REV:BATCH_WAIT_MS:INGRESS",
                    help="a variant to run (REV old or new; BATCH_WAIT_MS: the replica's --stream-batch-ms, "
                         "unused by the old revision); default: before=old:0:1, "
                         "after=new:2:1")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--events", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run, JSON config
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(json.loads(args.one))), flush=True)
        return 0
    variants = {}
    for spec in args.variant or ["before=old:0:1", "after=new:2:1"]:
        name, rest = spec.split("=", 1)
        rev, wait, ingress = rest.split(":")
        variants[name] = {"rev": rev, "batch_wait_ms": float(wait), "ingress": int(ingress)}
    work = Path(tempfile.mkdtemp(prefix="ray-stream-"))
    (work / "old").mkdir()
    archive = subprocess.run(["git", "archive", args.old, "bucketserve"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(work / "old")], input=archive, check=True)
    trees = {"old": work / "old", "new": ROOT}
    runs: dict[str, list[dict]] = {n: [] for n in variants}
    for rep in range(args.reps):
        for name, v in variants.items():
            cfg = {**v, "clients": args.clients, "events": args.events,
                   "step_ms": args.step_ms}
            env = dict(os.environ, PYTHONPATH=f"{trees[v['rev']]}:{ROOT / 'bench'}",
                       RAY_USAGE_STATS_ENABLED="0")
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out",
                                   "-", "--one",
                                   json.dumps(cfg)], env=env, cwd=work, capture_output=True,
                                  text=True, timeout=900)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")),
                        None)
            if line is None:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
                raise RuntimeError(f"run {name} {rep} failed (exit {proc.returncode})")
            result = json.loads(line.removeprefix("RESULT "))
            if not result["replica_code"].startswith(str(trees[v["rev"]])):
                raise RuntimeError(f"{name}: the replica ran {result['replica_code']}")
            runs[name].append(result)
            print(f"rep {rep} {name}: {result['events_per_s']:.0f} events/s, TTFT p50 "
                  f"{result['ttft_p50_ms']:.0f} ms, {result['ms_per_event_p50']:.1f} ms/event, "
                  f"lone stream {result['lone_ms_per_event']:.2f} ms/event", flush=True)
    keys = ("events_per_s", "ttft_p50_ms", "ms_per_event_p50", "lone_ttft_ms",
            "lone_ms_per_event")
    medians = {n: {k: statistics.median(r[k] for r in rs) for k in keys}
               for n, rs in runs.items()}
    first = next(iter(medians))
    result = {"old": args.old, "new": subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                  cwd=ROOT).stdout.strip() + (" + working tree" if subprocess.run(
                      ["git", "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True, cwd=ROOT).stdout.strip() else ""),
              "cpu": _cpu(), "load_average": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "clients": args.clients, "events": args.events, "step_ms": args.step_ms,
              "variants": variants, "runs": runs, "medians": medians,
              f"events_per_s_over_{first}": {n: m["events_per_s"] / medians[first]
                                             ["events_per_s"] for n, m in medians.items()},
              "command": " ".join(["bench/ray_stream_cpu.py", *(argv or sys.argv[1:])])}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in medians.items():
        print(f"{name:12} {m['events_per_s']:9.0f} events/s  TTFT p50 {m['ttft_p50_ms']:7.0f} ms"
              f"  {m['ms_per_event_p50']:6.2f} ms/event  lone stream: TTFT "
              f"{m['lone_ttft_ms']:.1f} ms, {m['lone_ms_per_event']:.2f} ms/event")
    return 0


if __name__ == "__main__":
    sys.exit(main())
