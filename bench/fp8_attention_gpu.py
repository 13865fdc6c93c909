"""Decode attention over an FP8 KV pool against a bf16 pool, on a CUDA device (issue 28).

Llama-3.1-8B heads (32 query, 8 kv, head_dim 128), page 16, pages scattered at random over
4 layers' pools (as bench/gpu_8b.py --attn), the same random K/V in both pools (the FP8 pool
holds value / scale, scale = amax / 448). For each case (batch x context) and pool: Triton
tile configs (positions per tile, warps, stages; the FP8 pool with its dots in bf16, as
served today, and in fp16) beside the KV-read bound (pool bytes / copy bandwidth), and each
config's largest error against an fp32 reference on the same pool values.

    PYTHONPATH=. python3 bench/fp8_attention_gpu.py --out DIR     (writes DIR/fp8_attention.json)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_gpu as ag  # noqa: E402

from bucketserve.kernels import triton_attention as ta  # noqa: E402
from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 16, 4
CONFIGS = [(64, 4, 3), (128, 4, 3), (128, 4, 4), (128, 8, 3), (256, 8, 3), (256, 4, 2),
           (64, 2, 4), (128, 2, 3), (32, 4, 4)]


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
              ctx: int) -> torch.Tensor:
    """fp32 attention of q [B, Hq, D] over the pool values (already dequantized) [nb,P,Hkv,D]."""
    b = q.shape[0]
    k = kc[tables.long()].reshape(b, -1, HKV, D)[:, :ctx].float()  # [B, ctx, Hkv, D]
    v = vc[tables.long()].reshape(b, -1, HKV, D)[:, :ctx].float()
    qg = q.float().view(b, HKV, HQ // HKV, D)
    s = torch.einsum("bhgd,bnhd->bhgn", qg, k) * D ** -0.5
    return torch.einsum("bhgn,bnhd->bhgd", s.softmax(-1), v).reshape(b, HQ, D)


def case(batch: int, ctx: int, bw: float, gen: torch.Generator, pools: set[str]) -> None:
    nb = batch * math.ceil(ctx / PAGE) + 1
    meta = ag.decode_meta(batch, ctx, nb, gen)
    vals = torch.randn(LAYERS, 2, nb, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    scales = [(vals[i, 0].float().abs().amax().item() / FP8_MAX,
               vals[i, 1].float().abs().amax().item() / FP8_MAX) for i in range(LAYERS)]
    fp8 = torch.empty(vals.shape, device="cuda", dtype=FP8_DTYPE)
    for i, (ks, vs) in enumerate(scales):
        fp8[i, 0] = (vals[i, 0].float() / ks).to(FP8_DTYPE)
        fp8[i, 1] = (vals[i, 1].float() / vs).to(FP8_DTYPE)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    splits_auto = ta.choose_num_splits(batch, HKV, ctx, torch.cuda.get_device_properties(0)
                                       .multi_processor_count)
    refs = {"bf16": reference(q, vals[0, 0], vals[0, 1], meta.block_tables, ctx),
            "fp8": reference(q, fp8[0, 0].float() * scales[0][0],
                             fp8[0, 1].float() * scales[0][1], meta.block_tables, ctx)}
    for pool_name, pool, f16s in (("bf16", vals, (False,)), ("fp8", fp8, (False, True))):
        if pool_name not in pools:
            continue
        bound_us = batch * ctx * HKV * D * 2 * pool.element_size() / bw * 1e6
        for f16 in f16s:
            for splits in sorted({splits_auto, max(1, splits_auto // 2)}):
                for block_n, warps, stages in CONFIGS:
                    def run(splits=splits, block_n=block_n, warps=warps, stages=stages,
                            f16=f16, pool=pool):
                        for layer in range(LAYERS):
                            sc = scales[layer] if pool.dtype == FP8_DTYPE else (1.0, 1.0)
                            ta.paged_decode(q, pool[layer, 0], pool[layer, 1],
                                            meta.block_tables, meta.seq_lens, batch,
                                            D ** -0.5, out, splits, block_n, warps, stages,
                                            kv_scales=sc, f16_dot=f16)
                    row = dict(batch=batch, ctx=ctx, pool=pool_name,
                               dot="fp16" if f16 else "bf16", splits=splits,
                               cfg=f"n{block_n} w{warps} s{stages}", bound_us=bound_us)
                    try:
                        sc0 = scales[0] if pool.dtype == FP8_DTYPE else (1.0, 1.0)
                        ta.paged_decode(q, pool[0, 0], pool[0, 1], meta.block_tables,
                                        meta.seq_lens, batch, D ** -0.5, out, splits, block_n,
                                        warps, stages, kv_scales=sc0, f16_dot=f16)
                        err = (out.float() - refs[pool_name]).abs().max().item()
                        us = ag.graph_ms(run) / LAYERS * 1e3
                        ag.record("decode", **row, us=us, x_bound=us / bound_us, max_err=err)
                    except Exception as e:  # noqa: BLE001 - a config this GPU cannot run
                        ag.record("decode", **row, error=str(e)[:160])
    del vals, fp8
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--cases", default="256x512,64x512,256x2048,1x2048")
    ap.add_argument("--pools", default="bf16,fp8")
    ap.add_argument("--configs", default="",
                    help="tile configs 'n64w2s4,...' (default: the built-in list)")
    args = ap.parse_args()
    if args.configs:
        CONFIGS[:] = [tuple(int(x) for x in c[1:].replace("w", " ").replace("s", " ").split())
                      for c in args.configs.split(",")]
    props = torch.cuda.get_device_properties(0)
    ag.record("device", name=props.name, sms=props.multi_processor_count)
    bw = ag.copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    for c in args.cases.split(","):
        b, n = (int(x) for x in c.split("x"))
        case(b, n, bw, gen, set(args.pools.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_attention.json").write_text(json.dumps(ag.RESULTS, indent=1))


if __name__ == "__main__":
    main()
