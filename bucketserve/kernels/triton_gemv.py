"""Triton GEMVs for one-row and few-row projections (CUDA only): y[M, N] = x[M, K] @ W[N, K]^T.

A decode step of one sequence reads every weight once and does two FLOPs per weight, so its
projections are bound by how fast the weights stream in. cuBLAS reads the small 8B-shape
projections at 2.5-3.1 TB/s on an H200 (qkv, o) against a 4.15 TB/s copy rate
(bench/gemm_gpu.py). This kernel gives each program BLOCK_N whole rows of W, walks K in
BLOCK_K slices with fp32 products accumulated per lane, and reduces once at the end; no
split-K, so there is no second launch and the sum order is fixed (the result is the same on
every run). Whether it is used is decided by measurement: `choose` times each weight shape
of a model against cuBLAS at start-up (bench/gemm_gpu.py --gemv sweeps all of CONFIGS).

FP8 (W8A8) projections have the same two paths: `gemv_fp8` for one row and `rows_fp8` for
2..64 rows (small decode batches, where torch._scaled_mm reads the weights at well below
the copy rate), each timed against _scaled_mm at start-up (`choose_fp8`, `choose_fp8_rows`;
bench/fp8_rows_gpu.py sweeps rows_fp8's tiles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bucketserve.kernels.cuda_timing import graph_us


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, N, K, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALED: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + rk
        if EVEN_K:
            x = tl.load(x_ptr + cols)
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None], other=0.0,
                        eviction_policy="evict_first")
        else:
            kmask = cols < K
            x = tl.load(x_ptr + cols, mask=kmask, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:  # FP8 operands: x's row scale and W's per-output-channel scales
        y = y * tl.load(xs_ptr) * tl.load(ws_ptr + rn, mask=nmask, other=0.0)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _rows_fp8_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, M, N, K, stride_x, stride_w, stride_y,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, FP8_DOT: tl.constexpr):
    # one program per BLOCK_N output channels and all M (<= BLOCK_M) rows: each weight byte
    # is read once per step, as in the GEMV, and the rows share it through one tl.dot
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    x_rows = x_ptr + rm[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + rk
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :], mask=mmask[:, None], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None], other=0.0,
                        eviction_policy="evict_first")
        else:
            kmask = cols < K
            x = tl.load(x_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first")
        if FP8_DOT:  # FP8 tensor cores; each tile's sum added in fp32 here, as Hopper's FP8
            # MMA accumulates with fewer mantissa bits than fp32 (_scaled_mm promotes too)
            acc += tl.dot(x, tl.trans(w))
        else:  # fp16 (every e4m3 value is one), fp32 sums
            acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
    xs = tl.load(xs_ptr + rm, mask=mmask, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages); bench/gemm_gpu.py --gemv sweeps these
CONFIGS = [(bn, bk, w, s) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
           for w in (4, 8) for s in (2, 3, 4) if bn * bk <= 16384]
DEFAULT_CONFIG = (8, 512, 4, 3)
# the start-up candidates: the best configs of the H200 sweep at the 8B projections (qkv, o,
# gate_up, down, lm_head) and their neighbours
CANDIDATES = [(8, 512, 4, 2), (8, 512, 4, 3), (16, 256, 4, 3), (16, 256, 4, 4),
              (16, 512, 4, 3), (16, 1024, 8, 2), (16, 1024, 8, 3), (4, 1024, 4, 3)]


def _one_row_operands(name: str, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a one-row product's weight [N, K]; ValueError unless the weight has unit
    stride along K and the row is contiguous."""
    k = x.shape[-1]
    if weight.shape[1] != k or weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"{name} needs weight [N, {k}] with unit stride along K and a "
                         f"contiguous row; got weight {tuple(weight.shape)} stride "
                         f"{weight.stride()}")
    return weight.shape[0], k


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         config: tuple[int, int, int, int] = DEFAULT_CONFIG) -> torch.Tensor:
    """x [1, K] (or [K]), weight [N, K] with unit stride along K -> [1, N] in x's dtype."""
    n, k = _one_row_operands("gemv", x, weight)
    if x.numel() != k:
        raise ValueError(f"gemv takes one row; got x of shape {tuple(x.shape)}")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config
    _gemv_kernel[(triton.cdiv(n, bn),)](x, weight, out, x, x, n, k, weight.stride(0),
                                        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
                                        SCALED=False, num_warps=warps, num_stages=stages)
    return out


