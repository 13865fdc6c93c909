"""GPU microbenchmarks for the Triton kernels (bucketserve/kernels/triton_*.py).

One run measures, on the current CUDA device (bf16, random data, scattered random pages):
  1. copy bandwidth (device-to-device, bytes read + written): the memory ceiling;
  2. decode attention (K/V write + paged attention) for all layers of one step, SmolLM2-135M
     and Llama-3.2-1B head shapes, batch 1..256, context 512 and 4096: Triton with the
     automatic split-K count, Triton without splits, and SDPA over contiguous per-sequence
     K/V (no paging) as a peer; each beside the KV-read bound (KV bytes / copy bandwidth);
  3. a small sweep of decode tile sizes and of prefill tile configs (prefill vs SDPA flash);
  4. the fused small ops of kernels/triton_ops.py vs the torch code the model runs now;
  5. the whole model's decode step (dummy weights) eager and through kernels/cuda_graphs.py
     (input copies + replay + eager logits), beside the bound (weights + KV read) / copy
     bandwidth, if bucketserve.models is importable.
All GPU timings are CUDA-event medians; "graph" timings replay a CUDA graph holding the
work several times, so they exclude launch overhead.

    PYTHONPATH=. python3 bench/attention_gpu.py --out DIR      (writes DIR/attention_gpu.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bucketserve.kernels import triton_attention as ta  # noqa: E402
from bucketserve.kernels import triton_ops  # noqa: E402
from bucketserve.kernels.attention import AttentionMetadata, forward_context  # noqa: E402

SHAPES = {  # name: (Hq, Hkv, D, layers)
    "smollm2-135m": (9, 3, 64, 30),
    "llama-3.2-1b": (32, 8, 64, 16),
}
PAGE = 16
DT = torch.bfloat16
RESULTS: dict[str, list] = {}


def record(section: str, **row) -> None:
    RESULTS.setdefault(section, []).append(row)
    print(section, " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()), flush=True)


def events_ms(fn: Callable[[], None], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def eager_ms(fn: Callable[[], None], iters: int = 20, trials: int = 5) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(events_ms(fn, iters) for _ in range(trials))


def graph_ms(fn: Callable[[], None], reps: int = 5, trials: int = 15) -> float:
    """Median time of one fn() when `reps` calls replay from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ms = statistics.median(events_ms(g.replay, 1) for _ in range(trials)) / reps
    del g
    return ms


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n, device="cuda", dtype=DT)
    dst = torch.empty_like(src)
    ms = eager_ms(lambda: dst.copy_(src), iters=10)
    bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    record("copy", GB_per_s=bw / 1e9, ms=ms)
    return bw


def decode_meta(batch: int, ctx: int, num_blocks: int, gen: torch.Generator) -> AttentionMetadata:
    """batch decodes at context ctx, pages scattered at random over the pool."""
    per = math.ceil(ctx / PAGE)
    perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * per] + 1
    tables = perm.view(batch, per).to(torch.int32)
    pos = ctx - 1
    slots = tables[:, pos // PAGE].long() * PAGE + pos % PAGE
    return AttentionMetadata(
        slot_mapping=slots.cuda(), query_start_loc=torch.arange(batch + 1, dtype=torch.int32).cuda(),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32).cuda(), block_tables=tables.cuda(),
        num_decodes=batch, max_query_len=1, max_seq_len=ctx,
        query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx] * batch)


