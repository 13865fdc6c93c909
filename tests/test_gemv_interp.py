"""The one-row GEMV kernel (kernels/triton_gemv.py) under Triton's interpreter on the CPU, so
that CI checks its arithmetic without a GPU: uneven K (the masked tail), N not a multiple of
the row block, a strided weight view, against a float32 reference. The compiled kernel, the
start-up choice and the model's use of it are tested on a GPU (tests/test_gemv_gpu.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, config", [(37, 300, (8, 256, 4, 2)), (64, 512, (16, 256, 4, 3)),
                                          (5, 1000, (4, 1024, 4, 3))])
def test_gemv_kernel_matches_a_float32_reference(dtype, n, k, config):
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_gemv

    gen = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n + 3, k, generator=gen) * 0.05).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    want = x.float() @ w.float().t()
    got = triton_gemv.gemv(x, w, config=config)
    assert got.shape == (1, n + 3) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    # rows [1, n + 1) of the same weight: a view whose first row is not at the base pointer
    part = triton_gemv.gemv(x.view(-1), w[1: n + 1], config=config)
    torch.testing.assert_close(part.float(), want[:, 1: n + 1], rtol=tol,
                               atol=tol * want.abs().max().item())
    with pytest.raises(ValueError, match="one row"):
        triton_gemv.gemv(torch.cat([x, x]), w, config=config)
    with pytest.raises(ValueError, match="unit stride"):
        triton_gemv.gemv(x, w.t().contiguous().t(), config=config)


@pytest.mark.parametrize("n, k, config", [(37, 300, (8, 256, 4, 2)), (64, 512, (16, 256, 4, 3))])
def test_fp8_gemv_matches_the_w8a8_reference(n, k, config):
    """gemv_fp8 (FP8 row and weight, row scale and per-channel weight scales) equals the
    W8A8 product of kernels/fp8_ops.fp8_linear (dequantized operands in float32) for one row,
    and refuses more than one row."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows_torch

    gen = torch.Generator().manual_seed(n + k)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    q, s = quantize_rows_torch(torch.randn(1, k, generator=gen))
    want = fp8_linear((q, s), w, ws, None, torch.float32)
    got = triton_gemv.gemv_fp8(q, s, w, ws, torch.float32, config=config)
    assert got.shape == (1, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    bf16 = triton_gemv.gemv_fp8(q, s, w, ws, config=config)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    with pytest.raises(ValueError, match="one row"):
        triton_gemv.gemv_fp8(torch.cat([q, q]), s, w, ws, config=config)


def test_an_fp8_projection_with_a_gemv_config_runs_one_row_through_it():
    """Fp8Linear with `gemv` set (what use_gemv does where gemv_fp8 measured faster): a one-row
    input, in the model dtype or already quantized, goes through gemv_fp8 and gives the
    _scaled_mm reference's result; more rows keep the reference path."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from unittest import mock

    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.models.llama import Fp8Linear

    gen = torch.Generator().manual_seed(7)
    lin = Fp8Linear(300, 37, bias=False, dtype=torch.float32)
    w, ws = quantize_fp8_per_channel(torch.randn(37, 300, generator=gen) * 0.05)
    lin.weight.data, lin.weight_scale.data = w, ws
    x = torch.randn(3, 300, generator=gen)
    want = lin(x)  # gemv None: the reference for every row
    lin.gemv = (8, 256, 4, 2)
    with mock.patch.object(triton_gemv, "gemv_fp8", wraps=triton_gemv.gemv_fp8) as spy:
        one = lin(x[:1])
        assert spy.call_count == 1
        torch.testing.assert_close(one, want[:1], rtol=1e-4, atol=1e-4 * want.abs().max().item())
        torch.testing.assert_close(lin(x), want)  # three rows: not the GEMV
        assert spy.call_count == 1


@pytest.mark.parametrize("m, n, k, config", [(3, 37, 300, (16, 256, 4, 4, 0)),
                                             (16, 64, 512, (32, 128, 4, 4, 0)),
                                             (21, 40, 256, (16, 256, 4, 3, 1)),
                                             (64, 33, 128, (32, 128, 4, 3, 0))])
def test_fp8_rows_match_the_w8a8_reference(m, n, k, config):
    """rows_fp8 (2..64 FP8 rows with their scales, per-channel weight scales, fp16 or FP8
    dots) equals the W8A8 product of kernels/fp8_ops.fp8_linear, for uneven K and N, and
    refuses more rows than its largest band."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows_torch

    gen = torch.Generator().manual_seed(m * n + k)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    q, s = quantize_rows_torch(torch.randn(m, k, generator=gen))
    want = fp8_linear((q, s), w, ws, None, torch.float32)
    got = triton_gemv.rows_fp8(q, s, w, ws, torch.float32, config=config)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    with pytest.raises(ValueError, match="rows"):
        big, bs = quantize_rows_torch(torch.randn(65, k, generator=gen))
        triton_gemv.rows_fp8(big, bs, w, ws, config=config)


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("m, n, k, config", [(70, 90, 300, (32, 32, 64, 2, 4, 2)),
                                             (129, 64, 256, (64, 32, 128, 8, 4, 3)),
                                             (5, 200, 128, (16, 64, 64, 1, 4, 2))])
def test_fp8_gemm_tiles_match_the_w8a8_reference(m, n, k, config, promote):
    """triton_fp8_gemm.fp8_mm (many FP8 rows, tiles over rows and outputs in grouped order,
    K-tile sums promoted to float32 or accumulated in the dot) equals the W8A8 product of
    kernels/fp8_ops.fp8_linear, for row and output counts that are not tile multiples and an
    uneven K, and refuses operands whose scales do not match."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_fp8_gemm
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows_torch

    gen = torch.Generator().manual_seed(m * n + k)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    q, s = quantize_rows_torch(torch.randn(m, k, generator=gen))
    want = fp8_linear((q, s), w, ws, None, torch.float32)
    got = triton_fp8_gemm.fp8_mm(q, s, w, ws, config, promote, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    with pytest.raises(ValueError, match="scales"):
        triton_fp8_gemm.fp8_mm(q, s[:-1], w, ws, config, promote)


def test_an_fp8_projection_with_tiles_runs_its_row_bands_through_them():
    """Fp8Linear with `tiles` set (what use_gemv does per row band where fp8_mm measured
    faster than _scaled_mm): a step of more than 64 rows in a band that has a config goes
    through fp8_mm and gives the reference's result; a band without one, and 64 rows or
    fewer, keep the reference path."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from unittest import mock

    from bucketserve.kernels import triton_fp8_gemm
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.models.llama import Fp8Linear

    gen = torch.Generator().manual_seed(11)
    lin = Fp8Linear(128, 40, bias=False, dtype=torch.float32)
    w, ws = quantize_fp8_per_channel(torch.randn(40, 128, generator=gen) * 0.05)
    lin.weight.data, lin.weight_scale.data = w, ws
    x = torch.randn(200, 128, generator=gen)
    want = lin(x)  # tiles None: the reference for every row count
    assert triton_fp8_gemm.band(100) == 128 and triton_fp8_gemm.band(200) == 256
    assert triton_fp8_gemm.band(10**6) == triton_fp8_gemm.BANDS[-1]
    assert triton_fp8_gemm.bands_up_to(600) == (128, 256, 512, 1024)
    assert triton_fp8_gemm.bands_up_to(10) == (128,)
    lin.tiles = {128: (32, 32, 64, 2, 4, 2), 256: None}
    with mock.patch.object(triton_fp8_gemm, "fp8_mm", wraps=triton_fp8_gemm.fp8_mm) as spy:
        got = lin(x[:100])  # band 128
        assert spy.call_count == 1
        torch.testing.assert_close(got, want[:100], rtol=1e-4,
                                   atol=1e-4 * want.abs().max().item())
        torch.testing.assert_close(lin(x), want)  # band 256: no config
        torch.testing.assert_close(lin(x[:64]), want[:64])  # 64 rows: not this path
        assert spy.call_count == 1


def _counters_at_rest(device: str = "cpu") -> None:
    """Every split launch's last program set its block counters back to zero."""
    from bucketserve.kernels import triton_gemv

    kept = triton_gemv._SCRATCH.get(torch.device(device))
    assert kept, "no split scratch was made: the split path did not run"
    assert int(kept[-1][1].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, config", [(37, 300, (8, 128, 4, 2, 2)),
                                          (64, 512, (16, 128, 4, 3, 4)),
                                          # 3 tiles of K over 4 splits: the last split is empty
                                          (20, 384, (8, 128, 4, 3, 4))])