def gemv_fp8(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
             out: torch.Tensor | None = None,
             config: tuple[int, int, int, int] = DEFAULT_CONFIG) -> torch.Tensor:
    """The W8A8 product of one row at a GEMV's byte rate: q [1, K] float8_e4m3fn with its row
    scale [1, 1] (kernels/fp8_ops.quantize_rows) times weight [N, K] float8_e4m3fn with
    weight_scale [N] -> [1, N] out_dtype; (sum_k q_k w_nk) * scale * weight_scale_n, summed
    in float32 as torch._scaled_mm does (kernels/fp8_ops.fp8_linear)."""
    n, k = _one_row_operands("gemv_fp8", q, weight)
    if q.numel() != k or scale.numel() != 1 or weight_scale.numel() != n:
        raise ValueError(f"gemv_fp8 takes one row, one row scale and {n} weight scales; got q "
                         f"{tuple(q.shape)}, scale {tuple(scale.shape)}, weight_scale "
                         f"{tuple(weight_scale.shape)}")
    if out is None:
        out = torch.empty((1, n), dtype=out_dtype, device=q.device)
    bn, bk, warps, stages = config
    _gemv_kernel[(triton.cdiv(n, bn),)](q, weight, out, scale, weight_scale, n, k,
                                        weight.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                        EVEN_K=k % bk == 0, SCALED=True, num_warps=warps,
                                        num_stages=stages)
    return out


# few-row FP8 products (rows_fp8): row bands by BLOCK_M, and the start-up candidates
# (BLOCK_N, BLOCK_K, num_warps, num_stages, FP8 dot 1 / fp16 dot 0)
ROW_BANDS = (16, 32, 64)
ROW_CANDIDATES = [(16, 256, 4, 4, 1), (32, 256, 4, 3, 1), (32, 128, 4, 4, 1), (64, 128, 4, 3, 1),
                  (16, 256, 4, 4, 0), (32, 256, 4, 3, 0), (64, 128, 4, 3, 0), (32, 512, 4, 3, 0)]


