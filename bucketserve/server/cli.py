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
import time
from types import FrameType

from bucketserve.server.app import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ENGINE_STOP_S,
    AddOn,
    begin_drain,
    create_app,
)

log = logging.getLogger("bucketserve.server")

DTYPES = ("auto", "float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bucketserve", description="bucketserve inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="TCP port to bind")
    s.add_argument("--model", default="smollm2-135m-instruct",
                   help="generative model: a registry name, a Hugging Face directory or a .gguf file")
    s.add_argument("--embedding-model", default="all-minilm-l6-v2",
                   help="model for /v1/embeddings; 'none' disables the endpoint")
    s.add_argument("--buckets", default=None, metavar="FILE",
                   help="buckets / scheduler TOML; default: the file shipped in the package")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    s.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and KV cache dtype; auto = float32 on cpu, bfloat16 on cuda")
    s.add_argument("--rerank-model", default=None, metavar="DIR",
                   help="BERT cross-encoder (HF BertForSequenceClassification directory) for "
                        "/v1/rerank and /v1/score; default: none")
    s.add_argument("--embedding-dtype", choices=DTYPES, default=None,
                   help="embedding encoder dtype; default: --dtype, where auto = float32 on cpu, "
                        "float16 on cuda")
    s.add_argument("--api-key", default=os.environ.get("BUCKETSERVE_API_KEY"),
                   help="when set, every /v1 route needs 'Authorization: Bearer KEY' "
                        "(falls back to $BUCKETSERVE_API_KEY)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are refused with 413")
    s.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a client gets to send its whole request body (else 408)")
    s.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--engine-in-process", action="store_true",
                   help="run the engine core in a thread of the HTTP server's process instead of "
                        "its own process")
    s.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSON line per finished request (timings, lengths, bucket)")
    s.add_argument("--request-log-text", action="store_true",
                   help="with --request-log: also log the generated text (never logged otherwise)")
    s.add_argument("--nvtx", action="store_true", help="NVTX range per engine step (cuda; for Nsight Systems)")
    s.add_argument("--api-workers", type=_api_workers, default=1, metavar="N",
                   help="HTTP front-end processes sharing the port (SO_REUSEPORT), all fed by the "
                        "one engine core; 'auto': one per 4 CPU cores, at most 8. With embeddings, "
                        "each worker loads its own encoder and batches its own requests")
    from bucketserve.bench.cli import add_bench_parser, add_tune_parser

    add_bench_parser(sub)
    add_tune_parser(sub)
    return parser


def _api_workers(value: str) -> int:
    if value == "auto":
        return max(1, min(8, (os.cpu_count() or 1) // 4))
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return n


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def load_engine(args: argparse.Namespace):
    """The engine core (its own process unless --engine-in-process), loaded and warmed up,
    and the buckets config; returns a started-not-yet AsyncEngine."""
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.async_engine import AsyncEngine
    from bucketserve.engine.core import build_engine

    load_buckets(args.buckets)  # a bad file fails here, before a process is started
    if args.engine_in_process:
        engine = AsyncEngine.in_process(build_engine(args.model, args.device, args.dtype,
                                                     args.buckets, args.nvtx))
    else:
        t0 = time.perf_counter()
        engine = AsyncEngine.spawn(args.model, args.device, args.dtype, args.buckets,
                                   args.log_level, args.nvtx)
        log.info("engine core ready in process %d after %.1f s", engine.core.pid,
                 time.perf_counter() - t0)
    return engine, load_buckets(args.buckets, max_model_len=engine.max_model_len)


def load_add_ons(args: argparse.Namespace, buckets) -> list[AddOn]:
    """The embeddings and rerank services, when their models are asked for."""
    add_ons: list[AddOn] = []
    name = args.embedding_dtype or args.dtype
    # float16 keeps more mantissa than bfloat16: the encoder's vectors stay within cosine
    # 0.9999 of float32 ones
    dtype = (_torch_dtype("float16", args.device) if name == "auto" and args.device == "cuda"
             else _torch_dtype(name, args.device))
    if args.embedding_model.lower() != "none":
        from bucketserve.server import embeddings  # a broken import must fail the start, loudly
        t0 = time.perf_counter()
        add_on = embeddings.build_add_on(args.embedding_model, device=args.device, dtype=dtype,
                                         buckets=buckets)
        log.info("embedding model %s loaded in %.1f s", add_on.model_name,
                 time.perf_counter() - t0)
        add_ons.append(add_on)
    if getattr(args, "rerank_model", None):
        from bucketserve.server import rerank

        t0 = time.perf_counter()
        add_on = rerank.build_add_on(args.rerank_model, device=args.device, dtype=dtype,
                                     buckets=buckets)
        log.info("rerank model %s loaded in %.1f s", add_on.model_name, time.perf_counter() - t0)
        add_ons.append(add_on)
    return add_ons


def serve(args: argparse.Namespace) -> int:
    from bucketserve.buckets import ConfigError
    from bucketserve.engine.core_client import CoreStartError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from installed packages only
    if args.api_workers > 1:
        from bucketserve.server.workers import serve_workers

        return serve_workers(args)
    try:
        engine, buckets = load_engine(args)
    except (ConfigError, FileNotFoundError, ValueError, CoreStartError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        add_ons = load_add_ons(args, buckets)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        if not args.engine_in_process:
            engine.core.stop(5.0)
        return 2
    if not add_ons and not args.engine_in_process:
        import torch

        torch.set_num_threads(1)  # no model work in this process: leave the cores to the engine
    if args.device == "cpu" and not args.engine_in_process:
        from bucketserve.kernels.cpu_threads import apply_frontend_layout

        apply_frontend_layout()  # BUCKETSERVE_CPU_AFFINITY; the core pinned itself
    return run_http(args, engine, add_ons)


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        from bucketserve.bench.cli import run_bench

        return run_bench(args)
    if args.command == "tune-buckets":
        from bucketserve.bench.cli import run_tune

        return run_tune(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