def decode_attention_case(shape: str, batch: int, ctx: int, bw: float,
                          gen: torch.Generator) -> None:
    hq, hkv, d, layers = SHAPES[shape]
    kv_layer = batch * ctx * hkv * d * 2 * 2  # K and V, bf16
    # enough layers that the timed K/V is several times the 60 MB L2
    nl = min(layers, max(2, math.ceil(512e6 / kv_layer)))
    nb = batch * math.ceil(ctx / PAGE) + 1
    pool = torch.randn(nl, 2, nb, PAGE, hkv, d, device="cuda", dtype=DT)
    meta = decode_meta(batch, ctx, nb, gen)
    q = torch.randn(batch, hq, d, device="cuda", dtype=DT)
    k = torch.randn(batch, hkv, d, device="cuda", dtype=DT)
    v = torch.randn_like(k)

    def step(backend):
        def run():
            with forward_context(meta):
                for layer in range(nl):
                    backend.forward(q, k, v, pool[layer, 0], pool[layer, 1], d ** -0.5)
        return run

    auto = ta.TritonAttentionBackend()
    splits = auto.num_splits(meta, hkv, q.device)
    t_auto = graph_ms(step(auto)) / nl
    t_one = graph_ms(step(ta.TritonAttentionBackend(decode_splits=1))) / nl
    t_eager = eager_ms(step(auto)) / nl
    # peer: SDPA over contiguous [B, Hkv, ctx, D] per layer (no paging, no write)
    kc = torch.randn(nl, batch, hkv, ctx, d, device="cuda", dtype=DT)
    vc = torch.randn_like(kc)
    qs = q.view(batch, hq, 1, d)

    def sdpa():
        for layer in range(nl):
            F.scaled_dot_product_attention(qs, kc[layer], vc[layer], enable_gqa=True)
    try:
        t_sdpa = graph_ms(sdpa) / nl
    except RuntimeError as e:  # no GQA-capable fused SDPA kernel
        print("sdpa failed:", str(e)[:200])
        t_sdpa = float("nan")
    bound_us = kv_layer / bw * 1e6
    record("decode_attn", shape=shape, batch=batch, ctx=ctx, splits=splits,
           triton_us=t_auto * 1e3, triton_nosplit_us=t_one * 1e3,
           triton_eager_us=t_eager * 1e3, sdpa_contig_us=t_sdpa * 1e3,
           kv_bound_us=bound_us, x_bound=t_auto * 1e3 / bound_us,
           step_attn_ms=t_auto * layers)


def bench_decode_attention(bw: float, gen: torch.Generator) -> None:
    cases = [(b, 512) for b in (1, 8, 64, 256)] + [(b, 4096) for b in (1, 8, 64)]
    for shape in SHAPES:
        for batch, ctx in cases:
            decode_attention_case(shape, batch, ctx, bw, gen)
            torch.cuda.empty_cache()


def decode_tiles_case(batch: int, ctx: int, gen: torch.Generator) -> None:
    hq, hkv, d, _ = SHAPES["llama-3.2-1b"]
    nl = 4
    nb = batch * math.ceil(ctx / PAGE) + 1
    pool = torch.randn(nl, 2, nb, PAGE, hkv, d, device="cuda", dtype=DT)
    meta = decode_meta(batch, ctx, nb, gen)
    q = torch.randn(batch, hq, d, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    splits = ta.TritonAttentionBackend().num_splits(meta, hkv, q.device)
    for block_n, warps, stages in [(64, 2, 2), (64, 2, 3), (128, 4, 2), (128, 4, 3),
                                   (128, 4, 4), (256, 8, 3)]:
        def run(block_n=block_n, warps=warps, stages=stages):
            for layer in range(nl):
                ta.paged_decode(q, pool[layer, 0], pool[layer, 1], meta.block_tables,
                                meta.seq_lens, batch, d ** -0.5, out, splits, block_n, warps,
                                stages)
        record("decode_tiles", batch=batch, ctx=ctx, splits=splits, block_n=block_n,
               warps=warps, stages=stages, us=graph_ms(run) / nl * 1e3)


def bench_decode_tiles(gen: torch.Generator) -> None:
    for batch, ctx in [(64, 512), (256, 512), (8, 4096)]:
        decode_tiles_case(batch, ctx, gen)
        torch.cuda.empty_cache()


def prefill_case(name: str, seqs: list[tuple[int, int]], gen: torch.Generator) -> None:
    """seqs: (query len, context len) per sequence."""
    hq, hkv, d, _ = SHAPES["llama-3.2-1b"]
    pages = [math.ceil(n / PAGE) for _, n in seqs]
    nb = sum(pages) + 1
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    for i, p in enumerate(pages):
        tables[i, :p] = torch.tensor(perm[:p], dtype=torch.int32)
        perm = perm[p:]
    tables = tables.cuda()
    qlens = [ql for ql, _ in seqs]
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32).cuda()
    seq_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32).cuda()
    kc = torch.randn(nb, PAGE, hkv, d, device="cuda", dtype=DT)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    pairs = sum(sum(n - ql + i + 1 for i in range(ql)) for ql, n in seqs)
    flops = 4 * pairs * d * hq
    for bm, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3),
                                  (64, 128, 4, 2)]:
        def run(bm=bm, bn=bn, warps=warps, stages=stages):
            ta.paged_prefill(q, kc, vc, tables, seq_lens, qsl, 0, len(seqs), max(qlens),
                             d ** -0.5, out, bm, bn, warps, stages)
        ms = graph_ms(run)
        record("prefill", case=name, block_m=bm, block_n=bn, warps=warps, stages=stages,
               us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12)
    if any(ql != n for ql, n in seqs):
        return
    # peer: SDPA (flash) per sequence over contiguous K/V
    ks = [torch.randn(1, hkv, n, d, device="cuda", dtype=DT) for _, n in seqs]
    qs = [torch.randn(1, hq, n, d, device="cuda", dtype=DT) for _, n in seqs]

    def sdpa():
        for qq, kk in zip(qs, ks, strict=True):
            F.scaled_dot_product_attention(qq, kk, kk, is_causal=True, enable_gqa=True)
    try:
        ms = graph_ms(sdpa)
        record("prefill", case=name, block_m="sdpa", us=ms * 1e3,
               tflops=flops / (ms * 1e-3) / 1e12)
    except RuntimeError as e:
        print("sdpa prefill failed:", str(e)[:200])


