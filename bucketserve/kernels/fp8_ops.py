"""FP8 activations and products for the W8A8 projections (models/llama.py Fp8Linear).

An activation is quantized per row (token): (q [T, N] float8_e4m3fn, scale [T, 1] float32)
with q * scale ~ x, scale = max|x_row| / 448 (dynamic) or the layer's static `input_scale`.
The product of such an activation with a weight quantized per output channel
(kernels/fp8.quantize_fp8_per_channel: q_w [O, N], scale_w [O]) is
(q @ q_w^T) * scale * scale_w^T, which torch._scaled_mm computes on FP8 tensor cores with
float32 accumulation and a bf16 result.

Each public function runs the Triton kernel of kernels/triton_fp8.py (the quantization fused
into the RMSNorm or the SiLU-and-mul that produces the activation) for CUDA tensors and the
torch version below otherwise: those round at the same points, so they are the references of
the GPU tests, and they let the quantized model run (slowly, simulated) on the CPU in tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from bucketserve.kernels.triton_ops import rms_norm_torch, silu_and_mul_torch

Quantized = tuple[torch.Tensor, torch.Tensor]  # (q [T, N] fp8, scale [T, 1] float32)


class Deferred(NamedTuple):
    """A W8A8 product whose scales are not applied yet: its value is raw * row * col.

    raw [T, O] in the model dtype is q @ q_w^T with unit scales (torch._scaled_mm's
    per-tensor path, which cuBLASLt runs faster than the row-wise one at 65..512 rows: see
    fp8_linear_deferred); row [T, 1] and col [O] are the activation's and the weight's float32
    scales. The op that reads the product next (rms_norm_quant, silu_and_mul_quant) applies
    them as it loads it, so the scaling costs no pass over memory of its own."""

    raw: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor

# torch._scaled_mm's use_fast_accum: Hopper's FP8 tensor cores then keep their own (narrower
# than float32) accumulator over the whole K loop instead of adding each K tile's sum into
# float32, which is faster where the GEMM is compute-bound (prefill, mixed and large decode
# steps) and less exact. Off: the FP8 GEMMs accumulate in float32. An experiment for now
# (bench/gpu_8b.py --fp8-fast-accum sets it before the engine is built; the CUDA graphs keep
# what was set at capture): speed and accuracy measured on the H200 decide the default.
FAST_ACCUM = False


def quantize_rows_torch(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Quantized:
    xf = x.float()
    if static_scale is None:
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    else:
        s = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def apply_scales(x: torch.Tensor | Deferred) -> torch.Tensor:
    """A Deferred product's value in its model dtype, (raw * row) * col rounded once, the
    order the fused readers use (a plain tensor is returned as it is)."""
    if not isinstance(x, Deferred):
        return x
    return (x.raw.float() * x.row * x.col.view(1, -1)).to(x.raw.dtype)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Quantized:
    """x [T, N] -> (q, scale) per row (dynamic, or the static scale for every row)."""
    if x.is_cuda:
        from bucketserve.kernels import triton_fp8

        return triton_fp8.quantize_rows(x, static_scale)
    return quantize_rows_torch(x, static_scale)


def rms_norm_quant(x: torch.Tensor | Deferred, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   static_scale: torch.Tensor | None = None
                   ) -> tuple[Quantized, torch.Tensor | None]:
    """kernels/triton_ops.rms_norm with its output quantized in the same pass:
    ((q, scale) of weight * normalised(x + residual), x + residual or None). x may be a
    Deferred product: its scales are applied as it is read (apply_scales)."""
    raw = x.raw if isinstance(x, Deferred) else x
    if raw.is_cuda:
        from bucketserve.kernels import triton_fp8

        scales = (x.row, x.col) if isinstance(x, Deferred) else None
        return triton_fp8.rms_norm_quant(raw, weight, eps, residual, static_scale, scales)
    x = apply_scales(x)
    y, res = rms_norm_torch(x, weight, eps, residual)
    return quantize_rows_torch(y, static_scale), res


def silu_and_mul_quant(x: torch.Tensor | Deferred,
                       static_scale: torch.Tensor | None = None) -> Quantized:
    """x [T, 2I] = [gate | up] -> (q, scale) of silu(gate) * up, in one pass (x may be a
    Deferred product, scaled as it is read)."""
    raw = x.raw if isinstance(x, Deferred) else x
    if raw.is_cuda:
        from bucketserve.kernels import triton_fp8

        scales = (x.row, x.col) if isinstance(x, Deferred) else None
        return triton_fp8.silu_and_mul_quant(raw, static_scale, scales)
    return quantize_rows_torch(silu_and_mul_torch(apply_scales(x)), static_scale)


def fp8_linear(x: Quantized, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(q [T, N], scale [T, 1]) times weight [O, N] fp8 with weight_scale [O] -> [T, O] in
    out_dtype (+ bias). CUDA: torch._scaled_mm with row-wise scales; elsewhere the same
    product of the dequantized operands in float32 (a reference, not a fast path)."""
    q, s = x
    if q.is_cuda:
        out = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, -1),
                               out_dtype=out_dtype, use_fast_accum=FAST_ACCUM)
    else:
        out = ((q.float() * s) @ (weight.float() * weight_scale.view(-1, 1)).t()).to(out_dtype)
    return out if bias is None else out + bias


def fp8_linear_deferred(x: Quantized, weight: torch.Tensor, weight_scale: torch.Tensor,
                        unit: torch.Tensor, out_dtype: torch.dtype) -> Deferred:
    """fp8_linear without its scales: (q @ weight^T in out_dtype, scale, weight_scale), the
    scales left to the reader (Deferred). `unit` is a float32 scalar 1.0 on the device:
    torch._scaled_mm with per-tensor unit scales runs cuBLASLt's per-tensor kernels, 17-24%
    faster than its row-wise ones at 128 and 256 rows on an H200 (bench/fp8_gemm_gpu.py,
    docs/quantization.md). The raw sums round to out_dtype once before the scaling, a second
    rounding the fused product does not have (within one unit in the last place)."""
    q, s = x
    if q.is_cuda:
        raw = torch._scaled_mm(q, weight.t(), scale_a=unit, scale_b=unit, out_dtype=out_dtype,
                               use_fast_accum=FAST_ACCUM)
    else:
        raw = (q.float() @ weight.float().t()).to(out_dtype)
    return Deferred(raw, s, weight_scale)
