"""Triton GEMVs for one-row and few-row projections (CUDA only): y[M, N] = x[M, K] @ W[N, K]^T.

A decode step of one sequence reads every weight once and does two FLOPs per weight, so its
projections are bound by how fast the weights stream in. cuBLAS reads the small 8B-shape
projections at 2.5-3.1 TB/s on an H200 (qkv, o) against a 4.15 TB/s copy rate
(bench/gemm_gpu.py). This kernel gives each program BLOCK_N whole rows of W, walks K in
BLOCK_K slices with fp32 products accumulated per lane, and reduces once at the end. Whether
it is used is decided by measurement: `choose` times each weight shape of a model against
cuBLAS at start-up (bench/gemm_gpu.py --gemv sweeps all of CONFIGS).

Split K (a config's optional last element, 1 = none): a narrow projection (the 8B shape's
qkv, o and down, 4,096-6,144 outputs) read whole-K per program streams its weights at about
half the copy rate (bench/results/fp8_defer_h100_2026-12-07: 10.4 us for o's 16.8 MB on an
H100, whose copy rate would take 5). With SPLIT > 1 the grid gets a second axis over K: each
program writes its partial block to a float32 scratch and counts itself in on that block's
counter; the last of them, whichever it is, adds the partials in split order, applies the
scales and stores the block, then sets the counter back to zero. One launch, and the same sum
order on every run. The scratch and counters belong to the device (`_scratch`): the kernels
of a stream run one after another. Split candidates are timed only for outputs up to
SPLIT_MAX_N, which bounds the scratch, and only with BUCKETSERVE_SPLIT_K=1: on an H100 they
took 7-8% off down's product at 16-32 rows and nothing beyond noise off o's and qkv's
(docs/quantization.md), so the grid's parallelism is not what keeps those at twice their bytes.

FP8 (W8A8) projections have the same two paths: `gemv_fp8` for one row and `rows_fp8` for
2..64 rows (small decode batches, where torch._scaled_mm reads the weights at well below
the copy rate), each timed against _scaled_mm at start-up (`choose_fp8`, `choose_fp8_rows`;
bench/fp8_rows_gpu.py sweeps rows_fp8's tiles).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bucketserve.kernels import pdl, triton_pdl
from bucketserve.kernels.cuda_timing import graph_us


@triton.jit
def _k_range(K, k_split, SPLIT: tl.constexpr):
    """This program's slice of K: all of it, or (SPLIT > 1) k_split (a BLOCK_K multiple) from
    its split's start (program_id(1))."""
    if SPLIT == 1:
        return 0, K
    k_lo = tl.program_id(1) * k_split
    return k_lo, tl.minimum(K, k_lo + k_split)


@triton.jit
def _split_sum(part_ptr, lock_ptr, block, acc, offs, omask, slice_size, SPLIT: tl.constexpr):
    """Split K: writes this program's partial `acc` into its split's slice of the scratch
    (slices `slice_size` floats apart, `offs` inside one) and counts it in on `block`'s
    counter. Returns (whether this program came last, then the sum of every split's partial
    in split order; zeros otherwise). The last program sets the counter back to zero."""
    tl.store(part_ptr + tl.program_id(1) * slice_size + offs, acc, mask=omask)
    tl.debug_barrier()  # every thread's stores before the count (released by the atomic)
    last = tl.atomic_add(lock_ptr + block, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    total = tl.zeros_like(acc)
    if last:
        for s in tl.static_range(SPLIT):  # (L2 reads: other SMs wrote them)
            total += tl.load(part_ptr + s * slice_size + offs, mask=omask, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + block, 0, sem="relaxed", scope="gpu")
    return last, total


@triton.jit
def _first_slice_then_wait(w_rows, nmask, k_lo, k_hi, rk, PDL: tl.constexpr):
    """With PDL (kernels/pdl.py): lets the next kernel launch (PDL 1, early; PDL 2 does after
    its K loop), loads this program's first weight slice [BLOCK_N, BLOCK_K] (weights are never
    written: the kernel before may still run), then waits for that kernel; x, the scales, the
    scratch and y are read only after. Returns (the slice, its columns, their mask)."""
    if PDL == 1:
        triton_pdl.gdc_launch_dependents()
    cols = k_lo + rk
    kmask = cols < k_hi
    w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                eviction_policy="evict_first")
    triton_pdl.gdc_wait()
    return w, cols, kmask


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, part_ptr, lock_ptr, N, K, stride_w,
                 k_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALED: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_lo, k_hi = _k_range(K, k_split, SPLIT)
    if PDL:  # (kernels/pdl.py) the first weight slice while the kernel before still runs
        w, cols, kmask = _first_slice_then_wait(w_rows, nmask, k_lo, k_hi, rk, PDL)
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        k_lo += BLOCK_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
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
    if PDL == 2:
        triton_pdl.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    last = True
    if SPLIT > 1:
        last, y = _split_sum(part_ptr, lock_ptr, pid, y, rn, nmask, N, SPLIT)
    if last:
        if SCALED:  # FP8 operands: x's row scale and W's per-output-channel scales
            y = y * tl.load(xs_ptr) * tl.load(ws_ptr + rn, mask=nmask, other=0.0)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _rows_dot(x, w, acc, FP8_DOT: tl.constexpr):
    """acc + x [M, BK] @ w [N, BK]^T, FP8 operands."""
    if FP8_DOT:  # FP8 tensor cores; each tile's sum added in fp32 here, as Hopper's FP8
        # MMA accumulates with fewer mantissa bits than fp32 (_scaled_mm promotes too)
        acc += tl.dot(x, tl.trans(w))
    else:  # fp16 (every e4m3 value is one), fp32 sums
        acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
    return acc


