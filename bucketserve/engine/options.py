"""What starts an engine core: the model, where it runs and the overrides of the buckets file,
as one picklable value (`bucketserve serve`'s options, server/options.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """The engine's start-up options; build_engine, spawn_core, ProcessCore and
    AsyncEngine.spawn take one (a test's or benchmark's Seams stay a separate argument)."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    buckets_path: str | None = None  # None: the packaged buckets.toml
    log_level: str = "info"  # the core process's logging level
    nvtx: bool = False  # an NVTX range per engine step (LLMEngine nvtx)
    quantization: str | None = None  # --quantization (None: the TOML's model.quantization)
    kv_cache_dtype: str | None = None  # --kv-cache-dtype (None: the TOML's kv_cache.dtype)
    cpu_isa: str | None = None  # --cpu-isa (None: the TOML's cpu.isa)
    cpu_gemm: str | None = None  # --cpu-gemm (None: the TOML's cpu.gemm)
    cpu_threads: int | None = None  # --cpu-threads (None: the TOML's cpu.threads)
    structured_backend: str | None = None  # --structured-backend (None: the TOML's)
    # front ends with an encoder on the GPU: the bytes they hold, known at spawn (one front
    # end), or reported by `frontend_gpu_count` workers in `frontend_gpu_dir` before the
    # core sizes its KV pool (engine/kv_budget.py wait_frontend_reports)
    frontend_gpu_bytes: int = 0
    frontend_gpu_count: int = 0
    frontend_gpu_dir: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """From `bucketserve serve`'s parsed options (server/options.py)."""
        return cls(model=args.model, device=args.device, dtype=args.dtype,
                   buckets_path=args.buckets, log_level=args.log_level, nvtx=args.nvtx,
                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   cpu_isa=args.cpu_isa, cpu_gemm=args.cpu_gemm, cpu_threads=args.cpu_threads,
                   structured_backend=getattr(args, "structured_backend", None))
