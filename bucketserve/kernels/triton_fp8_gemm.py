"""W8A8 GEMM in Triton for steps of many rows (large decode batches, prefill and mixed steps).

The same product as kernels/fp8_ops.fp8_linear (torch._scaled_mm with row-wise scales):
q [M, K] float8_e4m3fn with one scale per row times weight [N, K] float8_e4m3fn with one scale
per output channel -> [M, N] bf16, float32 sums, both scales applied in the epilogue.

Two things are its own:
* the tile shapes, chosen per weight shape and row band at start-up against _scaled_mm (as
  kernels/triton_gemv does for 1..64 rows): at 128..512 rows the library's 128-row tiles leave
  most SMs idle on the narrow projections (o_proj, 4096 outputs: 64 tiles on 132 SMs);
* the accumulation: Hopper's FP8 MMA keeps a narrower accumulator than float32, so with
  PROMOTE each K tile's sum is added into a float32 accumulator outside the MMA (what
  _scaled_mm does with use_fast_accum=False); without it the MMA accumulates over the whole K
  loop (use_fast_accum=True, kernels/fp8_ops.FAST_ACCUM).

bench/fp8_gemm_gpu.py sweeps the tiles against _scaled_mm and cuBLAS bf16. Measured on an H200
(2026-12-06, docs/quantization.md) they lose above 128 rows, so the start-up choice runs only
with BUCKETSERVE_FP8_TILES=1.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines without Triton
    triton = None

if triton is not None:
    @triton.jit
    def _fp8_mm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, M, N, K, stride_a, stride_w, stride_c,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                       EVEN_K: tl.constexpr, PROMOTE: tl.constexpr):
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BM)
        grid_n = tl.cdiv(N, BN)
        # grouped order: GROUP row tiles share each weight tile while it is in L2
        width = GROUP * grid_n
        g = pid // width
        first_m = g * GROUP
        size = tl.minimum(grid_m - first_m, GROUP)
        pid_m = first_m + (pid % width) % size
        pid_n = (pid % width) // size
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mmask = rm < M
        nmask = rn < N
        a = a_ptr + rm.to(tl.int64)[:, None] * stride_a + rk[None, :]
        w = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                av = tl.load(a, mask=mmask[:, None], other=0.0)
                wv = tl.load(w, mask=nmask[:, None], other=0.0)
            else:
                kmask = (k0 + rk) < K
                av = tl.load(a, mask=mmask[:, None] & kmask[None, :], other=0.0)
                wv = tl.load(w, mask=nmask[:, None] & kmask[None, :], other=0.0)
            if PROMOTE:
                acc += tl.dot(av, tl.trans(wv))
            else:
                acc = tl.dot(av, tl.trans(wv), acc)
            a += BK
            w += BK
        sa = tl.load(as_ptr + rm, mask=mmask, other=0.0)
        sw = tl.load(ws_ptr + rn, mask=nmask, other=0.0)
        y = acc * sa[:, None] * sw[None, :]
        c = c_ptr + rm.to(tl.int64)[:, None] * stride_c + rn[None, :]
        tl.store(c, y.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# (BM, BN, BK, GROUP, num_warps, num_stages)
CONFIGS = [
    (64, 64, 128, 8, 4, 4), (64, 128, 128, 8, 4, 4), (64, 256, 128, 8, 8, 3),
    (128, 64, 128, 8, 4, 4), (128, 128, 128, 8, 8, 3), (128, 128, 128, 8, 4, 4),
    (128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3), (64, 128, 256, 8, 4, 3),
    (128, 128, 256, 8, 8, 2), (128, 256, 64, 8, 8, 4), (64, 64, 256, 8, 4, 3),
]


def fp8_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           config: tuple[int, int, int, int, int, int] = CONFIGS[4], promote: bool = True,
           out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, K] float8_e4m3fn, scale [M, 1] float32, weight [N, K] float8_e4m3fn, weight_scale
    [N] float32 -> [M, N] out_dtype: (q @ weight^T) * scale * weight_scale^T."""
    m, k = q.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError(f"fp8_mm needs weight [N, {k}] and q with unit stride along K; got "
                         f"weight {tuple(weight.shape)} stride {weight.stride()}, q stride "
                         f"{q.stride()}")
    if scale.numel() != m or weight_scale.numel() != n:
        raise ValueError(f"fp8_mm needs {m} row scales and {n} weight scales; got "
                         f"{scale.numel()} and {weight_scale.numel()}")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    bm, bn, bk, group, warps, stages = config
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_mm_kernel[grid](q, weight, out, scale, weight_scale, m, n, k, q.stride(0),
                         weight.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=group,
                         EVEN_K=k % bk == 0, PROMOTE=promote, num_warps=warps,
                         num_stages=stages)
    return out