def test_split_k_gemv_matches_a_float32_reference(dtype, n, k, config):
    """The GEMV with K split over a second grid axis (partials in the scratch, the last
    program of each output block adds them) gives the unsplit kernel's result, twice in a row
    (the counters are back at zero after each launch: a counter left over would make the
    second launch skip its stores), and the same bits both times."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_gemv

    gen = torch.Generator().manual_seed(n * k + 1)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    want = x.float() @ w.float().t()
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    first = triton_gemv.gemv(x, w, config=config)
    torch.testing.assert_close(first.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    _counters_at_rest()
    again = triton_gemv.gemv(x, w, config=config)
    assert torch.equal(first, again)
    _counters_at_rest()


@pytest.mark.parametrize("m, n, k, config", [(1, 37, 300, (8, 128, 4, 2, 3)),
                                             (3, 37, 300, (16, 128, 4, 4, 0, 2)),
                                             (16, 64, 512, (32, 128, 4, 4, 1, 4)),
                                             (64, 33, 384, (32, 128, 4, 3, 0, 4))])
def test_split_k_fp8_products_match_the_w8a8_reference(m, n, k, config):
    """gemv_fp8 (one row) and rows_fp8 (2..64 rows) with K split: the W8A8 product of
    kernels/fp8_ops.fp8_linear, for uneven N and K and a split with no K tile, with the
    counters at rest after each launch and the same result from a second launch."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows_torch

    gen = torch.Generator().manual_seed(m * n + k + 1)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    q, s = quantize_rows_torch(torch.randn(m, k, generator=gen))
    want = fp8_linear((q, s), w, ws, None, torch.float32)
    if m == 1:
        def run():
            return triton_gemv.gemv_fp8(q, s, w, ws, torch.float32, config=config)
    else:
        def run():
            return triton_gemv.rows_fp8(q, s, w, ws, torch.float32, config=config)
    got = run()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    _counters_at_rest()
    assert torch.equal(run(), got)
    _counters_at_rest()


