"""Triton kernel for the BERT encoder's residual add + LayerNorm (CUDA only; kernels/bert_ops.py
holds the torch oracle and the dispatch).

Post-LN BERT runs LayerNorm(x + sublayer(x)) twice a layer: torch launches an add kernel (one
read of both [T, H] tensors, one write) and a LayerNorm kernel (one more read and write). One
program per row does both here with the sum kept in registers. Rounding mirrors the unfused
layer: the add rounds to the model dtype, the statistics and the affine step run in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, stride_x, stride_r, stride_o,
                           n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype).to(tl.float32)
    mean = tl.sum(h, 0) / n_cols
    d = tl.where(mask, h - mean, 0.0)
    var = tl.sum(d * d, 0) / n_cols
    y = d * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w + b).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x, residual [T, H] (rows contiguous) -> LayerNorm(x + residual) [T, H]."""
    T, H = x.shape
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("add_layer_norm needs rows with unit column stride")
    out = torch.empty_like(x)
    block = triton.next_power_of_2(H)
    _add_layer_norm_kernel[(T,)](x, residual, weight, bias, out, x.stride(0), residual.stride(0),
                                 out.stride(0), H, eps, BLOCK=block,
                                 num_warps=4 if block >= 1024 else 2)
    return out
