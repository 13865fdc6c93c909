"""bucketserve vs vLLM offline at the Llama-3.1-8B shape (issue 11), one command, one GPU.

Workload: the seeded mixed token-id requests of gpu_throughput.py / vllm_peer_rep.py (prompts
16..1024 log-uniform, max_tokens 16..256, EOS ignored), random bf16 weights, tied embeddings.
Per shape and step budget, bucketserve runs LLMEngine.generate on each request count after a
16-request warm-up, `--repeats` timed runs, and reports the median output tok/s; per step kind
(prefill / mixed / decode) the steps, seconds, tokens computed and the padding rows of the
compiled shapes among them. Then:
  * decode step time (runner.run of a pure-decode batch, host work included) at context 512
    for `--batches`, beside the byte floor (weights + KV read over the copy bandwidth);
  * `--profile`: torch.profiler per-kernel tables of one mixed step and one decode step,
    grouped into GEMM / attention / norm / rope / silu / KV write / other;
  * `--attn`: attention kernels at the model's head shape: Triton paged prefill (tile
    configs) vs SDPA (flash, cuDNN, efficient) over contiguous K/V; Triton paged decode (tile
    configs) vs SDPA; beside the KV-read bound.
With `--vllm-site DIR` (vLLM 0.25.1 installed with pip --target) vLLM runs first, in a
subprocess (`vllm_peer_rep.py SHAPE N1,N2 REPEATS`, APC=0: prefix caching off, since the
timed runs repeat the same prompts), on the same shapes and request counts.

    PYTHONPATH=. python3 bench/gpu_8b.py --out $OUT [--shapes llama-8b] [--requests 256,1024]
        [--budgets auto] [--modes graphs] [--profile] [--attn] [--vllm-site /tmp/site]

Writes OUT/gpu_8b.json and prints a summary (ours / vLLM ratio per shape and request count).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

import gpu_throughput as gt  # noqa: E402

from bucketserve.buckets import load_buckets  # noqa: E402
from bucketserve.engine.llm_engine import LLMEngine  # noqa: E402
from bucketserve.engine.scheduler import ScheduledBatch  # noqa: E402
from bucketserve.engine.sequence import SamplingParams, Sequence  # noqa: E402
from bucketserve.models.config import ModelConfig  # noqa: E402
from bucketserve.models.loader import LoadedModel, build_dummy_model  # noqa: E402

RES: dict = {"runs": [], "step_times": [], "profiles": [], "attention": [], "vllm": []}
# modes: extra TOML per mode (the step budget is added per --budgets entry)
MODES = {
    "graphs": "",  # the shipped defaults (prefill / mixed steps as whole graphs: MixedGraphs)
    # prefill / mixed steps as graphs of everything but attention (the default before MixedGraphs)
    "piecewise": '[prefill]\nmixed_graphs = "piecewise"\n',
    "pad": '[prefill]\npiecewise_choice = "pad"\n',  # always the next captured size
    # the defaults before issue 11: padded piecewise steps, power-of-two decode graphs
    "legacy": '[prefill]\npiecewise_choice = "pad"\npiecewise_sizes = [16, 32, 64, 128, 256, 512, '
              '1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192, 9216, 10240, 11264, 12288, 13312, '
              '14336, 15360, 16384]\n'
              "[decode]\nbatch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]\n",
    # the new piecewise sizes with the old decode graphs, and the old piecewise sizes with the new
    # decode graphs (to tell which of the two changes moves a shape's throughput)
    "legacy_dec": "[decode]\nbatch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]\n",
    "legacy_pw": '[prefill]\npiecewise_choice = "pad"\npiecewise_sizes = [16, 32, 64, 128, 256, 512, '
                 '1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]\n',
    "nopiece": None,  # decode graphs only: prefill and mixed steps eager
    "run512": "[scheduler]\nmax_running = 512\n",  # twice the running set
    "nogemv": '[decode]\ngemv = "off"\n',  # one-row projections by cuBLAS
    # issue 28: FP8 weights (W8A8, quantized on load), and FP8 weights with an FP8 KV pool
    "fp8": '[model]\nquantization = "fp8"\n',
    "fp8kv": '[model]\nquantization = "fp8"\n[kv_cache]\ndtype = "fp8"\n',
    # the GPU defaults before max_running / max_batched_tokens "auto" became 1,024 / 16,384
    # (vLLM's own on this GPU) and the decode graphs went up to 1,024
    "run256": "[scheduler]\nmax_running = 256\nmax_batched_tokens = 8192\n[decode]\n"
              "batch_sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, "
              "192, 208, 224, 240, 256]\n",
}


def emit(section: str, row: dict) -> None:
    RES[section].append(row)
    print(section, json.dumps(row)[:2000], flush=True)


def make_engine(shape: str, budget: str, mode: str, tmp: str) -> LLMEngine:
    cfg = ModelConfig(**gt.SHAPES[shape], max_position_embeddings=gt.MAX_MODEL_LEN,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_ids=(2,))
    text = MODES.get(mode) or ""
    # The timed runs repeat the same prompts: with prefix caching on, every run after the first
    # would skip most of its prefill (vLLM runs with APC=0 for the same reason).
    if budget != "auto" and "max_batched_tokens" not in text:
        text += ("" if "[scheduler]" in text else "[scheduler]\n")
        text += f"max_batched_tokens = {int(budget)}\n"
    if "[kv_cache]" in text:
        text = text.replace("[kv_cache]\n", "[kv_cache]\nprefix_caching = false\n")
    else:
        text += "[kv_cache]\nprefix_caching = false\n"
    path = None
    if text:
        path = Path(tmp) / f"buckets_{mode}_{budget}.toml"
        path.write_text(text)
    buckets = load_buckets(str(path) if path else None, max_model_len=gt.MAX_MODEL_LEN)
    model = build_dummy_model(cfg, "cuda", torch.bfloat16, seed=0,
                              quantization=buckets.quantization)
    loaded = LoadedModel(model, gt.word_tokenizer(cfg.vocab_size), cfg, shape, gt.MAX_MODEL_LEN)
    eng = LLMEngine(loaded, buckets, "cuda", piecewise_graphs=mode != "nopiece")
    eng.stats.recent = deque(maxlen=1_000_000)  # every step of the timed runs
    return eng


def bound_ms(shape: str, batch: int, context: int, bw_gbs: float, engine: LLMEngine) -> float:
    """gpu_throughput.bound_ms for the engine's element sizes: its projections' weights (1 byte
    with FP8), the bf16 LM head / tied embedding, the KV pool's (1 byte with FP8)."""
    s = gt.SHAPES[shape]
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_layers"], s["vocab_size"]
    q, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    w_bytes = 1 if engine.quant.weights == "fp8" else 2
    kv_bytes = engine.runner.kv_cache.element_size()
    read = w_bytes * layers * per_layer + 2 * v * h + kv_bytes * layers * 2 * kv * context * batch
    return read / (bw_gbs * 1e9) * 1e3


