"""`bucketserve serve`: load the model, warm up, then serve the OpenAI API with uvicorn.

The model is loaded and warmed up before uvicorn binds the port, so a client that can
connect is served at once. SIGTERM / SIGINT: uvicorn stops accepting; requests still
running get --shutdown-timeout seconds to finish, then they are aborted (their clients get
an error, not silence); the engine stops; the process exits 0.
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
    s.add_argument("--api-key", default=os.environ.get("BUCKETSERVE_API_KEY"),
                   help="when set, every /v1 route needs 'Authorization: Bearer KEY' "
                        "(falls back to $BUCKETSERVE_API_KEY)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are refused with 413")
    s.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--nvtx", action="store_true", help="NVTX range per engine step (cuda; for Nsight Systems)")
    return parser


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def load_engine(args: argparse.Namespace):
    """Model, buckets, KV pool and a warm-up generation; returns a started-not-yet AsyncEngine."""
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.async_engine import AsyncEngine
    from bucketserve.engine.llm_engine import LLMEngine
    from bucketserve.engine.sequence import SamplingParams
    from bucketserve.models import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model, device=args.device, dtype=_torch_dtype(args.dtype, args.device))
    t_model = time.perf_counter() - t0
    buckets = load_buckets(args.buckets, max_model_len=loaded.max_model_len)
    engine = LLMEngine(loaded, buckets, args.device, nvtx=args.nvtx)
    bm = engine.block_manager
    log.info("model %s loaded in %.1f s (max_model_len %d); KV pool: %d blocks of %d tokens",
             engine.model_name, t_model, engine.max_model_len, bm.num_usable_blocks, bm.block_size)
    t1 = time.perf_counter()
    # One short generation runs every stage once (prefill, decode, sampling, detokenizing).
    bos = engine.tokenizer.bos_token_id
    engine.generate([[bos if bos is not None else 0]], SamplingParams(max_tokens=2, temperature=0.0))
    log.info("warm-up done in %.2f s; buckets prepared (eager on %s): prefill %s, decode batch sizes %s",
             time.perf_counter() - t1, args.device, list(buckets.prefill_boundaries),
             list(buckets.decode_batch_sizes))
    log.info("scheduler: max_running %d, max_waiting %d, max_batched_tokens %d, queue timeout "
             "%.1f s, policy %s", buckets.max_running, buckets.max_waiting,
             engine.max_batched_tokens, buckets.queue_timeout_s, buckets.policy)
    return AsyncEngine(engine), buckets


def load_add_ons(args: argparse.Namespace, buckets) -> list[AddOn]:
    """The embeddings service, when its module exists and a model is asked for."""
    if args.embedding_model.lower() == "none":
        return []
    try:
        from bucketserve.server import embeddings
    except ImportError:
        log.warning("no embeddings module in this build: /v1/embeddings is not served")
        return []
    t0 = time.perf_counter()
    add_on = embeddings.build_add_on(args.embedding_model, device=args.device,
                                     dtype=_torch_dtype(args.dtype, args.device), buckets=buckets)
    log.info("embedding model %s loaded in %.1f s", add_on.model_name, time.perf_counter() - t0)
    return [add_on]


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    from sse_starlette.sse import AppStatus

    from bucketserve.buckets import ConfigError
    from bucketserve.server.context import ServerContext

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from installed packages only
    try:
        engine, buckets = load_engine(args)
        add_ons = load_add_ons(args, buckets)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2

    ctx = ServerContext(engine, shutdown_timeout_s=args.shutdown_timeout)
    app = create_app(ctx, api_key=args.api_key, max_body_bytes=args.max_body_bytes, add_ons=add_ons)
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
    Server(config).run()
    log.info("bye")
    return 0


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
