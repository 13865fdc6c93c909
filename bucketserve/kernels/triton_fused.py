"""Triton kernels for the small fused ops of kernels/triton_ops.py (CUDA only).

Each op is one launch in place of the 3-10 elementwise kernels torch runs; at decode
batch sizes every one of those is a few microseconds even inside a CUDA graph. The
rounding points mirror the Hugging Face Llama modules (see triton_ops.py), so fp32 runs
match the torch versions to the last bit or so and bf16 runs to bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bucketserve.kernels import pdl, triton_pdl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row: h = x (+ residual); out = weight * (h * rsqrt(mean(h^2) + eps))
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the add rounds in model dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    # token t, all heads: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin]
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < NUM_HEADS) & (i[None, :] < HALF)
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    # HF casts cos/sin to the model dtype, then each product and the sum round there
    c = cos.to(x1.dtype).to(tl.float32)[None, :]
    s = sin.to(x1.dtype).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    a1 = (x1f * c).to(x1.dtype).to(tl.float32)
    b1 = (-x2f * s).to(x1.dtype).to(tl.float32)
    a2 = (x2f * c).to(x1.dtype).to(tl.float32)
    b2 = (x1f * s).to(x1.dtype).to(tl.float32)
    obase = out_ptr + t * stride_ot + h[:, None] * stride_oh + i[None, :]
    tl.store(obase, (a1 + b1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(obase + HALF, (a2 + b2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cache_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                   stride_kot, stride_koh, stride_c,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   PDL: tl.constexpr):
    # one program per token rotates its q and k heads; cache row = [cos | sin] (fp32)
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_c + i, mask=i < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + i, mask=i < HALF, other=0.0)
    _rotate_heads(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    # x [T, 2I] = [gate | up] -> silu(gate) * up, grid (T, cdiv(I, BLOCK))
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounds to the model dtype first
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, residual [T, H] -> (normed [T, H], x + residual or None)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if t == 0:
        return out, res_out
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t,)](x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0),
                           ro.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                           BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, res_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (last dim contiguous) -> rotated copies, one launch."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    _rotary_kernel[(t,)](q, k, q_out, k_out, positions, cos_sin_cache,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                         cos_sin_cache.stride(0), NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv,
                         HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
                         BLOCK_HKV=triton.next_power_of_2(hkv),
                         BLOCK_HALF=triton.next_power_of_2(d // 2), **pdl.launch_args(q.device, t))
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    t, two_i = x.shape
    n = two_i // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    assert x.stride(1) == 1
    block = 1024
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                     BLOCK=block, num_warps=4)
    return out