def kinds_since(engine: LLMEngine, n_before: int, snap_before: dict) -> dict:
    steps = list(engine.stats.recent)[n_before - engine.stats.num_steps:]
    out: dict[str, dict] = {}
    for s in steps:
        k = out.setdefault(s.kind, {"steps": 0, "seconds": 0.0, "tokens": 0, "computed": 0,
                                    "padding": 0})
        k["steps"] += 1
        k["seconds"] += s.step_time_s
        k["computed"] += s.computed_tokens
        k["padding"] += s.padding_tokens
        k["tokens"] += s.computed_tokens - s.padding_tokens
    for k in out.values():
        k["padding_share"] = k["padding"] / k["computed"] if k["computed"] else 0.0
    return out


def run_generate(engine: LLMEngine, reqs, repeats: int) -> dict:
    params = [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True, detokenize=False)
              for _, t in reqs]
    prompts = [p for p, _ in reqs]
    engine.generate(prompts[:16], params[:16])  # warm-up, as the vLLM peer does
    rates, kinds, host = [], [], []
    runner = engine.runner
    for _ in range(repeats):
        n0, snap = engine.stats.num_steps, engine.stats.snapshot()
        t_before = dict(runner.step_timing)
        c_before = (runner.num_graph_steps, runner.num_piecewise_steps,
                    runner.num_cost_eager_steps)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ntok = sum(o.num_output_tokens for o in outs)
        assert ntok == sum(t for _, t in reqs), (ntok, sum(t for _, t in reqs))
        rates.append(ntok / dt)
        kinds.append(kinds_since(engine, n0, snap))
        # host seconds in the runner's launch (inputs, forward launches, sampling launches) and
        # how the steps ran: decode graphs, piecewise graphs, eager by the cost model
        h = {k: round(runner.step_timing[k] - t_before[k], 4) for k in t_before}
        c_after = (runner.num_graph_steps, runner.num_piecewise_steps,
                   runner.num_cost_eager_steps)
        names = ("graph_steps", "piecewise_steps", "cost_eager_steps")
        h.update(wall_s=round(dt, 4),
                 **{k: a - b for k, a, b in zip(names, c_after, c_before, strict=True)})
        host.append(h)
    med = sorted(range(repeats), key=rates.__getitem__)[repeats // 2]
    computed = sum(k["computed"] for k in kinds[med].values())
    padding = sum(k["padding"] for k in kinds[med].values())
    return dict(out_tok_s=rates[med], all_out_tok_s=rates, step_kinds=kinds[med], host=host,
                padding_share=padding / computed if computed else 0.0,
                generated_tokens=sum(t for _, t in reqs))


# ---- one mixed and one decode step, profiled -------------------------------------------------

def make_batch(engine: LLMEngine, decodes: int, ctx: int, prompts: list[int], vocab: int,
               seed: int = 0) -> ScheduledBatch:
    import random

    rng = random.Random(seed)
    bm = engine.block_manager
    seqs, counts = [], []
    for _ in range(decodes):
        s = Sequence([rng.randrange(100, vocab - 1) for _ in range(ctx)],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        bm.allocate(s, ctx)
        s.num_computed_tokens = ctx - 1
        seqs.append(s)
        counts.append(1)
    for n in prompts:
        s = Sequence([rng.randrange(100, vocab - 1) for _ in range(n)],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        bm.allocate(s, n)
        seqs.append(s)
        counts.append(n)
    kind = "decode" if not prompts else ("prefill" if not decodes else "mixed")
    return ScheduledBatch(seqs, counts, decodes, kind, 0, 0, sum(counts))


def categorize(name: str) -> str:
    n = name.lower()
    if any(x in n for x in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm100_")):
        return "gemm"
    if "_decode_kernel" in n or "merge_splits" in n:
        return "attn_decode"
    if "_prefill_kernel" in n or "flash" in n or "fmha" in n or "cudnn" in n or "attention" in n:
        return "attn_prefill"
    if "write_kv" in n:
        return "kv_write"
    if "rms_norm" in n:
        return "rmsnorm"
    if "rotary" in n:
        return "rope"
    if "silu" in n:
        return "silu_mul"
    if "memcpy" in n or "copy" in n:
        return "copy"
    return "other"


def profile_step(engine: LLMEngine, batch: ScheduledBatch, label: str, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.runner.run(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        engine.runner.run(batch)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 5 * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.runner.run(batch)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev > 0:  # kernels (CPU-side ops have no self device time)
            rows.append((e.key, dev / 1e3, e.count))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    cats: dict[str, float] = {}
    for name, ms, _ in rows:
        c = categorize(name)
        cats[c] = cats.get(c, 0.0) + ms
    res = dict(label=label, tokens=batch.num_tokens, num_seqs=len(batch.seqs),
               wall_ms=wall_ms, kernel_ms=total,
               categories={k: round(v, 3) for k, v in sorted(cats.items(), key=lambda x: -x[1])},
               top=[dict(kernel=n[:90], ms=round(ms, 3), calls=c) for n, ms, c in rows[:top]])
    for s in batch.seqs:
        engine.block_manager.free(s)
    return res


# ---- attention kernels at the model's head shape --------------------------------------------

def bench_attention(shape: str, bw: float) -> None:
    from torch.nn.attention import SDPBackend

    s = gt.SHAPES[shape]
    heads = (s["num_heads"], s["num_kv_heads"], s["head_dim"])
    gen = torch.Generator().manual_seed(0)
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    # prefill: (query len, context len) per sequence
    cases = {"8x512": [(512, 512)] * 8, "4x1024": [(1024, 1024)] * 4,
             "32x128": [(128, 128)] * 32, "mix": [(1024, 1024), (700, 700), (300, 300),
                                                   (100, 100), (40, 40)] * 2,
             "chunk512@1536": [(512, 1536)] * 2}
    for name, seqs in cases.items():
        _prefill_case(name, seqs, heads, gen, backends)
        torch.cuda.empty_cache()
    for batch, ctx in [(1, 512), (1, 2048), (64, 512), (256, 512)]:
        _decode_case(batch, ctx, heads, gen, backends, bw)
        torch.cuda.empty_cache()


def _prefill_case(name: str, seqs: list[tuple[int, int]], heads: tuple[int, int, int],
                  gen: torch.Generator, backends: dict) -> None:
    import itertools
    import math

    import attention_gpu as ag
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from bucketserve.kernels import triton_attention as ta

    hq, hkv, d = heads
    dt, page = torch.bfloat16, 16
    pages = [math.ceil(n / page) for _, n in seqs]
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
    kc = torch.randn(nb, page, hkv, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=dt)
    out = torch.empty_like(q)
    pairs = sum(sum(n - ql + i + 1 for i in range(ql)) for ql, n in seqs)
    flops = 4 * pairs * d * hq

    def row(impl: str, cfg: str, fn) -> None:
        try:
            ms = ag.graph_ms(fn)
            emit("attention", dict(kind="prefill", case=name, impl=impl, cfg=cfg, us=ms * 1e3,
                                   tflops=flops / (ms * 1e-3) / 1e12))
        except Exception as e:  # noqa: BLE001 - config or backend unsupported here
            emit("attention", dict(kind="prefill", case=name, impl=impl, cfg=cfg,
                                   error=str(e)[:200]))

    for bm, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3),
                                  (128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3),
                                  (128, 32, 4, 3)]:
        def run(bm=bm, bn=bn, warps=warps, stages=stages):
            ta.paged_prefill(q, kc, vc, tables, seq_lens, qsl, 0, len(seqs), max(qlens),
                             d ** -0.5, out, bm, bn, warps, stages)
        row("triton", f"m{bm} n{bn} w{warps} s{stages}", run)
    # SDPA over contiguous K/V, one call per sequence (causal; for a chunk, a mask)
    qs = [torch.randn(1, hq, ql, d, device="cuda", dtype=dt) for ql, _ in seqs]
    ks = [torch.randn(1, hkv, n, d, device="cuda", dtype=dt) for _, n in seqs]
    chunk = any(ql != n for ql, n in seqs)
    for bname, b in backends.items():
        for gqa in ("enable_gqa", "expand"):
            def sdpa(b=b, gqa=gqa):
                with sdpa_kernel([b]):
                    for qq, kk in zip(qs, ks, strict=True):
                        if gqa == "expand":
                            kk = kk.repeat_interleave(hq // hkv, dim=1)
                        if chunk:
                            ql, n = qq.shape[2], kk.shape[2]
                            mask = (torch.arange(n, device="cuda")[None, :]
                                    <= torch.arange(n - ql, n, device="cuda")[:, None])
                            F.scaled_dot_product_attention(qq, kk, kk, attn_mask=mask,
                                                           enable_gqa=gqa == "enable_gqa")
                        else:
                            F.scaled_dot_product_attention(qq, kk, kk, is_causal=True,
                                                           enable_gqa=gqa == "enable_gqa")
            row(f"sdpa_{bname}", gqa, sdpa)
    if chunk:
        return
    # varlen flash (torch.nn.attention.varlen, if this torch has it), fresh K/V only
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        emit("attention", dict(kind="prefill", case=name, impl="varlen_attn", error=str(e)[:100]))
        return
    kf = torch.randn(sum(qlens), hkv, d, device="cuda", dtype=dt)
    for gqa in ("native", "expand"):
        kx = kf if gqa == "native" else kf.repeat_interleave(hq // hkv, dim=1)

        def vl(kx=kx):
            varlen_attn(q, kx, kx, qsl, qsl, max(qlens), max(qlens), is_causal=True)
        row("varlen_attn", gqa, vl)


def _decode_case(batch: int, ctx: int, heads: tuple[int, int, int], gen: torch.Generator,
                 backends: dict, bw: float) -> None:
    """Decode attention over 4 layers' pools (pages scattered): Triton tile configs and split
    counts around the automatic one, SDPA over contiguous K/V as the peer."""
    import math

    import attention_gpu as ag
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from bucketserve.kernels import triton_attention as ta

    hq, hkv, d = heads
    dt, page, nl = torch.bfloat16, 16, 4
    nb = batch * math.ceil(ctx / page) + 1
    pool = torch.randn(nl, 2, nb, page, hkv, d, device="cuda", dtype=dt)
    meta = ag.decode_meta(batch, ctx, nb, gen)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dt)
    out = torch.empty_like(q)
    bound_us = batch * ctx * hkv * d * 2 * 2 / bw * 1e6
    auto = ta.choose_num_splits(batch, hkv, 2048,
                                torch.cuda.get_device_properties(0).multi_processor_count)

    def row(impl: str, cfg: str, fn) -> None:
        try:
            us = ag.graph_ms(fn) / nl * 1e3
            emit("attention", dict(kind="decode", batch=batch, ctx=ctx, impl=impl, cfg=cfg,
                                   us=us, bound_us=bound_us))
        except Exception as e:  # noqa: BLE001
            emit("attention", dict(kind="decode", batch=batch, ctx=ctx, impl=impl, cfg=cfg,
                                   error=str(e)[:160]))

    for splits in sorted({max(1, auto // 2), auto, min(16, auto * 2)}):
        for block_n, warps, stages in [(128, 4, 3), (64, 4, 3), (64, 4, 4), (128, 8, 3),
                                       (32, 4, 4)]:
            def run(splits=splits, block_n=block_n, warps=warps, stages=stages):
                for layer in range(nl):
                    ta.paged_decode(q, pool[layer, 0], pool[layer, 1], meta.block_tables,
                                    meta.seq_lens, batch, d ** -0.5, out, splits, block_n,
                                    warps, stages)
            cfg = f"sp{splits} n{block_n} w{warps} s{stages}"
            row("triton", cfg + (" (current)" if splits == auto and block_n == 128
                                 and warps == 4 and stages == 3 else ""), run)
    # SDPA peer over contiguous K/V, the query group as query rows: [B, Hkv, G, D]
    kk = torch.randn(nl, batch, hkv, ctx, d, device="cuda", dtype=dt)
    qg = q.view(batch, hkv, hq // hkv, d)
    for bname, b in backends.items():
        def sd(b=b):
            with sdpa_kernel([b]):
                for layer in range(nl):
                    F.scaled_dot_product_attention(qg, kk[layer], kk[layer])
        row(f"sdpa_{bname}_contig", "", sd)


# ---- vLLM ------------------------------------------------------------------------------------

def default_vllm_script() -> str:
    for p in (ROOT / ".gpuassets/bench/vllm_peer_rep.py", ROOT.parent / ".gpuassets/bench/vllm_peer_rep.py",
              ROOT.parent / "shared/bench/vllm_peer_rep.py", Path("/work/shared/bench/vllm_peer_rep.py")):
        if p.exists():
            return str(p)
    return ""


def run_vllm(site: str, script: str, shape: str, requests: str, repeats: int,
             timeout: float) -> list[dict]:
    env = dict(os.environ, APC="0", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               VLLM_USE_FLASHINFER_SAMPLER="0",
               PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.run([sys.executable, script, shape, requests, str(repeats)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = None
    else:
        out = proc.stdout
    rows = [json.loads(line) for line in out.splitlines()
            if line.startswith("{") and '"system"' in line]
    if proc is None or proc.returncode or not any("median_out_tok_s" in r for r in rows):
        err = "timeout" if proc is None else proc.stderr[-3000:]
        rows.append({"system": "vllm", "model": shape, "error": err})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--shapes", default="llama-8b")
    ap.add_argument("--requests", default="256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="auto", help="scheduler.max_batched_tokens values")
    ap.add_argument("--modes", default="graphs", help=f"of {list(MODES)}")
    ap.add_argument("--batches", default="1,256", help="decode step times at context 512")
    ap.add_argument("--profile", action="store_true", help="per-kernel tables (8B-sized steps)")
    ap.add_argument("--attn", action="store_true", help="attention kernels vs SDPA")
    ap.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE", ""))
    ap.add_argument("--vllm-script", default=default_vllm_script())
    ap.add_argument("--vllm-timeout", type=float, default=420.0)
    ap.add_argument("--blas", default="", help="torch.backends.cuda.preferred_blas_library")
    ap.add_argument("--fp8-decode", default="",
                    help="decode over an FP8 pool, comma-separated: 'f16' or 'bf16' (the dots' "
                         "dtype), 'n128w4s3' (a tile config) or 'bf16tiles' (the bf16 pool's); "
                         "else kernels/triton_attention's FP8_* defaults")
    ap.add_argument("--no-fp8-rows", action="store_true",
                    help="FP8 projections of 2..64 rows stay on torch._scaled_mm "
                         "(no triton_gemv.rows_fp8)")
    ap.add_argument("--fp8-fast-accum", action="store_true",
                    help="FP8 GEMMs with torch._scaled_mm's use_fast_accum "
                         "(kernels/fp8_ops.FAST_ACCUM)")
    ap.add_argument("--split-k", action="store_true",
                    help="the start-up choice also times the split-K GEMV / rows_fp8 configs "
                         "(as BUCKETSERVE_SPLIT_K=1 does for the server)")
    ap.add_argument("--pdl", default="",
                    help="the steps whose decode kernels launch with programmatic dependent "
                         "launch: auto, off, all or at most N rows (as BUCKETSERVE_PDL does "
                         "for the server, whose value it takes when not given; kernels/pdl.py)")
    args = ap.parse_args()
    from bucketserve.kernels import pdl
    if args.pdl:
        pdl.MAX_ROWS = pdl.max_rows(args.pdl)
    if args.split_k:
        from bucketserve.kernels import triton_gemv
        triton_gemv.SPLIT_MAX_N = triton_gemv.SPLIT_OUTPUTS
    if args.fp8_fast_accum:
        from bucketserve.kernels import fp8_ops
        fp8_ops.FAST_ACCUM = True
    if args.no_fp8_rows:
        from bucketserve.kernels import triton_gemv
        triton_gemv.ROW_BANDS = ()
    from bucketserve.kernels import triton_attention as ta
    for part in filter(None, args.fp8_decode.split(",")):
        if part in ("f16", "bf16"):
            ta.FP8_F16_DOT = part == "f16"
        elif part == "bf16tiles":
            ta.FP8_DECODE_TILES = None
        else:
            n, rest = part[1:].split("w")
            w, st = rest.split("s")
            ta.FP8_DECODE_TILES = (int(n), int(w), int(st))
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out_json = Path(args.out) / "gpu_8b.json"
    RES["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                  "argv": sys.argv[1:], "blas": args.blas or "default",
                  "fp8_decode": args.fp8_decode or "default",
                  "fp8_rows": not args.no_fp8_rows, "fp8_fast_accum": args.fp8_fast_accum,
                  "split_k": args.split_k, "pdl_max_rows": pdl.MAX_ROWS,
                  "pdl_products": pdl.PRODUCTS}
    bw = gt.copy_bandwidth_gbs()
    RES["env"]["copy_bw_gbs"] = bw

    def save() -> None:
        out_json.write_text(json.dumps(RES, indent=1))

    shapes = args.shapes.split(",")
    if args.vllm_site:
        for shape in shapes:
            for row in run_vllm(args.vllm_site, args.vllm_script, shape, args.requests,
                                args.repeats, args.vllm_timeout):
                emit("vllm", row)
            save()
    if args.attn:
        bench_attention(shapes[0], bw * 1e9)
        save()
    tmp = tempfile.mkdtemp()
    for shape in shapes:
        vocab = gt.SHAPES[shape]["vocab_size"]
        for budget in args.budgets.split(","):
            for mode in args.modes.split(","):
                t0 = time.perf_counter()
                try:
                    engine = make_engine(shape, budget, mode, tmp)
                except Exception as e:  # noqa: BLE001 - keep the other configurations
                    emit("runs", dict(model=shape, budget=budget, mode=mode, error=repr(e)[:800]))
                    continue
                startup = time.perf_counter() - t0
                RES["env"].setdefault("cuda_info", {})[mode] = engine.cuda_info
                for n in [int(x) for x in args.requests.split(",") if x]:
                    r = run_generate(engine, gt.mixed_workload(vocab, n=n), args.repeats)
                    r.update(model=shape, requests=n, budget=engine.max_batched_tokens, mode=mode,
                             startup_s=startup, cuda_info=engine.cuda_info,
                             kv_blocks=engine.block_manager.num_usable_blocks,
                             kv_tokens=engine.block_manager.num_usable_blocks
                             * engine.block_manager.block_size,
                             quant=engine.quant.describe())
                    pw = engine.runner.piecewise
                    if pw is not None and getattr(pw, "cost", None) is not None:
                        r["cost_model"] = pw.cost.describe()
                    emit("runs", r)
                    save()
                first = budget == args.budgets.split(",")[0] and (
                    mode == args.modes.split(",")[0] or mode.startswith("fp8"))
                if first:
                    for st in gt.step_times(engine, [int(b) for b in args.batches.split(",")],
                                            512, vocab, "cuda"):
                        st.update(model=shape, mode=mode, bound_ms=bound_ms(
                            shape, st["batch"], 512, bw, engine))
                        st["ratio"] = st["step_ms"] / st["bound_ms"]
                        emit("step_times", st)
                    if args.profile:
                        mixed = make_batch(engine, 192, 512, [1024, 1024, 512, 512, 256, 256, 128,
                                                              64, 32, 16], vocab)
                        emit("profiles", profile_step(engine, mixed, "mixed 192 decodes + 3824 "
                                                      "prompt tokens"))
                        dec = make_batch(engine, 256, 512, [], vocab)
                        emit("profiles", profile_step(engine, dec, "decode 256 x ctx 512"))
                        dec1 = make_batch(engine, 1, 512, [], vocab)
                        emit("profiles", profile_step(engine, dec1, "decode 1 x ctx 512", top=12))
                    save()
                del engine
                gc.collect()
                torch.cuda.empty_cache()
                left = torch.cuda.memory_allocated() / 2**30
                if left > 1.0:  # seen at 8B: the next engine's KV budget then comes out ~0
                    print(f"warning: {left:.1f} GiB still allocated after the {mode} engine; "
                          "run the next mode in its own process", flush=True)
    save()
    print("\nshape         N     budget mode     ours tok/s  vLLM tok/s  ratio  padding")
    for r in RES["runs"]:
        if "out_tok_s" not in r:
            continue
        v = [x["median_out_tok_s"] for x in RES["vllm"]
             if x.get("model") == r["model"] and x.get("n") == r["requests"]
             and "median_out_tok_s" in x]
        vt = v[0] if v else float("nan")
        print(f"{r['model']:13s} {r['requests']:5d} {r['budget']:6d} {r['mode']:8s} "
              f"{r['out_tok_s']:10.0f} {vt:11.0f} {r['out_tok_s'] / vt:6.2f} "
              f"{r['padding_share']:7.1%}  eager from "
              f"{r.get('cost_model', {}).get('eager_from')} tokens; runs "
              f"{[round(x) for x in r['all_out_tok_s']]}")
        for k, v in r["step_kinds"].items():
            print(f"    {k:8s} steps {v['steps']:5d} s {v['seconds']:7.3f} computed {v['computed']:8d}"
                  f" padding {v['padding_share']:6.1%}")
        print("    host", r["host"][len(r["host"]) // 2])
    base = {r["requests"]: r["out_tok_s"] for r in RES["runs"]
            if r.get("mode") == "graphs" and "out_tok_s" in r}
    for r in RES["runs"]:
        if r.get("mode", "").startswith("fp8") and r["requests"] in base:
            print(f"{r['mode']} vs bf16 at {r['requests']} requests: "
                  f"{r['out_tok_s'] / base[r['requests']]:.2f}x; KV pool {r['kv_tokens']} tokens")
    for s in RES["step_times"]:
        print(f"decode {s['model']} {s.get('mode')} batch {s['batch']}: {s['step_ms']:.2f} ms, byte floor "
              f"{s['bound_ms']:.2f} ms, {s['ratio']:.2f}x")
    for p in RES["profiles"]:
        print(f"\n{p['label']}: wall {p['wall_ms']:.2f} ms, kernels {p['kernel_ms']:.2f} ms",
              p["categories"])


if __name__ == "__main__":
    main()
