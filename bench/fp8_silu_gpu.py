"""SiLU-and-mul with FP8 quantization (kernels/triton_fp8.silu_and_mul_quant): the one-pass
kernel (a row a program, the whole row in registers) against the chunked two-pass kernel
(the row's largest magnitude first, then the chunks again from L2) over chunk sizes and warps.

For each half-row width I (14,336: Llama-3.1-8B; 8,192: the 1B shape) and row count, the
kernels are timed replayed from a CUDA graph over rotating inputs (so that L2 does not hold
them), dynamic scales, with and without deferred input scales (fp8_ops.Deferred). Printed: us
a call and the bytes moved (2I in, I + a scale out) per second; the codes of every variant
are checked equal to the one-pass kernel's first.

    python3 bench/fp8_silu_gpu.py [--widths 14336,8192] [--rows 1,64,256,1024,4096] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bucketserve.kernels import triton_fp8  # noqa: E402
from bucketserve.kernels.cuda_timing import graph_us  # noqa: E402

VARIANTS = [None, (512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="14336,8192")
    ap.add_argument("--rows", default="1,64,256,1024,4096")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cells": []}
    for n in (int(w) for w in args.widths.split(",")):
        for t in (int(r) for r in args.rows.split(",")):
            copies = max(2, min(8, (256 << 20) // (t * 2 * n * 2)))
            xs = [torch.randn(t, 2 * n, device="cuda", dtype=torch.bfloat16)
                  for _ in range(copies)]
            rs = torch.rand(t, 1, device="cuda") + 0.5
            cs = torch.rand(2 * n, device="cuda") + 0.5
            for scaled in (False, True):
                sc = (rs, cs) if scaled else None
                base = triton_fp8.silu_and_mul_quant(xs[0], None, sc)
                cell: dict = {"I": n, "rows": t, "deferred": scaled}
                for v in VARIANTS:
                    name = "one_pass" if v is None else f"chunk{v[0]}_w{v[1]}"
                    got = triton_fp8.silu_and_mul_quant(xs[0], None, sc, chunked=v)
                    same = torch.equal(got[0].view(torch.uint8), base[0].view(torch.uint8)) \
                        and torch.equal(got[1], base[1])
                    us = graph_us(lambda i, v=v, xs=xs, c=copies, sc=sc: (
                        triton_fp8.silu_and_mul_quant(xs[i % c], None, sc, chunked=v)), copies)
                    cell[name] = round(us, 2)
                    cell[name + "_tbs"] = round(t * (4 * n + n + 4) / us / 1e6, 2)
                    if not same:
                        cell.setdefault("differs", []).append(name)
                best = min((k for k in cell if k.startswith("chunk") and not k.endswith("_tbs")),
                           key=lambda k: cell[k])
                cell["best_chunked"], cell["speedup"] = best, round(cell["one_pass"] / cell[best], 3)
                res["cells"].append(cell)
                print(json.dumps(cell), flush=True)
            del xs
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