def bench_prefill(gen: torch.Generator) -> None:
    cases = {"4x512": [(512, 512)] * 4, "1x2048": [(2048, 2048)], "16x128": [(128, 128)] * 16,
             "chunk512@2048": [(512, 2048)]}
    for name, seqs in cases.items():
        prefill_case(name, seqs, gen)
        torch.cuda.empty_cache()


def fused_ops_case(t: int) -> None:
    hq, hkv, d, _ = SHAPES["llama-3.2-1b"]
    hidden, inter = 2048, 8192
    w = torch.randn(hidden, device="cuda", dtype=DT)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cache = triton_ops.cos_sin_cache(inv_freq.cuda(), 8192)
    cache_model = cache.to(DT)
    x = torch.randn(t, hidden, device="cuda", dtype=DT)
    r = torch.randn_like(x)

    def norm_torch():  # what llama.py runs now: residual add, then F.rms_norm
        F.rms_norm(r + x, (hidden,), w, 1e-5)

    def norm_fused():
        triton_ops.rms_norm(x, w, 1e-5, r)

    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=DT)
    pos = torch.randint(0, 8192, (t,), device="cuda")

    def rope_torch():  # llama.py's in-place rotate-half on the qkv buffer
        qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
        cs = cache_model[pos].unsqueeze(1)
        cos, sin = cs[..., : d // 2], cs[..., d // 2:]
        x1, x2 = qk[..., : d // 2], qk[..., d // 2:]
        x1o = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
        x2.mul_(cos).addcmul_(x1o, sin)

    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)

    def rope_fused():
        triton_ops.apply_rotary(q, k, pos, cache)

    gu = torch.randn(t, 2 * inter, device="cuda", dtype=DT)

    def silu_torch():
        F.silu(gu[:, :inter]) * gu[:, inter:]

    def silu_fused():
        triton_ops.silu_and_mul(gu)

    for op, a, b in [("rmsnorm+res", norm_torch, norm_fused), ("rotary", rope_torch, rope_fused),
                     ("silu_mul", silu_torch, silu_fused)]:
        ta_us, tb_us = graph_ms(a, reps=20) * 1e3, graph_ms(b, reps=20) * 1e3
        record("fused_ops", op=op, tokens=t, torch_us=ta_us, triton_us=tb_us,
               speedup=ta_us / tb_us)


def bench_fused_ops() -> None:
    for t in (1, 64, 256, 2048):
        fused_ops_case(t)


MODEL_SHAPES = {  # HF config fields of the two benchmark shapes (dummy weights)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
}


def fused_forward(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """llama.py's forward rewritten over kernels/triton_ops.py (benchmark only): fused
    residual-add + RMSNorm, one rotary kernel for q and k, fused SiLU-and-mul."""
    m, eps = model.model, model.config.rms_norm_eps
    t = ids.shape[0]
    res = m.embed_tokens(ids)
    x, _ = triton_ops.rms_norm(res, m.layers[0].input_layernorm.weight, eps)
    delta = None
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        if i:
            x, res = triton_ops.rms_norm(delta, layer.input_layernorm.weight, eps, res)
        qkv = a.qkv_proj(x)
        q = qkv[:, : a.q_size].view(t, a.num_heads, a.head_dim)
        k = qkv[:, a.q_size: a.q_size + a.kv_size].view(t, a.num_kv_heads, a.head_dim)
        v = qkv[:, a.q_size + a.kv_size:].view(t, a.num_kv_heads, a.head_dim)
        q, k = triton_ops.apply_rotary(q, k, pos, model.cos_sin)
        o = a.attn_backend.forward(q, k, v, a.k_cache, a.v_cache, a.scale)
        x, res = triton_ops.rms_norm(a.o_proj(o.reshape(t, a.q_size)),
                                     layer.post_attention_layernorm.weight, eps, res)
        delta = layer.mlp.down_proj(triton_ops.silu_and_mul(layer.mlp.gate_up_proj(x)))
    h, _ = triton_ops.rms_norm(delta, m.norm.weight, eps, res)
    return h


def model_step_case(name: str, model, cfg, batch: int, ctx: int, bw: float,
                    gen: torch.Generator) -> None:
    from bucketserve.kernels.cuda_graphs import DecodeGraphs

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nb = batch * math.ceil(ctx / PAGE) + 1
    kv = torch.randn(cfg.num_layers, 2, nb, PAGE, cfg.num_kv_heads, cfg.head_dim,
                     device="cuda", dtype=DT)
    model.bind_kv_cache(kv)
    meta = decode_meta(batch, ctx, nb, gen)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), ctx - 1, dtype=torch.long, device="cuda")

    def eager_step():
        with torch.inference_mode(), forward_context(meta):
            model.compute_logits(model(ids, pos))

    # DecodeGraphs as a runner would use it: copy the inputs in, replay, logits eagerly
    graphs = DecodeGraphs(model, [batch], meta.block_tables.shape[1], cfg.max_position_embeddings,
                          "cuda")
    stats = graphs.capture()

    def graph_step():
        with torch.inference_mode():
            model.compute_logits(graphs.run(ids, pos, meta))
    kv_read = batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    bound_ms = (weight_bytes + kv_read) / bw * 1e3
    t_eager = eager_ms(eager_step, iters=10)
    t_graph = eager_ms(graph_step, iters=20)
    record("model_step", model=name, batch=batch, ctx=ctx, eager_ms=t_eager,
           graph_ms=t_graph, bound_ms=bound_ms, graph_x_bound=t_graph / bound_ms,
           eager_over_graph=t_eager / t_graph, capture_s=stats.seconds,
           graph_mib=stats.pool_bytes / 2**20)

    # what the fused ops would give: both forwards captured the same way (no input copies)
    def plain():
        with torch.inference_mode(), forward_context(meta):
            model.compute_logits(model(ids, pos))

    def fused():
        with torch.inference_mode(), forward_context(meta):
            model.compute_logits(fused_forward(model, ids, pos))
    with torch.inference_mode(), forward_context(meta):
        kv0 = kv.clone()
        diff = (model(ids, pos) - fused_forward(model, ids, pos)).abs().max().item()
        kv.copy_(kv0)
    t_plain, t_fused = graph_ms(plain, reps=3, trials=10), graph_ms(fused, reps=3, trials=10)
    record("model_fused", model=name, batch=batch, graph_ms=t_plain, fused_graph_ms=t_fused,
           speedup=t_plain / t_fused, max_abs_hidden_diff=diff)


