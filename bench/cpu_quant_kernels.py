"""CPU projection kernels at the served model's shapes: float32 packed GEMM against every
quantized candidate (the Q4_1 blocks and the per-row int8 of kernels/csrc/quant_gemm.c,
PyTorch's int4pack and int8pack weight-only kernels, fbgemm's dynamic int8 with one activation
scale per call), decode- and prefill-sized rows.

Every kernel multiplies the real SmolLM2-135M GGUF weights (all 30 layers rotating, so that
the caches hold what they would in a forward) by random float32 activations. Prints one line
per (rows, projection) with microseconds per product, and the sum over a layer's four
projections; --json FILE keeps them. Run it under `flock -x /work/cpu.lock`.

    PYTHONPATH=. python bench/cpu_quant_kernels.py [--rows 1 16 64 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings

import torch

from bucketserve.kernels import cpu_plan, cpu_quant
from bucketserve.models.gguf_loader import read_gguf
from bucketserve.models.loader import linear_parts
from bucketserve.models.registry import resolve

# 20-100x slower than the rest at 16 rows (their float32 paths are not vectorized for these
# shapes on this torch): measured at small row counts only (--slow-max-rows)
SLOW = ("int4pack (torch)", "int8pack (torch)")


def best_us(fn, n: int, reps: int) -> float:
    for i in range(n):  # warm-up: every layer once
        fn(i)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def pack_fbgemm(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fbgemm's packed form of an int8 weight with per-channel scales."""
    torch.backends.quantized.engine = "fbgemm"
    qw = torch._make_per_channel_quantized_tensor(
        q, scale.double(), torch.zeros(q.shape[0], dtype=torch.int64), 0)
    return torch.ops.quantized.linear_prepack(qw, None)


def candidates(blocks: list[torch.Tensor], weights: list[torch.Tensor], k: int,
               gemm: str | None) -> dict:
    """name -> (prepared per layer, fn(prepared, x)); gemm: the CPU plan's packed float32 GEMM."""
    n = weights[0].shape[0]
    out: dict = {}
    if gemm is not None:
        out["fp32 packed (" + gemm + ")"] = (
            [(cpu_plan.pack_weight(gemm, w), w) for w in weights],
            lambda p, x: cpu_plan.packed_linear(gemm, x, p[0], p[1], None))
    out["q4_1 blocks (quant_gemm.c)"] = (
        blocks, lambda b, x: cpu_quant.q_linear(x, cpu_quant.Q4_1, b, k))
    # PyTorch's weight-only 4-bit: the same values as (q - 8) * scale + zero, zero = m + 8 d
    q4 = []
    for b in blocks:
        raw = b.view(n, k // 32, 20)
        d = raw[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
        m = raw[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
        qs = raw[..., 4:].to(torch.int32)
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)
        sz = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).contiguous()
        q4.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz))
    out["int4pack (torch)"] = (
        q4, lambda p, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], 32, p[1]))
    int8 = [cpu_quant.quantize_int8_per_channel(w) for w in weights]
    out["int8 per row (quant_gemm.c)"] = (
        [(q, q.sum(dim=1, dtype=torch.int32), s) for q, s in int8],
        lambda p, x: cpu_quant.int8_linear(x, *p))
    out["int8pack (torch)"] = (int8, lambda p, x: torch._weight_int8pack_mm(x, p[0], p[1]))
    out["int8 dynamic (fbgemm)"] = (
        [pack_fbgemm(q, s) for q, s in int8],
        lambda p, x: torch.ops.quantized.linear_dynamic(x, p, False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slow-max-rows", type=int, default=16)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    contents = read_gguf(resolve("smollm2-135m-instruct").path,
                         keep_blocks=frozenset(cpu_quant.BLOCKS))
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    per_name: dict[str, list[torch.Tensor]] = {nm: [] for nm in names}
    for fused, parts in linear_parts(contents.config).items():
        b = torch.cat([contents.blocks[p + ".weight"][1] for p in parts])
        per_name[fused.rsplit(".", 1)[1]].append(b)
    flags = cpu_plan.cpu_flags()
    record = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(),
                          "isa": sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))),
                          "torch_capability": torch.backends.cpu.get_cpu_capability(),
                          "quant_gemm": cpu_quant.build_info()},
              "rows": {}}
    print(f"torch {torch.__version__} ({record['machine']['torch_capability']}), "
          f"{torch.get_num_threads()} threads, quant_gemm {record['machine']['quant_gemm']}")
    prepared = {}
    for nm in names:
        blocks = per_name[nm]
        k = blocks[0].shape[1] // 20 * 32
        weights = [cpu_quant.dequantize(cpu_quant.Q4_1, b, k) for b in blocks]
        gemm = cpu_plan.with_measured_gemm(cpu_plan.resolve_cpu_plan(), weights[0]).gemm
        prepared[nm] = (k, candidates(blocks, weights, k, gemm))
    for rows in args.rows:
        table: dict[str, dict[str, float]] = {}
        for nm in names:
            k, cands = prepared[nm]
            x = torch.randn(rows, k)
            for label, (per_layer, fn) in cands.items():
                if label in SLOW and rows > args.slow_max_rows:
                    continue
                us = best_us(lambda i, p=per_layer, f=fn, x=x: f(p[i], x), len(per_layer),
                             args.reps)
                table.setdefault(label, {})[nm] = round(us, 1)
        for label, row in table.items():
            row["layer"] = round(sum(row.values()), 1)
            print(f"rows {rows:4d}  {label:28s} " +
                  "  ".join(f"{nm} {row[nm]:9.1f}" for nm in (*names, "layer")) + "  us")
        record["rows"][str(rows)] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
