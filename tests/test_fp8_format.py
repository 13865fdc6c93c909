"""The shared FP8 weight format (kernels/fp8.py): quantize per channel, dequantize every layout."""

import pytest
import torch

from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8_per_channel


def test_per_channel_round_trip_and_scale():
    torch.manual_seed(0)
    w = torch.randn(48, 80, dtype=torch.bfloat16) * torch.linspace(0.01, 3.0, 48)[:, None].bfloat16()
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (48,)
    # each row's largest magnitude maps onto the format's largest value
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    back = dequantize_fp8(q, scale)
    rel = (back - w.float()).abs().amax(dim=1) / w.float().abs().amax(dim=1)
    assert rel.max() < 2 ** -3  # e4m3: 3 mantissa bits
    assert torch.equal(dequantize_fp8(q, scale[:, None]), back)


def test_zero_row_is_finite():
    w = torch.zeros(4, 8)
    w[1] = 1.0
    q, scale = quantize_fp8_per_channel(w)
    back = dequantize_fp8(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back, w)


def test_block_and_tensor_scales():
    torch.manual_seed(1)
    q = (torch.randn(200, 300) * 50).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    s = torch.rand(2, 3) + 0.5  # 128 x 128 blocks, last ones partial
    full = dequantize_fp8(q, s)
    assert torch.equal(full[:128, :128], q.float()[:128, :128] * s[0, 0])
    assert torch.equal(full[128:, 256:], q.float()[128:, 256:] * s[1, 2])
    assert torch.equal(dequantize_fp8(q, torch.tensor(2.0)), q.float() * 2.0)
    with pytest.raises(ValueError):
        dequantize_fp8(q, torch.rand(7))
