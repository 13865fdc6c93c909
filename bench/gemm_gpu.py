"""The projections of a decoder layer as GEMMs on one GPU: cuBLAS vs cuBLASLt vs a Triton tile sweep.

For a model shape (default the Llama-3.1-8B one of gpu_throughput.SHAPES) and each row count M
(the tokens of a step: 1 for a single decode, 256 for a full decode batch), every projection
y = x @ W^T (qkv, o, gate_up, down, lm_head) is timed replayed from a CUDA graph, over 8
rotating weight copies so that L2 does not hold them (a layer's weights are read once per
step). Printed per (projection, M): microseconds, TFLOP/s and weight GB/s for torch's default
BLAS, cuBLASLt (`torch.backends.cuda.preferred_blas_library`) and the best of a small Triton
tile sweep, and per M the sum over one layer times the layers plus the lm_head: what a decode
step's GEMMs cost with each.

With `--gemv`, one-row cells also time the Triton GEMV of kernels/triton_gemv.py over its
config sweep (the best config per projection is printed and goes into the "best" sum).

    python3 bench/gemm_gpu.py [--shape llama-8b] [--rows 1,16,64,128,256,512] [--gemv] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

import gpu_throughput as gt  # noqa: E402

from bucketserve.kernels.cuda_timing import graph_us  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines
    triton = None


if triton is not None:
    @triton.jit
    def _mm_kernel(a_ptr, w_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP: tl.constexpr):
        # c[M, N] = a[M, K] @ w[N, K]^T, row-major, bf16 in, fp32 accumulate
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BM)
        grid_n = tl.cdiv(N, BN)
        width = GROUP * grid_m
        g = pid // width
        first_n = g * GROUP
        size = tl.minimum(grid_n - first_n, GROUP)
        pid_n = first_n + (pid % width) % size
        pid_m = (pid % width) // size
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a = a_ptr + rm[:, None] * K + rk[None, :]
        w = w_ptr + rn[:, None] * K + rk[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            av = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] < K - k * BK), other=0.0)
            wv = tl.load(w, mask=(rn[:, None] < N) & (rk[None, :] < K - k * BK), other=0.0)
            acc = tl.dot(av, tl.trans(wv), acc)
            a += BK
            w += BK
        c = c_ptr + rm[:, None] * N + rn[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


CONFIGS = [  # (BM, BN, BK, warps, stages)
    (16, 64, 128, 4, 5), (16, 128, 128, 4, 4), (16, 256, 64, 4, 4), (32, 64, 128, 4, 5),
    (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4),
]


def triton_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple) -> None:
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm_kernel[grid](x, w, out, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps,
                     num_stages=stages)


def best_config(run, configs, x, ws, out, ref, copies: int) -> tuple[float, list] | None:
    """(microseconds, config) of the fastest config whose result is right, or None."""
    best = None
    for cfg in configs:
        try:
            run(x, ws[0], out, cfg)
            err = (out.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
            if err > 2e-2:
                continue
            us = graph_us(lambda i, cfg=cfg: run(x, ws[i % copies], out, cfg))
        except Exception:  # noqa: BLE001 - a config this GPU cannot run
            continue
        if best is None or us < best[0]:
            best = (us, list(cfg))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--rows", default="1,16,64,128,256,512")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--gemv", action="store_true", help="time kernels/triton_gemv at one row")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    s = gt.SHAPES[args.shape]
    h, inter, layers, vocab = s["hidden_size"], s["intermediate_size"], s["num_layers"], s["vocab_size"]
    q, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    projs = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter),
             "lm_head": (vocab, h)}
    dt = torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shape": args.shape, "rows": rows, "cells": []}
    for name, (n, k) in projs.items():
        copies = 2 if name == "lm_head" else args.copies
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            out = torch.empty(m, n, device="cuda", dtype=dt)
            flops, wbytes = 2 * m * n * k, n * k * 2
            cell = {"proj": name, "M": m, "N": n, "K": k}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = graph_us(lambda i, x=x, ws=ws, out=out, c=copies: torch.mm(x, ws[i % c].t(), out=out))
                cell[lib] = us
            torch.backends.cuda.preferred_blas_library("cublas")
            ref = F.linear(x, ws[0]).float()
            if triton is not None and not args.no_triton:
                best = best_config(triton_mm, CONFIGS, x, ws, out, ref, copies)
                if best:
                    cell["triton"], cell["triton_cfg"] = best
            if args.gemv and m == 1:
                from bucketserve.kernels import triton_gemv

                best = best_config(lambda x, w, out, cfg: triton_gemv.gemv(x, w, out, cfg),
                                   triton_gemv.CONFIGS, x, ws, out, ref, copies)
                if best:
                    cell["gemv"], cell["gemv_cfg"] = best
            for key in ("cublas", "cublaslt", "triton", "gemv"):
                if key in cell:
                    us = cell[key]
                    cell[key + "_tflops"] = flops / us / 1e6
                    cell[key + "_gbs"] = wbytes / us / 1e3
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    print("\nper decode step (layers x (qkv + o + gate_up + down) + lm_head), ms")
    res["steps"] = []
    for m in rows:
        row = {"M": m}
        for key in ("cublas", "cublaslt", "triton", "best"):
            tot = 0.0
            for c in res["cells"]:
                if c["M"] != m:
                    continue
                v = (min(c.get(x, 1e18) for x in ("cublas", "cublaslt", "triton", "gemv"))
                     if key == "best" else c.get(key))
                if v is None:
                    tot = float("nan")
                    break
                tot += v * (1 if c["proj"] == "lm_head" else layers)
            row[key] = tot / 1e3
        res["steps"].append(row)
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
