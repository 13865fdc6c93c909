"""The quantization plan: which weights and KV element types a served model uses, and how its
projections multiply, resolved once at start-up from the config and the device.

`resolve_quant_plan` is the one place that decides; the result is a frozen, printable object
that the engine logs and hands to the loader and the runner. Nothing here reads the
environment or keeps module state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bucketserve.buckets.config import KV_CACHE_DTYPES, QUANTIZATION_MODES
from bucketserve.kernels.cpu_quant import CPU_MODES
from bucketserve.kernels.fp8 import FP8_DTYPE

# FP8 tensor cores (and torch._scaled_mm): Ada (8.9), Hopper (9.0) and newer
FP8_MIN_CAPABILITY = (8, 9)


# --quantization -> how the projections multiply (QuantPlan.gemm)
_GEMMS = {"none": "dense", "fp8": "fp8-rowwise", "q4_1": "q4_1-blocks", "int8": "int8-dynamic"}


class QuantizationUnsupported(ValueError):
    """FP8 asked for on a device without FP8 tensor cores, or a CPU weight format (q4_1, int8)
    off the CPU; str() is one line saying why."""


@dataclass(frozen=True)
class QuantPlan:
    """weights: "none" | "fp8" | "q4_1" | "int8"; kv_cache: "auto" | "fp8"; gemm: how the
    decoder's projections multiply ("dense": the model dtype through cuBLAS / the CPU GEMMs;
    "fp8-rowwise": torch._scaled_mm on FP8 tensor cores, one scale per activation row and per
    weight output channel, bf16 out; "q4_1-blocks": the GGUF's Q4_1 blocks times float32
    activations, kernels/csrc/quant_gemm.c; "int8-dynamic": int8 per-channel weights, fbgemm's
    dynamic int8 linear); device: the device it was resolved for (with its compute
    capability)."""

    weights: str = "none"
    kv_cache: str = "auto"
    gemm: str = "dense"
    device: str = "cpu"

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's element type for a model computing in `model_dtype`."""
        return FP8_DTYPE if self.kv_cache == "fp8" else model_dtype

    def describe(self) -> str:
        # the CPU modes' kernels are the CPU plan's to name (CpuPlan.quant_kernels): they are
        # built for its -march, which is not chosen yet where this is logged
        return (f"quantization: weights {self.weights}, KV cache {self.kv_cache}, projections "
                f"{self.gemm} on {self.device}")


def _fp8_refusal(device: torch.device) -> str | None:
    """Why FP8 cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return (f"FP8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); "
                f"the device is {device.type}")
    if not torch.cuda.is_available():
        return "FP8 needs a CUDA GPU; torch sees none"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"FP8 needs FP8 tensor cores (compute capability >= 8.9); {name} has "
                f"{cap[0]}.{cap[1]}")
    return None


def resolve_quant_plan(device: torch.device | str, quantization: str = "none",
                       kv_cache_dtype: str = "auto") -> QuantPlan:
    """The plan for `device` ("cpu", "cuda", "cuda:1") from the config's [model] quantization
    and [kv_cache] dtype. Raises QuantizationUnsupported (one line) where FP8 is asked for
    on a device without FP8 tensor cores, ValueError for an unknown value."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization {quantization!r}; expected one of {QUANTIZATION_MODES}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if quantization in CPU_MODES and device.type != "cpu":
        raise QuantizationUnsupported(
            f"--quantization {quantization} refused: it is a CPU weight format and the device "
            f"is {device.type}; use --quantization none or fp8 there")
    wants = [what for what, on in (("--quantization fp8", quantization == "fp8"),
                                   ("--kv-cache-dtype fp8", kv_cache_dtype == "fp8")) if on]
    if wants:
        why = _fp8_refusal(device)
        if why is not None:
            raise QuantizationUnsupported(f"{' and '.join(wants)} refused: {why}")
    where = str(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        where = f"{device} ({torch.cuda.get_device_name(device)}, sm_{cap[0]}{cap[1]})"
    return QuantPlan(weights=quantization, kv_cache=kv_cache_dtype,
                     gemm=_GEMMS[quantization], device=where)
