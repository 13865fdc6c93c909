"""Fused small ops of the BERT encoder: residual add + LayerNorm, and bias + GELU in the GEMM.

`add_layer_norm` runs one Triton kernel (kernels/triton_bert.py) for CUDA tensors and the
torch version below otherwise; triton is imported only on the CUDA path. The torch version
rounds where the unfused layer does (the add in the model dtype, LayerNorm in float32 inside,
its output in the model dtype), so it is the oracle the kernel is tested against.

`linear_gelu` is the feed-forward input projection with its bias and GELU in cuBLASLt's GEMM
epilogue (torch._addmm_activation): one kernel instead of the GEMM and a GELU kernel. That
epilogue computes the tanh approximation of GELU, so it is exact only for models whose
hidden_act is the tanh GELU ("gelu_new", "gelu_pytorch_tanh"); for the erf GELU ("gelu",
all-MiniLM-L6-v2) it is an approximation, used only where asked (bench/bert_fused_gpu.py
measures its time and its cosine against the float32 reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_layer_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x + residual, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x, residual [T, H] -> LayerNorm(x + residual) [T, H], one kernel on CUDA."""
    if x.is_cuda:
        from bucketserve.kernels import triton_bert

        return triton_bert.add_layer_norm(x, residual, weight, bias, eps)
    return add_layer_norm_torch(x, residual, weight, bias, eps)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [T, in] -> gelu_tanh(x @ weight.T + bias) [T, out], the bias and the activation in
    the GEMM's epilogue on CUDA (see the module docstring); elsewhere the torch ops (the CPU
    kernel of torch._addmm_activation computes the erf GELU instead)."""
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")
