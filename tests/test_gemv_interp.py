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