@triton.jit
def _rows_fp8_kernel(x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, part_ptr, lock_ptr, M, N, K, stride_x,
                     stride_w, stride_y, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP8_DOT: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr):
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
    k_lo, k_hi = _k_range(K, k_split, SPLIT)
    if PDL:  # (kernels/pdl.py) the first weight slice while the kernel before still runs
        w, cols, kmask = _first_slice_then_wait(w_rows, nmask, k_lo, k_hi, rk, PDL)
        x = tl.load(x_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc = _rows_dot(x, w, acc, FP8_DOT)
        k_lo += BLOCK_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
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
        acc = _rows_dot(x, w, acc, FP8_DOT)
    if PDL == 2:
        triton_pdl.gdc_launch_dependents()
    omask = mmask[:, None] & nmask[None, :]
    last = True
    if SPLIT > 1:
        last, acc = _split_sum(part_ptr, lock_ptr, pid, acc, rm[:, None] * N + rn[None, :],
                               omask, M * N, SPLIT)
    if last:
        xs = tl.load(xs_ptr + rm, mask=mmask, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
        y = acc * xs[:, None] * ws[None, :]
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=omask)


# (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT]); bench/gemm_gpu.py --gemv sweeps these
CONFIGS = [(bn, bk, w, s) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
           for w in (4, 8) for s in (2, 3, 4) if bn * bk <= 16384]
DEFAULT_CONFIG = (8, 512, 4, 3)
# the start-up candidates: the best configs of the H200 sweep at the 8B projections (qkv, o,
# gate_up, down, lm_head) and their neighbours, then split-K ones (timed for outputs up to
# SPLIT_MAX_N only)
CANDIDATES = [(8, 512, 4, 2), (8, 512, 4, 3), (16, 256, 4, 3), (16, 256, 4, 4),
              (16, 512, 4, 3), (16, 1024, 8, 2), (16, 1024, 8, 3), (4, 1024, 4, 3),
              (8, 512, 4, 3, 2), (8, 512, 4, 3, 4), (4, 1024, 4, 3, 4)]
# an experiment (measured on an H100: 7-8% off down's product at 16-32 rows, noise elsewhere):
# BUCKETSERVE_SPLIT_K=1 times the split candidates at start-up (for outputs up to 16,384);
# unset, none is timed or chosen
SPLIT_K_ENV = "BUCKETSERVE_SPLIT_K"
SPLIT_OUTPUTS = 16384  # the most outputs a split candidate is timed for (bounds the scratch)
SPLIT_MAX_N = SPLIT_OUTPUTS if os.environ.get(SPLIT_K_ENV, "") == "1" else 0
_LOCKS = 1 << 16  # output blocks a split launch may have (one counter each)
# every scratch a device was given, newest last: a CUDA graph keeps the addresses it captured,
# so an outgrown scratch is kept, never freed
_SCRATCH: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _scratch(device: torch.device, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K scratch (float32, at least `floats`) and block counters (int32,
    zero between launches). Grows only outside CUDA graph capture: the start-up measurement
    (`choose*`) runs every split config a model may use first, with the largest row band."""
    kept = _SCRATCH.setdefault(device, [])
    if kept and kept[-1][0].numel() >= floats:
        return kept[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"split-K scratch of {floats} floats asked for inside CUDA graph "
                           "capture: run the kernel once with this config before capturing")
    locks = kept[-1][1] if kept else torch.zeros(_LOCKS, dtype=torch.int32, device=device)
    kept.append((torch.empty(floats, dtype=torch.float32, device=device), locks))
    return kept[-1]


def _split_args(out: torch.Tensor, split: int, n: int, k: int, bn: int, bk: int,
                rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(scratch, counters, k_split) of a launch with `split` K slices; without a split the
    kernel reads neither, and `out` stands in for both."""
    if split == 1:
        return out, out, k
    if triton.cdiv(n, bn) > _LOCKS:
        raise ValueError(f"split-K over {triton.cdiv(n, bn)} output blocks; at most {_LOCKS}")
    part, locks = _scratch(out.device, split * rows * n)
    return part, locks, triton.cdiv(triton.cdiv(k, bk), split) * bk


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
    _launch_gemv(x, weight, out, x, x, n, k, config, scaled=False)
    return out


def _launch_gemv(x, weight, out, xs, ws, n: int, k: int, config: tuple, scaled: bool) -> None:
    bn, bk, warps, stages = config[:4]
    split = config[4] if len(config) > 4 else 1
    part, locks, k_split = _split_args(out, split, n, k, bn, bk, 1)
    _gemv_kernel[(triton.cdiv(n, bn), split)](
        x, weight, out, xs, ws, part, locks, n, k, weight.stride(0), k_split, BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=k % bk == 0, SCALED=scaled, SPLIT=split, num_warps=warps,
        num_stages=stages, **pdl.product_args(out.device, 1))


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
    _launch_gemv(q, weight, out, scale, weight_scale, n, k, config, scaled=True)
    return out


# few-row FP8 products (rows_fp8): row bands by BLOCK_M, and the start-up candidates
# (BLOCK_N, BLOCK_K, num_warps, num_stages, FP8 dot 1 / fp16 dot 0[, SPLIT])
ROW_BANDS = (16, 32, 64)
ROW_CANDIDATES = [(16, 256, 4, 4, 1), (32, 256, 4, 3, 1), (32, 128, 4, 4, 1), (64, 128, 4, 3, 1),
                  (16, 256, 4, 4, 0), (32, 256, 4, 3, 0), (64, 128, 4, 3, 0), (32, 512, 4, 3, 0),
                  (32, 256, 4, 3, 1, 2), (32, 256, 4, 3, 1, 4), (16, 256, 4, 4, 1, 4),
                  (32, 512, 4, 3, 0, 2)]


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
    bn, bk, warps, stages, fp8_dot = config[:5]
    split = config[5] if len(config) > 5 else 1
    # the scratch is sized for the largest band, so that a graph of fewer rows never grows it
    part, locks, k_split = _split_args(out, split, n, k, bn, bk, ROW_BANDS[-1])
    _rows_fp8_kernel[(triton.cdiv(n, bn), split)](
        q, weight, out, scale, weight_scale, part, locks, m, n, k, q.stride(0),
        weight.stride(0), out.stride(0), k_split, BLOCK_M=row_band(m), BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=k % bk == 0, FP8_DOT=bool(fp8_dot), SPLIT=split, num_warps=warps,
        num_stages=stages, **pdl.product_args(out.device, m))
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
                   _unsplit_above(candidates or CANDIDATES, n, 4), min_gain)


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
                   len(ws), _unsplit_above(candidates or CANDIDATES, n, 4), min_gain)


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
                            kernel, out, ref, len(ws),
                            _unsplit_above(candidates or ROW_CANDIDATES, n, 5), min_gain)
        result[band] = (info, cfg)
    return result


def _unsplit_above(candidates: list[tuple], n: int, plain_len: int) -> list[tuple]:
    """The candidates to time for `n` outputs: split ones (longer than `plain_len`) only up to
    SPLIT_MAX_N outputs, which bounds the split scratch."""
    return [c for c in candidates if len(c) == plain_len or n <= SPLIT_MAX_N]


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


