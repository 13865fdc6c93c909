"""What `bucketserve serve` starts, from its parsed options: the engine core and the add-ons
(embeddings). Shared by the single server and its API workers (server/cli.py,
server/workers.py) and the Ray replicas (server/ray_deploy.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from bucketserve.engine.faults import Seams
from bucketserve.server.app import AddOn

log = logging.getLogger("bucketserve.server")


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def check_quantization(args: argparse.Namespace) -> None:
    """Refuses here, before a process starts (a one-line ValueError): FP8 (--quantization /
    --kv-cache-dtype, or the buckets file's keys) on the CPU, the CPU weight formats (q4_1,
    int8) on CUDA or off float32, and q4_1 for a model that is not a GGUF of Q4_1 projections
    (models/loader.quantization_refusal). On a GPU the core process checks the device's
    compute capability for FP8 (kernels/quant.resolve_quant_plan)."""
    from bucketserve.buckets import load_buckets
    from bucketserve.kernels.cpu_quant import CPU_MODES
    from bucketserve.kernels.quant import resolve_quant_plan
    from bucketserve.models.loader import quantization_refusal
    from bucketserve.models.registry import resolve

    b = load_buckets(args.buckets)
    quantization = args.quantization or b.quantization
    if args.device == "cuda" and quantization not in CPU_MODES:
        return
    resolve_quant_plan(args.device, quantization, args.kv_cache_dtype or b.kv_cache_dtype)
    if quantization not in CPU_MODES:
        return
    why = quantization_refusal(resolve(args.model).path, quantization, args.device,
                               _torch_dtype(args.dtype, args.device))
    if why is not None:
        raise ValueError(why)


def prepare_cpu(args: argparse.Namespace) -> None:
    """--device cpu: checks the CPU ISA (--cpu-isa, or the buckets file's cpu.isa) and, where a
    level below the host's is forced, holds torch, oneDNN and MKL to it through their
    environment variables (kernels/cpu_plan.isa_environment), set here, before any of them
    dispatches in this process or in the engine core process started from it. Raises
    CpuPlanError (a one-line ValueError) for an ISA the host lacks."""
    if args.device != "cpu":
        return
    import os

    from bucketserve.buckets import load_buckets
    from bucketserve.kernels.cpu_plan import isa_environment

    env = isa_environment(args.cpu_isa or load_buckets(args.buckets).cpu_isa)
    os.environ.update(env)
    if env:
        log.info("CPU ISA forced: %s", " ".join(f"{k}={v}" for k, v in env.items()))


def frontend_uses_gpu(args: argparse.Namespace) -> bool:
    """Whether the front end loads an encoder (embeddings, rerank) onto a GPU: then it loads
    before the engine core sizes its KV pool, and the core counts what it holds."""
    return args.device.startswith("cuda") and (args.embedding_model.lower() != "none"
                                               or bool(args.rerank_model))


def load_engine(args: argparse.Namespace, seams: Seams | None = None,
                frontend_gpu_bytes: int = 0):
    """The engine core (its own process unless --engine-in-process), loaded and warmed up,
    and the buckets config; returns a started-not-yet AsyncEngine. `seams`: what a test or
    benchmark passes in (engine/faults.py; None in production). `frontend_gpu_bytes`: what
    this front end already holds on the GPU (its encoders), counted in the core's share."""
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.async_engine import AsyncEngine
    from bucketserve.engine.core import build_engine
    from bucketserve.engine.options import EngineOptions

    load_buckets(args.buckets)  # a bad file fails here, before a process is started
    seams = seams or Seams()
    options = dataclasses.replace(EngineOptions.from_args(args),
                                  frontend_gpu_bytes=frontend_gpu_bytes)
    if args.engine_in_process:
        core = build_engine(options, seams.faults)
        if seams.prepare_engine is not None:
            seams.prepare_engine(core)
        engine = AsyncEngine.in_process(core)
    else:
        t0 = time.perf_counter()
        engine = AsyncEngine.spawn(options, seams)
        log.info("engine core ready in process %d after %.1f s", engine.core.pid,
                 time.perf_counter() - t0)
    return engine, load_buckets(args.buckets, max_model_len=engine.max_model_len)


def load_add_ons(args: argparse.Namespace, buckets, seams: Seams | None = None) -> list[AddOn]:
    """The embeddings and rerank services, when their models are asked for."""
    add_ons: list[AddOn] = []
    name = args.embedding_dtype or args.dtype
    # float16 keeps more mantissa than bfloat16: the encoder's vectors stay within cosine
    # 0.9999 of float32 ones
    dtype = (_torch_dtype("float16", args.device) if name == "auto" and args.device == "cuda"
             else _torch_dtype(name, args.device))
    faults = seams.faults if seams else None
    if args.embedding_model.lower() != "none":
        from bucketserve.server import embeddings  # a broken import must fail the start, loudly

        t0 = time.perf_counter()
        add_on = embeddings.build_add_on(args.embedding_model, device=args.device, dtype=dtype,
                                         buckets=buckets, faults=faults)
        log.info("embedding model %s loaded in %.1f s", add_on.model_name,
                 time.perf_counter() - t0)
        add_ons.append(add_on)
    if args.rerank_model:
        from bucketserve.server import rerank

        t0 = time.perf_counter()
        add_on = rerank.build_add_on(args.rerank_model, device=args.device, dtype=dtype,
                                     buckets=buckets)
        log.info("rerank model %s loaded in %.1f s", add_on.model_name, time.perf_counter() - t0)
        add_ons.append(add_on)
    return add_ons