# row bands of steps above 64 rows (1..64 rows: kernels/triton_gemv): a step of m rows takes
# the config of the smallest band >= m (the largest band's beyond it)
BANDS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# the start-up candidates: the fastest configs of bench/fp8_gemm_gpu.py at the 8B projections
CANDIDATES = CONFIGS


def band(m: int) -> int:
    """The row band of a step of m rows (> 64)."""
    for b in BANDS:
        if m <= b:
            return b
    return BANDS[-1]


def bands_up_to(max_rows: int) -> tuple[int, ...]:
    """The row bands a step of at most `max_rows` rows can fall in."""
    return BANDS[:BANDS.index(band(max(max_rows, 65))) + 1]


def _band_inputs(b: int, weights: list[torch.Tensor], scales: list[torch.Tensor]):
    """A start-up timing's inputs for band b: the rotating weights and their scales (8, or 2
    above 2,048 rows, where one product outlasts L2 anyway) and b quantized random rows."""
    from bucketserve.kernels.fp8_ops import quantize_rows

    calls = min(len(weights), 8 if b <= 2048 else 2)
    x = torch.randn(b, weights[0].shape[1], device=weights[0].device, dtype=torch.bfloat16)
    return weights[:calls], scales[:calls], quantize_rows(x)


def choose_fp8_tiles(weights: list[torch.Tensor], scales: list[torch.Tensor],
                     max_rows: int = BANDS[-1], candidates: list[tuple] | None = None,
                     min_gain: float = 0.03) -> dict[int, tuple[dict, tuple | None]]:
    """Per row band up to `max_rows` (the most tokens a step holds), torch._scaled_mm of that
    many quantized rows (kernels/fp8_ops.fp8_linear) against fp8_mm at each candidate config,
    over the rotating weights (one projection of every layer), as triton_gemv.fastest times
    the few-row kernels. Returns {band: (info, the config, or None where _scaled_mm stays:
    within `min_gain`, or every config failed)}."""
    from bucketserve.kernels.fp8_ops import fp8_linear
    from bucketserve.kernels.triton_gemv import fastest

    n = weights[0].shape[0]
    result: dict[int, tuple[dict, tuple | None]] = {}
    for b in bands_up_to(max_rows):
        ws, ss, (q, s) = _band_inputs(b, weights, scales)
        out = torch.empty(b, n, device=q.device, dtype=torch.bfloat16)
        ref = fp8_linear((q, s), ws[0], ss[0], None, torch.bfloat16).float()
        cfg, info = fastest(
            lambda i, q=q, s=s, ws=ws, ss=ss: fp8_linear((q, s), ws[i], ss[i], None,
                                                         torch.bfloat16),
            lambda i, cfg, q=q, s=s, ws=ws, ss=ss, out=out: fp8_mm(q, s, ws[i], ss[i], cfg,
                                                                   out=out),
            out, ref, len(ws), candidates or CANDIDATES, min_gain)
        result[b] = (info, cfg)
    return result


def choose_deferred(weights: list[torch.Tensor], scales: list[torch.Tensor],
                    max_rows: int = BANDS[-1], min_gain: float = 0.03
                    ) -> dict[int, tuple[dict, bool]]:
    """Per row band up to `max_rows`, torch._scaled_mm with row-wise scales
    (kernels/fp8_ops.fp8_linear) against the same product with unit per-tensor scales and the
    scales deferred to its reader (fp8_linear_deferred), over the rotating weights. Returns
    {band: (info, whether the deferred product is at least `min_gain` faster)}."""
    from bucketserve.kernels.cuda_timing import graph_us
    from bucketserve.kernels.fp8_ops import fp8_linear, fp8_linear_deferred

    unit = torch.ones((), dtype=torch.float32, device=weights[0].device)
    result: dict[int, tuple[dict, bool]] = {}
    for b in bands_up_to(max_rows):
        ws, ss, x = _band_inputs(b, weights, scales)
        lib = graph_us(lambda i, x=x, ws=ws, ss=ss: fp8_linear(
            x, ws[i], ss[i], None, torch.bfloat16), len(ws), trials=5)
        dfr = graph_us(lambda i, x=x, ws=ws, ss=ss: fp8_linear_deferred(
            x, ws[i], ss[i], unit, torch.bfloat16), len(ws), trials=5)
        result[b] = ({"row_wise_us": round(lib, 2), "deferred_us": round(dfr, 2)},
                     dfr < lib * (1.0 - min_gain))
        del x
    return result
