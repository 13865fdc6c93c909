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

import torch

from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from bucketserve.kernels.triton_ops import rms_norm_torch, silu_and_mul_torch

Quantized = tuple[torch.Tensor, torch.Tensor]  # (q [T, N] fp8, scale [T, 1] float32)

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


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Quantized:
    """x [T, N] -> (q, scale) per row (dynamic, or the static scale for every row)."""
    if x.is_cuda:
        from bucketserve.kernels import triton_fp8

        return triton_fp8.quantize_rows(x, static_scale)
    return quantize_rows_torch(x, static_scale)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   static_scale: torch.Tensor | None = None
                   ) -> tuple[Quantized, torch.Tensor | None]:
    """kernels/triton_ops.rms_norm with its output quantized in the same pass:
    ((q, scale) of weight * normalised(x + residual), x + residual or None)."""
    if x.is_cuda:
        from bucketserve.kernels import triton_fp8

        return triton_fp8.rms_norm_quant(x, weight, eps, residual, static_scale)
    y, res = rms_norm_torch(x, weight, eps, residual)
    return quantize_rows_torch(y, static_scale), res


def silu_and_mul_quant(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Quantized:
    """x [T, 2I] = [gate | up] -> (q, scale) of silu(gate) * up, in one pass."""
    if x.is_cuda:
        from bucketserve.kernels import triton_fp8

        return triton_fp8.silu_and_mul_quant(x, static_scale)
    return quantize_rows_torch(silu_and_mul_torch(x), static_scale)


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
