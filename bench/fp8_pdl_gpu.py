#!/usr/bin/env python3
"""Programmatic dependent launch in the FP8 decode chain (kernels/pdl.py,
docs/quantization.md "Programmatic dependent launch"): the 8B shape's per-layer FP8 kernels
for a few rows, replayed from a CUDA graph, launched without PDL and with it.

One graph step is 32 layers of: rms_norm_quant (with the residual) -> qkv product ->
quantize_rows of 4,096 of its columns (attention's place) -> o product -> rms_norm_quant ->
gate_up product -> silu_and_mul_quant -> down product. Eight layers of random FP8 weights
rotate (1.75 GB: L2 holds none of it). Each product runs what the model would run at that
row count: the start-up choice of kernels/triton_gemv (choose_fp8 for one row, choose_fp8_rows
for the row band; _scaled_mm where no kernel wins), made once with PDL off. For each row count
a graph of each variant is captured (A without PDL; E, L: with it, the products letting the
next kernel launch early or after their K loop; Q: the short kernels with it, the products
without), then replayed in turn, the order reversed every round; reported: the median step
time of each over --rounds, A's time over each other's, and the weights' byte floor at the
device's measured copy rate. CUDA only (PDL needs compute capability 9.0).

    PYTHONPATH=$PWD python3 bench/fp8_pdl_gpu.py [--rows 1,16,32,64] [--out $OUT/pdl.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_throughput import copy_bandwidth_gbs  # noqa: E402

from bucketserve.kernels import pdl, triton_fp8  # noqa: E402
from bucketserve.kernels import triton_gemv as g  # noqa: E402
from bucketserve.kernels.fp8 import quantize_fp8_per_channel  # noqa: E402
from bucketserve.kernels.fp8_ops import fp8_linear  # noqa: E402

H, INTER, QKV, LAYERS, WEIGHTS = 4096, 14336, 6144, 32, 8
VARIANTS = {"A": "off", "E": "early", "L": "late", "Q": "off"}  # name -> pdl.PRODUCTS
SHAPES = {"qkv": (QKV, H), "o": (H, H), "gate_up": (2 * INTER, H), "down": (H, INTER)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--rounds", type=int, default=9, help="replays of each graph, alternating")
    ap.add_argument("--variants", default="A,E,L,Q",
                    help="graphs to compare: A without PDL; with it, the products' trigger E "
                         "early, L late (kernels/pdl.py PRODUCTS), Q products without it")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    variants = args.variants.split(",")
    if variants[0] != "A" or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: A first, then any of {', '.join(VARIANTS)}")
    products = pdl.PRODUCTS
    pdl.MAX_ROWS = 0
    weights = {p: [quantize_fp8_per_channel(torch.randn(n, k, device=dev) * 0.02)
                   for _ in range(WEIGHTS)] for p, (n, k) in SHAPES.items()}
    norm = torch.rand(H, device=dev).to(torch.bfloat16) + 0.5
    floor_bytes = LAYERS * sum(n * k for n, k in SHAPES.values())
    bw = copy_bandwidth_gbs()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bw_gbs": round(bw, 1), "floor_us": round(floor_bytes / bw / 1e3, 1),
              "rows": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
    for m in map(int, args.rows.split(",")):
        choice = {}
        for p, ws in weights.items():
            w, s = [x[0] for x in ws], [x[1] for x in ws]
            if m == 1:
                cfg, info = g.choose_fp8(w, s)
            else:
                info, cfg = g.choose_fp8_rows(w, s)[g.row_band(m)]
            choice[p] = (cfg, info)

        def prod(q, s, p, layer, m=m, choice=choice):
            w, ws = weights[p][layer % WEIGHTS]
            cfg = choice[p][0]
            if cfg is None:
                return fp8_linear((q, s), w, ws, None, torch.bfloat16)
            if m == 1:
                return g.gemv_fp8(q, s, w, ws, config=cfg)
            return g.rows_fp8(q, s, w, ws, config=cfg)

        h = torch.randn(m, H, device=dev).to(torch.bfloat16)
        res = torch.randn(m, H, device=dev).to(torch.bfloat16)

        def step(h=h, res=res, prod=prod):
            x, r = h, res
            for layer in range(LAYERS):
                (q, s), r = triton_fp8.rms_norm_quant(x, norm, 1e-5, r)
                qkv = prod(q, s, "qkv", layer)
                q, s = triton_fp8.quantize_rows(qkv[:, :H])
                o = prod(q, s, "o", layer)
                (q, s), r = triton_fp8.rms_norm_quant(o, norm, 1e-5, r)
                q, s = triton_fp8.silu_and_mul_quant(prod(q, s, "gate_up", layer))
                x = prod(q, s, "down", layer)
            return x

        graphs, outs = {}, {}
        for name in variants:
            pdl.MAX_ROWS = 0 if name == "A" else pdl.ALL_ROWS
            pdl.PRODUCTS = VARIANTS[name]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                outs[name] = step()
        pdl.MAX_ROWS, pdl.PRODUCTS = 0, products
        times: dict[str, list[float]] = {name: [] for name in variants}
        for name in variants + variants[::-1]:
            graphs[name].replay()
        torch.cuda.synchronize()
        same = all(torch.equal(outs["A"], o) for o in outs.values())
        for r in range(args.rounds):
            for name in (variants if r % 2 == 0 else variants[::-1]):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graphs[name].replay()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"choice": {p: (list(c) if c else None) for p, (c, _) in choice.items()},
               "step_us": {k: round(v, 1) for k, v in med.items()},
               "per_layer_us": {k: round(v / LAYERS, 2) for k, v in med.items()},
               "pdl_speedup": {k: round(med["A"] / v, 3) for k, v in med.items() if k != "A"},
               "over_floor": {k: round(v / report["floor_us"], 2) for k, v in med.items()},
               "same_bits": same,
               "spread_us": {k: [round(min(v), 1), round(max(v), 1)] for k, v in times.items()}}
        report["rows"][m] = row
        print(m, json.dumps(row), flush=True)
        del graphs, outs
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
