"""Triton kernels that quantize activations to FP8 (float8_e4m3fn) per token, fused into the op
that produces them so that the bf16 activation never goes back to memory (CUDA only; the torch
versions and the dispatch are in kernels/fp8_ops.py).

Each program takes one row (token): it computes the row in float32, rounds it to the model
dtype (so the result is bit for bit the quantization of what the unfused op would have stored),
then either takes the row's scale max|row| / 448 (dynamic) or the layer's static input scale,
and stores row / scale in FP8 plus the scale. Divisions are correctly rounded (div_rn), as
torch's are, so the torch versions are exact references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bucketserve.kernels import pdl, triton_pdl
from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_MIN_SCALE: tl.constexpr = tl.constexpr(MIN_SCALE)


@triton.jit
def _store_quantized(v, row, cols, mask, q_ptr, s_ptr, static_ptr, stride_q,
                     STATIC: tl.constexpr):
    # v: the row in float32 (already rounded to the model dtype); padding lanes are 0
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), 0), _MAX), _MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -_MAX), _MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q, n_cols,
                       STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _store_quantized(v, row, cols, mask, q_ptr, s_ptr, static_ptr, stride_q, STATIC)


@triton.jit
def _load_scaled(ptr, row, cols, mask, stride, rs_ptr, cs_ptr, col0, SCALED: tl.constexpr):
    # a row of x, or with SCALED of a Deferred product (fp8_ops.Deferred): its raw row times
    # the row's scale, then the columns' scales, rounded once to the model dtype
    x = tl.load(ptr + row * stride + cols, mask=mask, other=0.0)
    if SCALED:
        rs = tl.load(rs_ptr + row)
        cs = tl.load(cs_ptr + col0 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) * rs * cs).to(x.dtype)
    return x


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, static_ptr,
                           rs_ptr, cs_ptr, stride_x, stride_r, stride_q, stride_ro, n_cols, eps,
                           HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr,
                           SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # triton_fused._rms_norm_kernel's arithmetic, then the quantization of its output row
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _load_scaled(x_ptr, row, cols, mask, stride_x, rs_ptr, cs_ptr, 0, SCALED)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    v = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype).to(tl.float32)
    _store_quantized(v, row, cols, mask, q_ptr, s_ptr, static_ptr, stride_q, STATIC)


@triton.jit
def _silu_mul_row_chunk(x_ptr, row, cols, mask, stride_x, rs_ptr, cs_ptr, n_cols,
                        SCALED: tl.constexpr):
    # silu(gate) * up of one chunk of a row, rounded once per op as torch's bf16 MLP does
    g = _load_scaled(x_ptr, row, cols, mask, stride_x, rs_ptr, cs_ptr, 0, SCALED)
    u = _load_scaled(x_ptr + n_cols, row, cols, mask, stride_x, rs_ptr, cs_ptr, n_cols, SCALED)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, rs_ptr, cs_ptr, stride_x,
                           stride_q, n_cols, STATIC: tl.constexpr, SCALED: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    # x [T, 2I] = [gate | up] -> quantized silu(gate) * up, one program per row
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    v = _silu_mul_row_chunk(x_ptr, row, cols, mask, stride_x, rs_ptr, cs_ptr, n_cols, SCALED)
    _store_quantized(v, row, cols, mask, q_ptr, s_ptr, static_ptr, stride_q, STATIC)


@triton.jit
def _silu_mul_quant_chunked_kernel(x_ptr, q_ptr, s_ptr, static_ptr, rs_ptr, cs_ptr, stride_x,
                                   stride_q, n_cols, STATIC: tl.constexpr,
                                   SCALED: tl.constexpr, CHUNK: tl.constexpr,
                                   PDL: tl.constexpr):
    # _silu_mul_quant_kernel over CHUNK columns at a time: a first pass takes the row's
    # largest magnitude, a second computes the chunks again (the row's bytes are then in L2)
    # and stores them quantized. Few registers a program, so many programs share an SM:
    # the one-pass kernel keeps the whole row (2 x 14,336 values at the 8B shape) in
    # registers, one program per SM.
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        m = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, n_cols, CHUNK):
            cols = c0 + offs
            mask = cols < n_cols
            v = _silu_mul_row_chunk(x_ptr, row, cols, mask, stride_x, rs_ptr, cs_ptr, n_cols,
                                    SCALED)
            m = tl.maximum(m, tl.abs(v))
        s = tl.maximum(tl.math.div_rn(tl.max(m, 0), _MAX), _MIN_SCALE)
    for c0 in range(0, n_cols, CHUNK):
        cols = c0 + offs
        mask = cols < n_cols
        v = _silu_mul_row_chunk(x_ptr, row, cols, mask, stride_x, rs_ptr, cs_ptr, n_cols, SCALED)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -_MAX), _MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


# silu_and_mul_quant's two-pass kernel: (columns a chunk, warps); CHUNKED_FROM: the narrowest
# half-row (I) it runs for (0: never). Chosen from bench/fp8_silu_gpu.py on a GPU.
CHUNKED = (2048, 4)
CHUNKED_FROM = 0


def _outputs(t: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((t, n), dtype=FP8_DTYPE, device=device),
            torch.empty((t, 1), dtype=torch.float32, device=device))


def _launch_args(t: int, n: int, static_scale: torch.Tensor | None, device: torch.device
                 ) -> dict:
    block = triton.next_power_of_2(n)
    return {"STATIC": static_scale is not None, "BLOCK": block,
            "num_warps": min(16, max(1, block // 256)), **pdl.launch_args(device, t)}


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (q [T, N] fp8, scale [T, 1] float32)."""
    t, n = x.shape
    q, s = _outputs(t, n, x.device)
    if t:
        assert x.stride(1) == 1
        _quant_rows_kernel[(t,)](x, q, s, static_scale if static_scale is not None else s,
                                 x.stride(0), q.stride(0), n,
                                 **_launch_args(t, n, static_scale, x.device))
    return q, s


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   static_scale: torch.Tensor | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """x (+ residual) [T, H] -> ((q, scale) of the normed rows, x + residual or None).
    scales: (row [T, 1], col [H]) float32 of a Deferred product x (fp8_ops.Deferred)."""
    t, n = x.shape
    q, s = _outputs(t, n, x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if t:
        assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else x
        rs, cs = scales if scales is not None else (s, s)
        _rms_norm_quant_kernel[(t,)](
            x, r, weight, q, s, ro, static_scale if static_scale is not None else s, rs, cs,
            x.stride(0), r.stride(0), q.stride(0), ro.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, SCALED=scales is not None,
            **_launch_args(t, n, static_scale, x.device))
    return (q, s), res_out


def silu_and_mul_quant(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       chunked: tuple[int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2I] = [gate | up] -> (q, scale) of silu(gate) * up. scales: (row [T, 1],
    col [2I]) float32 of a Deferred product x (fp8_ops.Deferred). chunked: (columns,
    warps) of the two-pass kernel, which runs by default where I >= CHUNKED_FROM > 0."""
    t, two_i = x.shape
    n = two_i // 2
    q, s = _outputs(t, n, x.device)
    if chunked is None and 0 < CHUNKED_FROM <= n:
        chunked = CHUNKED
    if t:
        assert x.stride(1) == 1
        rs, cs = scales if scales is not None else (s, s)
        if chunked is not None:
            _silu_mul_quant_chunked_kernel[(t,)](
                x, q, s, static_scale if static_scale is not None else s, rs, cs, x.stride(0),
                q.stride(0), n, STATIC=static_scale is not None, SCALED=scales is not None,
                CHUNK=chunked[0], num_warps=chunked[1], **pdl.launch_args(x.device, t))
            return q, s
        _silu_mul_quant_kernel[(t,)](x, q, s, static_scale if static_scale is not None else s,
                                     rs, cs, x.stride(0), q.stride(0), n,
                                     SCALED=scales is not None,
                                     **_launch_args(t, n, static_scale, x.device))
    return q, s
