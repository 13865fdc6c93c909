"""`bucketserve serve`: load the model, warm up, then serve the OpenAI API with uvicorn.

The engine core runs in its own process (engine/core.py; `--engine-in-process`: a thread),
which loads and warms up the model before uvicorn binds the port, so a client that can
connect is served at once. SIGTERM / SIGINT: uvicorn stops accepting; requests still
running get --shutdown-timeout seconds to finish, then they are aborted (their clients get
an error, not silence); the engine stops; the process exits 0. If the engine core dies,
open requests get an error, /health answers 503 and the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from types import FrameType

from bucketserve.engine.faults import Seams
from bucketserve.kernels.cpu_threads import usable_cores
from bucketserve.server.app import ENGINE_STOP_S, AddOn, begin_drain, create_app
from bucketserve.server.options import DTYPES, build_parser  # noqa: F401 (the CLI's API)
from bucketserve.server.startup import (
    check_quantization,
    frontend_uses_gpu,
    load_add_ons,
    load_engine,
    prepare_cpu,
)

log = logging.getLogger("bucketserve.server")

CORES_PER_FRONT_END = 2
CUDA_MAX_FRONT_ENDS = 8


def frontend_workers(cores: int, device: str) -> tuple[int, str]:
    """`--api-workers auto`: how many HTTP front-end processes to run, and why (logged).

    cuda: a GPU engine outruns one front-end process (HTTP, tokenization, detokenization,
    SSE: each a core's worth of Python) at high concurrency, so one front end per
    CORES_PER_FRONT_END cores, at most CUDA_MAX_FRONT_ENDS (the engine core and the clients'
    side keep the rest). cpu: the engine's forward uses every core and produces far fewer
    tokens per second than one front end sustains, so one front end (a second one only takes
    cores from the engine)."""
    if device == "cuda":
        n = max(1, min(CUDA_MAX_FRONT_ENDS, cores // CORES_PER_FRONT_END))
        return n, (f"cuda engine, {cores} CPU cores: one front end per {CORES_PER_FRONT_END} "
                   f"cores, at most {CUDA_MAX_FRONT_ENDS}")
    return 1, (f"cpu engine, {cores} CPU cores: the engine needs the cores and one front end "
               "keeps up with it")


def resolve_api_workers(args: argparse.Namespace) -> None:
    """Turns `--api-workers auto` into a number (in `args`) and logs the front end's size."""
    if args.api_workers != "auto":
        why = f"--api-workers {args.api_workers}"
    elif args.engine_in_process:
        args.api_workers, why = 1, "--engine-in-process: the engine shares the one front end"
    else:
        args.api_workers, why = frontend_workers(usable_cores(), args.device)
        why = "--api-workers auto: " + why
    log.info("front end: %d API worker process%s (%s)", args.api_workers,
             "" if args.api_workers == 1 else "es", why)


def serve(args: argparse.Namespace, seams: Seams | None = None) -> int:
    from bucketserve.buckets import ConfigError, load_buckets
    from bucketserve.engine.core_client import CoreStartError
    from bucketserve.kernels import pdl

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from installed packages only
    try:
        pdl.check_environment()  # (read where the kernels load: in the core, on a GPU)
        check_quantization(args)
        prepare_cpu(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2
    ray_options = (args.replicas, args.ray_address, args.min_replicas, args.max_replicas)
    if any(v is not None for v in ray_options):
        return serve_on_ray(args)
    resolve_api_workers(args)
    if args.api_workers > 1:
        from bucketserve.server.workers import serve_workers

        return serve_workers(args, load_add_ons, run_http, seams)
    # an encoder on the GPU loads first, so that the core's KV pool leaves room for it
    early = frontend_uses_gpu(args) and not args.engine_in_process
    add_ons, held = None, 0
    if early:
        try:
            add_ons = load_add_ons(args, load_buckets(args.buckets), seams)
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            print(f"bucketserve: error: {exc}", file=sys.stderr)
            return 2
        from bucketserve.engine.kv_budget import process_gpu_bytes

        held = process_gpu_bytes(args.device)
    try:
        engine, buckets = load_engine(args, seams, frontend_gpu_bytes=held)
    except (ConfigError, FileNotFoundError, ValueError, CoreStartError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        if add_ons is None:
            add_ons = load_add_ons(args, buckets, seams)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        if not args.engine_in_process:
            engine.core.stop(5.0)
        return 2
    if not add_ons and not args.engine_in_process:
        import torch

        torch.set_num_threads(1)  # no model work in this process: leave the cores to the engine
    if not args.engine_in_process:
        from bucketserve.kernels.cpu_threads import apply_frontend_layout

        apply_frontend_layout(args.device)  # BUCKETSERVE_CPU_AFFINITY; the core pinned itself
    return run_http(args, engine, add_ons)


def serve_on_ray(args: argparse.Namespace) -> int:
    """--replicas / --ray-address / --min-replicas / --max-replicas: Ray Serve (ray_deploy.py)."""
    try:
        from bucketserve.server.ray_deploy import ROUTER_NEEDS_PROXY, serve_ray
    except ImportError as exc:
        print(f"bucketserve: error: --replicas needs Ray Serve (pip install "
              f"'bucketserve[ray]'): {exc}", file=sys.stderr)
        return 2
    if args.replicas is None:
        args.replicas = max(1, args.min_replicas or 1)
    if (args.min_replicas is not None and args.max_replicas is not None
            and args.min_replicas > args.max_replicas):
        print(f"bucketserve: error: --min-replicas {args.min_replicas} is over --max-replicas "
              f"{args.max_replicas}", file=sys.stderr)
        return 2
    if args.ray_ingress == "haproxy" and args.request_router:
        print(f"bucketserve: error: {ROUTER_NEEDS_PROXY}", file=sys.stderr)
        return 2
    return serve_ray(args)


def run_http(args: argparse.Namespace, engine, add_ons: list[AddOn],
             sockets: list | None = None) -> int:
    """Serves the app over `engine` until SIGTERM / SIGINT (0) or the engine's death (1).
    `sockets`: already bound listening sockets (the --api-workers processes), else
    --host / --port."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    from bucketserve.server.context import ServerContext

    ctx = ServerContext(engine, shutdown_timeout_s=args.shutdown_timeout)
    if args.request_log:
        from bucketserve.server.request_log import RequestLog

        ctx.metrics.request_log = RequestLog(args.request_log, text=args.request_log_text)
    engine_failed = False

    def on_engine_dead() -> None:  # a part broke for good: drain, stop, exit 1
        nonlocal engine_failed
        engine_failed = True
        server.handle_exit(signal.SIGTERM, None)

    app = create_app(ctx, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     add_ons=add_ons, on_engine_dead=on_engine_dead,
                     body_timeout_s=args.body_timeout)
    # Our drain (begin_drain) decides when streams end; sse-starlette must not cut them first.
    AppStatus.disable_automatic_graceful_drain()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            asyncio.get_running_loop().call_soon_threadsafe(begin_drain, ctx)

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
        # uvicorn cancels whatever is left only after our own abort had time to answer.
        timeout_graceful_shutdown=args.shutdown_timeout + ENGINE_STOP_S)
    # uvicorn re-raises the caught signal once it is done; these handlers make that a no-op
    # so that a graceful stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)
    server = Server(config)
    # The engine core died: stop serving (a supervisor restarts us), exit non-zero.
    engine.on_dead.append(lambda: setattr(server, "should_exit", True))
    server.run(sockets=sockets)
    if engine.dead_reason is not None or engine_failed:
        log.error("exiting with status 1: the engine stopped (%s)",
                  engine.dead_reason or "by itself")
        return 1
    log.info("bye")
    return 0


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass


def main(argv: list[str] | None = None, seams: Seams | None = None) -> int:
    """`seams`: the stand-ins a test or benchmark passes in (bucketserve/bench/hooks.py)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args, seams)
    if args.command == "bench":
        from bucketserve.bench.cli import run_bench

        return run_bench(args)
    if args.command == "tune-buckets":
        from bucketserve.bench.cli import run_tune

        return run_tune(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