def bench_model_step(bw: float, gen: torch.Generator) -> None:
    try:
        from bucketserve.models.config import ModelConfig
        from bucketserve.models.loader import build_dummy_model
    except Exception as e:  # the models package is another helper's work in progress
        print("model step skipped:", repr(e)[:300])
        return
    for name, fields in MODEL_SHAPES.items():
        cfg = ModelConfig(**fields)
        model = build_dummy_model(cfg, "cuda", DT, attn_backend=ta.TritonAttentionBackend())
        for batch in (1, 8, 64, 256):
            model_step_case(name, model, cfg, batch, 512, bw, gen)
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="copy,decode,tiles,prefill,ops,model")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    import triton

    props = torch.cuda.get_device_properties(0)
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(info)
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    sections = [("decode", lambda: bench_decode_attention(bw, gen)),
                ("tiles", lambda: bench_decode_tiles(gen)), ("prefill", lambda: bench_prefill(gen)),
                ("ops", bench_fused_ops), ("model", lambda: bench_model_step(bw, gen))]
    for key, fn in sections:
        if key in parts:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # keep the other sections' numbers
                print(f"section {key} failed: {e!r}"[:2000])
            print(f"[{key}: {time.perf_counter() - t0:.1f}s]", flush=True)
            Path(args.out, "attention_gpu.json").write_text(
                json.dumps({"info": info, "results": RESULTS}, indent=1))


if __name__ == "__main__":
    main()
