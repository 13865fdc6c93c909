"""`bucketserve serve --api-workers N`: N HTTP front-end processes, one engine core.

Measured on the H200 host, one front-end process (HTTP, tokenization, detokenization, SSE)
was the limit at 256 streams, not the engine (bench/frontend_capacity.py measures what one
front end sustains on a CPU). So the front end can run in N processes:

    this process (supervisor)  --spawns-->  engine core   (engine/core.py)
                               --spawns-->  worker 0..N-1 (each: uvicorn + AsyncEngine)

- Every worker binds the same host:port with SO_REUSEPORT; the kernel spreads connections
  over them. Each worker binds its own pair of ZeroMQ sockets; the core connects to all of
  them: it reads every worker's requests from one fair-queued socket and sends worker k one
  StepOutputs per step with the outputs of worker k's requests (engine/core.py, Router).
  Request ids carry the worker ("cmpl-w1-..."), so they are unique across workers.
- /health and /metrics are answered by whichever worker gets the connection: engine series
  are whole in every worker, per-request series are summed over workers (server/metrics.py).
- Back-pressure: each worker admits against the core's waiting queue as of its latest step
  plus its own requests sent since, so under a burst the N workers together may queue up to
  N - 1 steps' worth of requests past max_waiting before the next step's depth reaches them.
- SIGTERM / SIGINT to this process goes to every worker; each drains as a single server
  does (--shutdown-timeout), then tells the core it is done; the core exits once every
  worker has, and this process exits 0.
- The core dies: every worker sees it (a pidfd), fails its requests in flight, stops
  answering /health with 200 and exits 1; this process then exits 1. A worker dies: the
  others are stopped the same way and this process exits non-zero (a supervisor restarts
  the whole server; a core that kept the dead worker's requests would waste the GPU).
- Embeddings: every worker loads its own encoder and batcher (MiniLM: 90 MB of weights; on
  CUDA each process captures its own graphs; there the workers load it before they attach
  and report what they hold, and the core waits for the N reports before it sizes its KV
  pool: engine/kv_budget.py wait_frontend_reports), so the N front ends also share the
  /v1/embeddings work: each batches the requests of its own connections (batches are up to
  N times smaller at the same load; on a GPU the host side, not the device, was the limit).
  On the CPU each worker's encoder gets cores / N torch threads. The embedding series of
  /metrics (bucketserve_embedding_*) are summed over the workers (each publishes its
  batcher's totals every 50 ms: server/embeddings.py BatcherStatsCollector), and each
  embeddings response names its worker in the header X-Bucketserve-Worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import wait

from bucketserve.engine.faults import Seams

log = logging.getLogger("bucketserve.server")

STOP_CORE_S = 10.0  # after the last worker: how long the core gets to exit by itself


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket that other processes may bind too."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


def serve_workers(args: argparse.Namespace, load_add_ons: Callable, run_http: Callable,
                  seams: Seams | None = None) -> int:
    """`load_add_ons` and `run_http`: server/cli.py's, run in every worker (passed in, so that
    this module does not import the CLI that imports it)."""
    from bucketserve.buckets import ConfigError, load_buckets
    from bucketserve.engine.core_client import spawn_core
    from bucketserve.engine.options import EngineOptions
    from bucketserve.server.startup import frontend_uses_gpu

    n = args.api_workers
    if args.engine_in_process:
        print("bucketserve: error: --api-workers > 1 needs the engine core in its own process",
              file=sys.stderr)
        return 2
    try:
        load_buckets(args.buckets)  # a bad file fails here, before a process is started
        listening_socket(args.host, args.port).close()  # the port is ours to share
    except (ConfigError, FileNotFoundError, ValueError, OSError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix="bucketserve-")
    metrics_dir = os.path.join(directory, "metrics")
    os.mkdir(metrics_dir)
    options = EngineOptions.from_args(args)
    if frontend_uses_gpu(args):  # each worker's encoder loads first and reports its memory
        options = dataclasses.replace(options, frontend_gpu_count=n, frontend_gpu_dir=directory)
    core = spawn_core(options, directory, n, seams)
    log.info("engine core started in process %d; %d API workers", core.pid, n)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the workers
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=run_worker,
                           args=(args, k, directory, core.pid, load_add_ons, run_http, seams),
                           name=f"bucketserve-api-{k}") for k in range(n)]
    stopping = False

    def stop_workers(sig: int = signal.SIGTERM, frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for w in workers:
            if w.pid is not None and w.exitcode is None:
                try:
                    os.kill(w.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, stop_workers)
    signal.signal(signal.SIGINT, stop_workers)
    for w in workers:
        w.start()
    code = 0
    pending = {w.sentinel: w for w in workers}
    core_running = True
    try:
        while pending:
            watch = list(pending) + ([core.sentinel] if core_running else [])
            for ready in wait(watch, timeout=1.0):
                if ready == core.sentinel:
                    core_running = False
                    core.join()
                    if not stopping:
                        log.error("engine core exited (code %s): the workers fail their requests "
                                  "and exit", core.exitcode)
                        code = code or 1
                    continue
                w = pending.pop(ready)
                w.join()
                if w.exitcode != 0:
                    if not stopping:
                        log.error("API worker %s exited with %s: stopping the server", w.name,
                                  w.exitcode)
                    code = code or (w.exitcode if w.exitcode and w.exitcode > 0 else 1)
                    stop_workers()
                elif not stopping:  # a worker that stops by itself: the server is not whole
                    code = code or 1
                    stop_workers()
    finally:
        stop_workers()
        for w in workers:
            w.join(5.0)
            if w.exitcode is None:
                w.kill()
                w.join()
        core.join(STOP_CORE_S)
        if core.exitcode is None:
            core.kill()
            core.join()
        shutil.rmtree(directory, ignore_errors=True)
    if code:
        log.error("exiting with status %d", code)
    else:
        log.info("bye")
    return code


def run_worker(args: argparse.Namespace, index: int, directory: str, core_pid: int,
               load_add_ons: Callable, run_http: Callable, seams: Seams | None = None) -> None:
    """Front end `index`: attach to the core, serve HTTP on the shared port, exit with the
    server's status (1 when the core died, 2 when it never became ready)."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import torch

    from bucketserve.buckets import ConfigError, load_buckets
    from bucketserve.engine.async_engine import AsyncEngine
    from bucketserve.engine.core_client import CoreStartError, ProcessCore
    from bucketserve.kernels.cpu_threads import usable_cores
    from bucketserve.server.protocol import set_worker_id_tag
    from bucketserve.server.startup import frontend_uses_gpu

    embeds = args.embedding_model.lower() != "none"
    # no generation work here; the embedding encoder's share of the cores on a CPU
    threads = max(1, usable_cores() // args.api_workers)
    torch.set_num_threads(threads if embeds and args.device == "cpu" else 1)
    set_worker_id_tag(index)
    add_ons = None
    if frontend_uses_gpu(args):
        # the encoder first: the core waits for every worker's report of what it holds on
        # the GPU before it sizes its KV pool (engine/kv_budget.py wait_frontend_reports)
        from bucketserve.engine.kv_budget import process_gpu_bytes, write_frontend_report

        try:
            add_ons = load_add_ons(args, load_buckets(args.buckets), seams)
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            print(f"bucketserve: error: {exc}", file=sys.stderr)
            sys.exit(2)
        held = process_gpu_bytes(args.device)
        log.info("encoders loaded: this front end holds %.2f GiB of the GPU", held / 2**30)
        write_frontend_report(directory, index, held)
    try:
        core = ProcessCore.attach(directory, index, core_pid)
    except CoreStartError as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if index == 0:
        log.info("engine core ready in process %d", core.pid)
    from bucketserve.kernels.cpu_threads import apply_frontend_layout

    apply_frontend_layout(args.device)  # BUCKETSERVE_CPU_AFFINITY; the core pinned itself
    engine = AsyncEngine(core, seams.faults if seams else None)
    try:
        if add_ons is None:
            add_ons = load_add_ons(args, load_buckets(args.buckets,
                                                      max_model_len=engine.max_model_len), seams)
        sock = listening_socket(args.host, args.port)
    except (ConfigError, FileNotFoundError, ValueError, OSError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        core.stop(1.0)
        sys.exit(2)
    sys.exit(run_http(args, engine, add_ons, sockets=[sock]))
