#!/usr/bin/env python3
"""Split K in the few-row FP8 products, alone (docs/quantization.md, "Split K for the narrow
few-row products"): for the 8B shape's narrow projections (down 4096x14336, o 4096x4096, qkv
6144x4096; 8 random FP8 weights each, rotating so that L2 does not hold them), the start-up
choice of kernels/triton_gemv.choose_fp8_rows per row band (16, 32, 64 rows) over every
candidate, split ones included, against the same choice over the unsplit candidates alone.
Prints per shape {band: (the full choice's info, the unsplit best's us)}. CUDA only.

    PYTHONPATH=$PWD python3 bench/fp8_split_gpu.py
"""

from __future__ import annotations

import torch

from bucketserve.kernels import triton_gemv as g
from bucketserve.kernels.fp8 import quantize_fp8_per_channel


def main() -> None:
    g.SPLIT_MAX_N = g.SPLIT_OUTPUTS  # what BUCKETSERVE_SPLIT_K=1 sets
    plain_candidates = [c for c in g.ROW_CANDIDATES if len(c) == 5]
    for n, k in ((4096, 14336), (4096, 4096), (6144, 4096)):
        ws, ss = [], []
        for _ in range(8):
            w, s = quantize_fp8_per_channel(torch.randn(n, k, device="cuda") * 0.02)
            ws.append(w)
            ss.append(s)
        full = g.choose_fp8_rows(ws, ss)
        plain = g.choose_fp8_rows(ws, ss, plain_candidates)
        print(n, k, {b: (full[b][0], plain[b][0]["gemv_us"]) for b in full}, flush=True)


if __name__ == "__main__":
    main()
