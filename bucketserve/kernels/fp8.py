"""FP8 (float8_e4m3fn) weight formats: the one quantization and dequantization that every FP8
path shares (quantize-on-load, pre-quantized checkpoints, tests).

A quantized weight is `q` [out, in] in float8_e4m3fn with a float32 `scale` such that
`q.float() * scale` approximates the original, where `scale` is one of:
- a scalar (per tensor),
- [out] or [out, 1] (per output channel),
- [ceil(out / b0), ceil(in / b1)] (block-wise, e.g. 128 x 128 as Qwen3 / DeepSeek ship it).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale kept, so that an all-zero row does not divide by zero.
MIN_SCALE = 1e-12


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (q [out, in] float8_e4m3fn, scale [out] float32), with
    scale = max|w_row| / 448, computed in float32."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_(min=MIN_SCALE)
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """(q, scale) in any of the layouts above -> float32 [out, in]; `block` is the block shape
    of a block-wise scale (the checkpoint's `weight_block_size`)."""
    out, inp = q.shape
    qf = q.float()
    s = scale.float()
    if s.numel() == 1:
        return qf * s.reshape(())
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1):
        if s.shape[0] != out:
            raise ValueError(f"per-channel scale of {s.shape[0]} rows for a weight of {out}")
        return qf * s.reshape(out, 1)
    if s.dim() != 2:
        raise ValueError(f"unsupported scale shape {tuple(s.shape)}")
    b0, b1 = block
    if -(-out // b0) != s.shape[0] or -(-inp // b1) != s.shape[1]:
        raise ValueError(f"block scale {tuple(s.shape)} does not tile a weight of {(out, inp)}")
    full = s.repeat_interleave(b0, dim=0)[:out].repeat_interleave(b1, dim=1)[:, :inp]
    return qf * full
