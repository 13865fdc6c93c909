"""The command line's options: `bucketserve serve` and its subcommands' parsers (server/cli.py
runs them; the Ray deployment (server/ray_deploy.py) reads the same defaults)."""

from __future__ import annotations

import argparse
import os

from bucketserve.buckets.config import CPU_GEMMS, CPU_ISAS, QUANTIZATION_MODES, STRUCTURED_BACKENDS
from bucketserve.server.app import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES

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
    s.add_argument("--quantization", choices=QUANTIZATION_MODES, default=None,
                   help="decoder projection weights: fp8 (W8A8; GPUs of compute capability "
                        ">= 8.9), q4_1 (CPU: a GGUF's own Q4_1 blocks, float32 math), int8 "
                        "(CPU: int8 per output channel, dynamic int8 activations); default: "
                        "the buckets file's model.quantization (none)")
    s.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default=None,
                   help="KV pool element type; auto = --dtype; default: the buckets file's "
                        "kv_cache.dtype (auto)")
    s.add_argument("--cpu-isa", choices=CPU_ISAS, default=None,
                   help="instruction set of the CPU kernels (torch, oneDNN, MKL and ours): auto "
                        "(the host's best) or a lower one forced; default: the buckets file's "
                        "cpu.isa (auto)")
    s.add_argument("--cpu-gemm", choices=CPU_GEMMS, default=None,
                   help="packed sgemm of the CPU projections; auto = the faster measured at "
                        "start-up; default: the buckets file's cpu.gemm (auto)")
    s.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="compute threads of the CPU engine; default: the buckets file's "
                        "cpu.threads (auto: one per engine core)")
    s.add_argument("--structured-backend", choices=STRUCTURED_BACKENDS, default=None,
                   help="grammar library of structured output: xgrammar or llguidance "
                        "(JSON schemas, regexes and choices; EBNF grammars stay on xgrammar); "
                        "default: the buckets file's structured.backend (xgrammar)")
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
    s.add_argument("--api-workers", type=_api_workers, default="auto", metavar="N",
                   help="HTTP front-end processes sharing the port (SO_REUSEPORT), all fed by the "
                        "one engine core; 'auto': sized from the device and the CPU cores (see "
                        "frontend_workers; the start-up log says how many and why). With "
                        "embeddings, each worker loads its own encoder and batches its own requests")
    add_ray_options(s)
    from bucketserve.bench.cli import add_bench_parser, add_tune_parser

    add_bench_parser(sub)
    add_tune_parser(sub)
    return parser


def add_ray_options(s: argparse.ArgumentParser) -> None:
    """Scale-out on Ray Serve (server/ray_deploy.py, docs/ray.md; needs `pip install .[ray]`)."""
    g = s.add_argument_group("Ray Serve (scale-out; docs/ray.md)")
    g.add_argument("--replicas", type=_positive_int, default=None, metavar="N",
                   help="serve through Ray Serve with N engine replicas (each its own engine "
                        "core, KV pool and device share) behind this one endpoint")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster (e.g. 10.0.0.1:6379) instead "
                        "of starting a local Ray instance")
    g.add_argument("--min-replicas", type=_non_negative_int, default=None, metavar="A",
                   help="with --replicas: autoscale between A and --max-replicas replicas")
    g.add_argument("--max-replicas", type=_positive_int, default=None, metavar="B",
                   help="with --replicas: autoscale up to B replicas")
    g.add_argument("--gpus-per-replica", type=float, default=1.0,
                   help="with --replicas and --device cuda: GPUs per replica (0.5: two share one)")
    g.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="with --replicas: CPU cores Ray reserves per replica")
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="with --replicas: requests Ray queues when every replica is full, "
                        "beyond which it answers 503 + Retry-After; default: the buckets "
                        "TOML's scheduler.max_waiting; -1: no limit")
    g.add_argument("--request-router", default=None, metavar="MODULE:CLASS",
                   help="with --replicas: a Ray Serve RequestRouter class instead of Ray's "
                        "power-of-two-choices (e.g. ray.serve.llm.request_router:"
                        "PrefixCacheAffinityRouter, which needs ray[llm]; it reads the prompt "
                        "the ingress hands along)")
    g.add_argument("--ingress-replicas", type=_positive_int, default=1, metavar="N",
                   help="with --replicas: replicas of the ingress deployment (each one "
                        "process that forwards requests and their streams to the engines)")
    g.add_argument("--stream-batch-ms", type=_non_negative_float, default=2.0, metavar="MS",
                   help="with --replicas: a replica sends a stream's SSE events to the ingress "
                        "in batches, each what the engine produced within MS of the batch's "
                        "first event (the first token goes at once; 0: no waiting, only what "
                        "is already queued)")
    g.add_argument("--ray-ingress", choices=("proxy", "haproxy"), default="proxy",
                   help="with --replicas: how HTTP reaches the replicas. proxy: Ray Serve's "
                        "Python proxy and an ingress deployment relay every request and stream "
                        "(a replica that dies mid-stream gives its clients an SSE error event); "
                        "haproxy: Ray Serve's HAProxy direct ingress, each replica serves HTTP "
                        "itself behind HAProxy (no Python hop; a replica that dies mid-stream "
                        "cuts its streams). docs/ray.md")
    g.add_argument("--proxy-location", choices=("HeadOnly", "EveryNode"), default=None,
                   help="with --replicas: where Ray Serve runs HTTP proxies; default HeadOnly "
                        "for a local Ray instance, EveryNode with --ray-address")


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def _non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value!r}")
    return n


def _non_negative_float(value: str) -> float:
    x = float(value)
    if not x >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value!r}")
    return x


def _api_workers(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return n


# cuda, `auto`: one front-end process per this many cores, at most CUDA_MAX_FRONT_ENDS. H200
# host, 16 cores, 135M shape at 256 streams: 1 front end 20k output tok/s, 4 front ends 47k.
