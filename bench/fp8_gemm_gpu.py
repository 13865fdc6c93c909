"""FP8 (W8A8) GEMMs of the decoder projections by row count: torch._scaled_mm against Triton tiles.

For a model shape (default Llama-3.1-8B) and each row count M (a decode batch, a prefill or
mixed step), every projection (qkv, o, gate_up, down) is timed replayed from a CUDA graph over
rotating weight copies (so L2 does not hold them), as:

* `bf16`: cuBLAS bf16 (torch.mm), the project's bf16 path;
* `row` / `row_fast`: torch._scaled_mm with row-wise scales (what fp8_ops.fp8_linear runs),
  use_fast_accum off / on;
* `tensor` / `tensor_fast`: torch._scaled_mm with one scale per operand (cuBLASLt), off / on;
  the ceiling of the library's FP8 GEMM without the row-wise epilogue;
* `triton` / `triton_fast`: kernels/triton_fp8_gemm.fp8_mm, best of its tile configs, with each
  K tile's sum promoted to float32 / accumulated in the MMA.

Each FP8 result's largest error against the float32 product of the same FP8 operands (relative
to the largest output) is recorded too. Printed: microseconds and TFLOP/s per cell, and per M
the layer sum times the layers (a step's projection GEMMs, LM head excluded).

    python3 bench/fp8_gemm_gpu.py [--rows 128,256,...] [--json FILE] [--no-triton]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gpu_throughput as gt  # noqa: E402

from bucketserve.kernels import triton_fp8_gemm as tg  # noqa: E402
from bucketserve.kernels.cuda_timing import graph_us  # noqa: E402
from bucketserve.kernels.fp8 import quantize_fp8_per_channel  # noqa: E402
from bucketserve.kernels.fp8_ops import quantize_rows  # noqa: E402


def measure(name: str, n: int, k: int, m: int, wb: list, wq: list, c: int,
            one: torch.Tensor, triton: bool = True) -> dict:
    """One (projection, M) cell: every variant's microseconds (and FP8 errors)."""
    calls = c if m <= 4096 else 2
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_rows(x)
    ref = ((xq.float() * xs) @ (wq[0][0].float() * wq[0][1].view(-1, 1)).t())
    refmax = ref.abs().max().item()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cell: dict = {"proj": name, "M": m, "N": n, "K": k}

    def err() -> float:
        return round((out.float() - ref).abs().max().item() / refmax, 6)

    def scaled(i: int, fast: bool, rowwise: bool = True) -> torch.Tensor:
        w, ws = wq[i % c]
        return torch._scaled_mm(xq, w.t(), scale_a=xs if rowwise else one,
                                scale_b=ws.view(1, -1) if rowwise else one,
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    cell["bf16"] = graph_us(lambda i: torch.mm(x, wb[i % c].t(), out=out), calls)
    for key, fast in (("row", False), ("row_fast", True)):
        out.copy_(scaled(0, fast))
        cell[key + "_err"] = err()
        cell[key] = graph_us(lambda i, fast=fast: scaled(i, fast), calls)
    for key, fast in (("tensor", False), ("tensor_fast", True)):
        cell[key] = graph_us(lambda i, fast=fast: scaled(i, fast, rowwise=False), calls)
    for key, promote in (("triton", True), ("triton_fast", False)) if triton else ():
        best = None
        for cfg in tg.CONFIGS:
            try:
                tg.fp8_mm(xq, xs, wq[0][0], wq[0][1], cfg, promote, out=out)
                e = err()
                if not e < 2e-2:
                    continue
                us = graph_us(lambda i, cfg=cfg, promote=promote: tg.fp8_mm(
                    xq, xs, wq[i % c][0], wq[i % c][1], cfg, promote, out=out), calls)
            except Exception as exc:  # noqa: BLE001 - a config this GPU cannot run
                cell.setdefault("failed", []).append([key, list(cfg), repr(exc)[:120]])
                continue
            cell.setdefault(key + "_all", []).append([list(cfg), round(us, 2)])
            if best is None or us < best[0]:
                best = (us, list(cfg), e)
        if best:
            cell[key], cell[key + "_cfg"], cell[key + "_err"] = best
    flops = 2 * m * n * k
    for key in ("bf16", "row", "row_fast", "tensor", "tensor_fast", "triton", "triton_fast"):
        if key in cell:
            cell[key] = round(cell[key], 2)
            cell[key + "_tflops"] = round(flops / cell[key] / 1e6, 1)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--rows", default="128,256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--projs", default="qkv,o,gate_up,down")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-triton", action="store_true", help="library GEMMs only (no tiles)")
    args = ap.parse_args()
    s = gt.SHAPES[args.shape]
    h, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_layers"]
    q, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    projs = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    projs = {k: v for k, v in projs.items() if k in args.projs.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "shape": args.shape, "rows": rows, "cells": []}
    one = torch.ones((), device="cuda")
    for name, (n, k) in projs.items():
        c = args.copies
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(c)]
        wq = [quantize_fp8_per_channel(w) for w in wb]
        for m in rows:
            cell = measure(name, n, k, m, wb, wq, c, one, not args.no_triton)
            res["cells"].append(cell)
            brief = {k2: v for k2, v in cell.items() if not k2.endswith("_all")}
            print(json.dumps(brief), flush=True)
        del wb, wq
        torch.cuda.empty_cache()
    print("\nper step: layers x (" + " + ".join(projs) + "), ms")
    res["steps"] = []
    for m in rows:
        row = {"M": m}
        for key in ("bf16", "row", "row_fast", "tensor", "tensor_fast", "triton", "triton_fast"):
            cells = [c2 for c2 in res["cells"] if c2["M"] == m]
            if all(key in c2 for c2 in cells):
                row[key] = round(sum(c2[key] for c2 in cells) * layers / 1e3, 3)
        best = sum(min(c2["row"], c2.get("triton", 1e18)) for c2 in res["cells"] if c2["M"] == m)
        row["best_exact"] = round(best * layers / 1e3, 3)
        res["steps"].append(row)
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