def row_band(m: int) -> int:
    """The BLOCK_M that serves m rows (2..64): 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def rows_fp8(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
             config: tuple[int, int, int, int, int] = ROW_CANDIDATES[0],
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv_fp8` for a few rows (at most 64): q [M, K] float8_e4m3fn with row scales [M, 1]
    times weight [N, K] float8_e4m3fn with weight_scale [N] -> [M, N] out_dtype, each weight
    byte read once; float32 sums, then both scales, as torch._scaled_mm."""
    m, k = q.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError(f"rows_fp8 needs weight [N, {k}] and q with unit stride along K; got "
                         f"weight {tuple(weight.shape)} stride {weight.stride()}, q stride "
                         f"{q.stride()}")
    if not 1 <= m <= ROW_BANDS[-1] or scale.numel() != m or weight_scale.numel() != n:
        raise ValueError(f"rows_fp8 takes 1..{ROW_BANDS[-1]} rows with one scale each and {n} "
                         f"weight scales; got q {tuple(q.shape)}, scale {tuple(scale.shape)}, "
                         f"weight_scale {tuple(weight_scale.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    bn, bk, warps, stages, fp8_dot = config
    _rows_fp8_kernel[(triton.cdiv(n, bn),)](
        q, weight, out, scale, weight_scale, m, n, k, q.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=row_band(m), BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        FP8_DOT=bool(fp8_dot), num_warps=warps, num_stages=stages)
    return out


def choose(weights: list[torch.Tensor], candidates: list[tuple[int, int, int, int]] | None = None,
           min_gain: float = 0.02) -> tuple[tuple[int, int, int, int] | None, dict]:
    """Times one-row products with `weights` (same shape and dtype, e.g. one projection of
    every layer: they rotate so that L2 does not hold them) by cuBLAS (F.linear) and by this
    GEMV at each candidate config. Returns (the fastest config, or None when none is at least
    `min_gain` faster than cuBLAS, {"cublas_us": t, "gemv_us": t, "config": [...]})."""
    ws = weights[:8]
    n, k = ws[0].shape
    x = torch.randn(1, k, device=ws[0].device, dtype=ws[0].dtype)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    ref = F.linear(x, ws[0]).float()
    return fastest(lambda i: torch.mm(x, ws[i].t(), out=out),
                   lambda i, cfg: gemv(x, ws[i], out, cfg), out, ref, len(ws),
                   candidates, min_gain)


def choose_fp8(weights: list[torch.Tensor], scales: list[torch.Tensor],
               candidates: list[tuple[int, int, int, int]] | None = None,
               min_gain: float = 0.02) -> tuple[tuple[int, int, int, int] | None, dict]:
    """`choose` for FP8 projections (weights [N, K] float8_e4m3fn with per-channel `scales`):
    torch._scaled_mm of one quantized row (what kernels/fp8_ops.fp8_linear runs) against
    gemv_fp8 at each candidate config; the same result shape ("cublas_us": _scaled_mm's)."""
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows

    ws, ss = weights[:8], scales[:8]
    n, k = ws[0].shape
    q, s = quantize_rows(torch.randn(1, k, device=ws[0].device, dtype=torch.bfloat16))
    out = torch.empty(1, n, device=q.device, dtype=torch.bfloat16)
    ref = fp8_linear((q, s), ws[0], ss[0], None, torch.bfloat16).float()
    return fastest(lambda i: fp8_linear((q, s), ws[i], ss[i], None, torch.bfloat16),
                   lambda i, cfg: gemv_fp8(q, s, ws[i], ss[i], out=out, config=cfg), out, ref,
                   len(ws), candidates, min_gain)


def choose_fp8_rows(weights: list[torch.Tensor], scales: list[torch.Tensor],
                    candidates: list[tuple[int, int, int, int, int]] | None = None,
                    min_gain: float = 0.02) -> dict[int, tuple[dict, tuple | None]]:
    """Per row band (16, 32, 64 rows: BLOCK_M), torch._scaled_mm of that many quantized rows
    against rows_fp8 at each candidate config, as `choose_fp8` does for one row. Returns
    {band: (info, the config or None where _scaled_mm stays)}."""
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows

    ws, ss = weights[:8], scales[:8]
    n, k = ws[0].shape
    result = {}
    for band in ROW_BANDS:
        q, s = quantize_rows(torch.randn(band, k, device=ws[0].device, dtype=torch.bfloat16))
        out = torch.empty(band, n, device=q.device, dtype=torch.bfloat16)
        ref = fp8_linear((q, s), ws[0], ss[0], None, torch.bfloat16).float()

        def kernel(i, cfg, q=q, s=s, out=out):
            rows_fp8(q, s, ws[i], ss[i], config=cfg, out=out)

        cfg, info = fastest(lambda i, q=q, s=s: fp8_linear((q, s), ws[i], ss[i], None,
                                                           torch.bfloat16),
                            kernel, out, ref, len(ws), candidates or ROW_CANDIDATES, min_gain)
        result[band] = (info, cfg)
    return result


def fastest(library, kernel, out: torch.Tensor, ref: torch.Tensor, calls: int,
            candidates: list[tuple] | None, min_gain: float) -> tuple[tuple | None, dict]:
    """`library(i)` and `kernel(i, config)` (writing `out`) timed over the `calls` rotating
    weights; a config whose first result is off `ref` by 2% or more is never chosen."""
    library_us = graph_us(library, calls, trials=7)
    best: tuple[float, tuple[int, int, int, int]] | None = None
    for cfg in candidates or CANDIDATES:
        try:
            kernel(0, cfg)
        except Exception:  # noqa: BLE001 - a config this GPU / Triton cannot compile
            continue
        err = (out.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
        if not err < 2e-2:  # a config this GPU or shape gets wrong is never chosen
            continue
        us = graph_us(lambda i, cfg=cfg: kernel(i, cfg), calls, trials=7)
        if best is None or us < best[0]:
            best = (us, cfg)
    info = {"cublas_us": round(library_us, 2)}
    if best is not None:
        info.update(gemv_us=round(best[0], 2), config=list(best[1]))
    if best is None or best[0] > library_us * (1.0 - min_gain):
        return None, info
    return best[1], info