def test_split_k_candidates_are_timed_only_up_to_their_output_bound(monkeypatch):
    """Split candidates (one element longer than a plain config) are timed only for
    projections of at most SPLIT_MAX_N outputs, which bounds the scratch; plain ones always.
    Without BUCKETSERVE_SPLIT_K=1 the bound is 0: none is timed."""
    import importlib

    from bucketserve.kernels import triton_gemv

    monkeypatch.delenv(triton_gemv.SPLIT_K_ENV, raising=False)
    assert importlib.reload(triton_gemv).SPLIT_MAX_N == 0
    assert triton_gemv._unsplit_above(triton_gemv.ROW_CANDIDATES, 4096, 5) == [
        c for c in triton_gemv.ROW_CANDIDATES if len(c) == 5]
    monkeypatch.setenv(triton_gemv.SPLIT_K_ENV, "1")
    try:
        assert importlib.reload(triton_gemv).SPLIT_MAX_N == triton_gemv.SPLIT_OUTPUTS == 16384
        _check_split_bound(triton_gemv)
    finally:  # the module as the other tests found it
        monkeypatch.delenv(triton_gemv.SPLIT_K_ENV)
        importlib.reload(triton_gemv)


def _check_split_bound(triton_gemv) -> None:
    """With the experiment on: split candidates up to SPLIT_MAX_N outputs, none above."""
    cands = triton_gemv.ROW_CANDIDATES
    split = [c for c in cands if len(c) == 6]
    assert split and all(c[5] > 1 for c in split)
    assert triton_gemv._unsplit_above(cands, triton_gemv.SPLIT_MAX_N, 5) == cands
    assert triton_gemv._unsplit_above(cands, triton_gemv.SPLIT_MAX_N + 1, 5) == [
        c for c in cands if len(c) == 5]
    gemv_split = [c for c in triton_gemv.CANDIDATES if len(c) == 5]
    assert gemv_split and triton_gemv._unsplit_above(
        triton_gemv.CANDIDATES, 28672, 4) == [c for c in triton_gemv.CANDIDATES if len(c) == 4]


@pytest.mark.parametrize("products", ["early", "late"])
@pytest.mark.parametrize("m, n, k, config", [(1, 37, 300, (8, 128, 4, 2)),
                                             (1, 37, 300, (4, 1024, 4, 3)),  # K < BLOCK_K
                                             (1, 20, 384, (8, 128, 4, 3, 4)),  # an empty split
                                             (3, 37, 300, (16, 128, 4, 4, 0)),
                                             (16, 64, 512, (32, 128, 4, 4, 1)),
                                             (64, 33, 384, (32, 128, 4, 3, 0, 4))])
def test_pdl_launches_give_the_same_bits_and_wait_once_a_program(monkeypatch, m, n, k, config,
                                                                 products):
    """With programmatic dependent launch (kernels/pdl.py) a GEMV / rows_fp8 program reads its
    first weight slice before it waits for the kernel before it, then the rest as before: the
    same sums in the same order, so the same bits as without it, for one-row, few-row and split
    products with uneven K, K under one tile and a split with no tile. Every program signals
    its dependents and waits exactly once: before its wait (early) or after it (late, once its
    K loop is done)."""
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import quantize_rows_torch

    gen = torch.Generator().manual_seed(m * n * k)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    q, s = quantize_rows_torch(torch.randn(m, k, generator=gen))
    x = torch.randn(1, k, generator=gen)
    wf = torch.randn(n, k, generator=gen) * 0.05

    def run():
        if m == 1:
            return [triton_gemv.gemv_fp8(q, s, w, ws, torch.float32, config=config),
                    triton_gemv.gemv(x, wf, config=config)]
        return [triton_gemv.rows_fp8(q, s, w, ws, torch.float32, config=config)]

    plain = run()
    from triton_interp import pdl_on

    calls = pdl_on(monkeypatch, products)
    with_pdl = run()
    for a, b in zip(plain, with_pdl, strict=True):
        assert torch.equal(a, b)
    split = config[4] if m == 1 and len(config) > 4 else config[5] if len(config) > 5 else 1
    programs = -(-n // config[0]) * split * len(plain)
    # the interpreter runs a grid's programs one after another
    first = "launch" if products == "early" else "wait"
    assert calls == [first, ({"launch", "wait"} - {first}).pop()] * programs
    if split > 1:
        _counters_at_rest()
