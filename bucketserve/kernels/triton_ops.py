"""Fused small ops for the model: RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.

Each public function runs one Triton kernel (kernels/triton_fused.py) for CUDA tensors and
the torch version below otherwise; triton is imported only on the CUDA path. The torch
versions round exactly where the Hugging Face Llama modules do, so they are the oracle
(tests/test_triton_ops.py checks them against transformers on CPU; the GPU test checks the
kernels against them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] (+ residual [T, H]) -> (weight * normalised(x + residual), x + residual).

    The second item is None when no residual is given."""
    if _use_triton(x):
        from bucketserve.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int,
                  attention_scaling: float = 1.0) -> torch.Tensor:
    """inv_freq [D/2] float32 (any rope scaling already applied) -> [max_positions, D]
    float32 rows [cos(p * inv_freq) | sin(p * inv_freq)] * attention_scaling, as HF's
    rotary embedding computes them."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(q.dtype)  # [T, 1, D]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :].to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary. q [T, Hq, D], k [T, Hkv, D], positions [T] long,
    cache from cos_sin_cache() -> (q, k) rotated, new tensors."""
    if _use_triton(q):
        from bucketserve.kernels import triton_fused

        return triton_fused.apply_rotary(q, k, positions, cache)
    return apply_rotary_torch(q, k, positions, cache)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] (a fused gate/up projection) -> silu(gate) * up [T, I]."""
    if _use_triton(x):
        from bucketserve.kernels import triton_fused

        return triton_fused.silu_and_mul(x)
    return silu_and_mul_torch(x)
