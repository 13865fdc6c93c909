"""FP8 on a GPU with FP8 tensor cores (compute capability >= 8.9): the fused quantization
kernels against their torch references, the scaled GEMM against the product of the
dequantized operands, and the engine with FP8 weights, an FP8 KV pool and both, through
every compiled shape (decode graphs, whole-step mixed graphs, piecewise graphs), its greedy
tokens beside the bf16 engine's. Skipped elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_channel
from bucketserve.kernels.fp8_ops import (
    fp8_linear,
    quantize_rows,
    quantize_rows_torch,
    rms_norm_quant,
    silu_and_mul_quant,
)
from bucketserve.kernels.triton_ops import rms_norm_torch, silu_and_mul_torch


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores")]

LENGTHS = [8, 600, 33, 250, 9, 128, 511, 17, 64, 300, 12, 90, 450, 40, 200, 25]
MAX_TOKENS = [12, 5, 20, 9, 16, 3, 7, 24, 10, 6, 18, 11, 4, 14, 8, 21]
VOCAB = 1000


def _close_quantized(got, want, max_mismatch: float = 0.01) -> None:
    """Two (q, scale) pairs of the same rows: scales to float32 rounding, and the FP8 codes
    equal except a few one step apart (the fused kernels' rsqrt / exp differ from torch's in
    the last bits of the bf16 value before rounding to FP8)."""
    (q, s), (qr, sr) = got, want
    torch.testing.assert_close(s, sr, rtol=1e-2, atol=0)
    deq, ref = q.float() * s, qr.float() * sr
    assert (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean() <= max_mismatch
    assert ((deq - ref).abs() <= ref.abs() * 2 ** -3 + sr * 2 ** -8).all()


@pytest.mark.parametrize("t, n", [(1, 576), (37, 4096), (300, 1536), (5, 14336)])
def test_fused_quantization_kernels_match_torch(t, n):
    gen = torch.Generator(device="cuda").manual_seed(t + n)
    x = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    q = quantize_rows(x)
    assert q[0].dtype == FP8_DTYPE and q[1].shape == (t, 1)
    # the same arithmetic; Triton's float32 -> e4m3 conversion and torch's disagree on a few
    # values in 10,000 (measured on an H200: 3 in 10^4), one code apart
    _close_quantized(q, quantize_rows_torch(x), max_mismatch=1e-3)
    static = torch.tensor(0.01, device="cuda")
    _close_quantized(quantize_rows(x, static), quantize_rows_torch(x, static), 1e-3)
    for residual in (None, res):
        got, got_res = rms_norm_quant(x, w, 1e-5, residual)
        y, want_res = rms_norm_torch(x, w, 1e-5, residual)
        _close_quantized(got, quantize_rows_torch(y))
        if residual is not None:
            assert torch.equal(got_res, want_res)
    gu = torch.randn(t, 2 * n, device="cuda", dtype=torch.bfloat16, generator=gen)
    _close_quantized(silu_and_mul_quant(gu), quantize_rows_torch(silu_and_mul_torch(gu)))
    _close_quantized(silu_and_mul_quant(gu, static),
                     quantize_rows_torch(silu_and_mul_torch(gu), static))


@pytest.mark.parametrize("t, n, k", [(1, 6144, 4096), (300, 960, 576), (2048, 576, 1536),
                                     (17, 28672, 4096)])
def test_scaled_gemm_matches_dequantized_reference(t, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    wq, ws = quantize_fp8_per_channel(w)
    xq = quantize_rows(x)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = fp8_linear(xq, wq, ws, bias, torch.bfloat16)
    assert out.shape == (t, n) and out.dtype == torch.bfloat16
    ref = (xq[0].float() * xq[1]) @ dequantize_fp8(wq, ws).t() + bias.float()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    # and FP8's own error against the unquantized product stays at its few percent
    exact = x.float() @ w.t() + bias.float()
    assert (out.float() - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("t, n, k", [(1, 6144, 4096), (2048, 576, 1536), (512, 14336, 4096)])
def test_scaled_gemm_with_fast_accumulation_stays_close(t, n, k, monkeypatch):
    """fp8_ops.FAST_ACCUM (torch._scaled_mm's use_fast_accum): the product of the same FP8
    operands close to the float32-accumulated one (it prints the error: the default is to
    be chosen from it and from the speed)."""
    from bucketserve.kernels import fp8_ops

    gen = torch.Generator(device="cuda").manual_seed(k + n)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    wq, ws = quantize_fp8_per_channel(w)
    xq = quantize_rows(x)
    exact = fp8_linear(xq, wq, ws, None, torch.bfloat16).float()
    monkeypatch.setattr(fp8_ops, "FAST_ACCUM", True)
    fast = fp8_linear(xq, wq, ws, None, torch.bfloat16).float()
    # (the narrower accumulator's error grows with K: a correct product stays far below this
    # bound, a wrong one (another scale, another layout) is of order 1)
    print(f"fast accumulation, {t}x{n}x{k}: relative error {(fast - exact).norm() / exact.norm():.2e}")
    assert (fast - exact).norm() / exact.norm() < 2e-2


@pytest.mark.parametrize("t, n, k", [(100, 4096, 4096), (256, 28672, 4096), (200, 4096, 14336)])
def test_deferred_product_and_its_readers_match_the_row_wise_path(t, n, k):
    """fp8_linear_deferred (the per-tensor GEMM with unit scales, the scales left to the
    reader) against fp8_linear (row-wise scales in the GEMM): the scaled value within two
    bf16 roundings; the compiled readers (rms_norm_quant, silu_and_mul_quant) given the
    scales bit for bit what they give for the product scaled beforehand."""
    from bucketserve.kernels.fp8_ops import Deferred, apply_scales, fp8_linear_deferred

    gen = torch.Generator(device="cuda").manual_seed(t + n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    wq, ws = quantize_fp8_per_channel(w)
    xq = quantize_rows(x)
    unit = torch.ones((), device="cuda")
    d = fp8_linear_deferred(xq, wq, ws, unit, torch.bfloat16)
    assert isinstance(d, Deferred) and d.raw.shape == (t, n) and d.raw.dtype == torch.bfloat16
    want = fp8_linear(xq, wq, ws, None, torch.bfloat16).float()
    got = apply_scales(d).float()
    assert ((got - want).abs() <= want.abs() * 2 ** -7 + 1e-6 * want.abs().max()).all()
    if n == 28672:  # gate_up: [gate | up] into SiLU-and-mul
        a = silu_and_mul_quant(d)
        b = silu_and_mul_quant(apply_scales(d))
    else:
        wn = torch.rand(n, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
        res = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        (a, ar), (b, br) = rms_norm_quant(d, wn, 1e-5, res), rms_norm_quant(apply_scales(d), wn,
                                                                          1e-5, res)
        assert torch.equal(ar, br)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))


@pytest.mark.parametrize("t, n", [(1, 14336), (256, 14336), (77, 8192), (5, 1000)])
def test_two_pass_silu_and_mul_quantization_matches_the_one_pass_kernel(t, n):
    """The chunked two-pass kernel (triton_fp8.silu_and_mul_quant(chunked=...)) compiled:
    the one-pass kernel's codes and scales bit for bit, dynamic and static, with deferred
    scales and without."""
    from bucketserve.kernels import triton_fp8

    gen = torch.Generator(device="cuda").manual_seed(t + n)
    x = torch.randn(t, 2 * n, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    sc = (torch.rand(t, 1, device="cuda", generator=gen) + 0.5,
          torch.rand(2 * n, device="cuda", generator=gen) + 0.5)
    for static in (None, torch.tensor(0.02, device="cuda")):
        for scales in (None, sc):
            one = triton_fp8.silu_and_mul_quant(x, static, scales)
            for chunked in ((1024, 4), (2048, 8)):
                two = triton_fp8.silu_and_mul_quant(x, static, scales, chunked=chunked)
                assert torch.equal(one[1], two[1])
                assert torch.equal(one[0].view(torch.uint8), two[0].view(torch.uint8))


@pytest.fixture(scope="module")
def tiny():
    from test_engine_gpu import word_tokenizer

    from bucketserve.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=1, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]
    return cfg, word_tokenizer(VOCAB), prompts


def run(tiny, tmp_path, quantization: str, kv: str, mixed: str = "full",
        cuda_graphs: bool = True, toml: str = ""):
    from bucketserve.models.loader import LoadedModel, build_dummy_model

    cfg, tok, prompts = tiny
    # embeddings and LM head larger than the default init so that logits are well separated;
    # the projections keep it (larger ones make a random model chaotic: any rounding change
    # flips its tokens; measured on the CPU with the torch FP8 path: 94% of teacher-forced
    # argmaxes agree with these weights, 53% with projections 6x larger)
    model = build_dummy_model(cfg, "cuda", torch.bfloat16, seed=1, quantization="none")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("model.embed_tokens", "lm_head")):
                p.mul_(6.0)
    if quantization == "fp8":
        from bucketserve.models.llama import LlamaForCausalLM, quantize_state_dict_fp8

        state = quantize_state_dict_fp8(model.state_dict())
        model = LlamaForCausalLM(cfg, model.attn_backend, device="meta", dtype=torch.bfloat16,
                                 quantization="fp8")
        model.load_state_dict(state, strict=True, assign=True)
        model.init_rope_cache()
        model.requires_grad_(False).eval()
    loaded = LoadedModel(model, tok, cfg, "tiny-fp8", 2048)
    path = tmp_path / "b.toml"
    path.write_text(f'[model]\nquantization = "{quantization}"\n[kv_cache]\ndtype = "{kv}"\n'
                    "[scheduler]\nmax_batched_tokens = 256\nmax_running = 16\n"
                    f'[prefill]\nmixed_graphs = "{mixed}"\n' + toml)
    engine = LLMEngine(loaded, load_buckets(str(path), max_model_len=2048), "cuda",
                       num_blocks=512, cuda_graphs=cuda_graphs)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], engine


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def references(tiny, tmp_path_factory):
    """Greedy tokens of the bf16 engine and of the FP8 (weights + KV) engine without graphs."""
    tmp = tmp_path_factory.mktemp("ref")
    return {"bf16": run(tiny, tmp, "none", "auto")[0],
            "fp8 eager": run(tiny, tmp, "fp8", "fp8", cuda_graphs=False)[0]}


@pytest.mark.parametrize("quantization, kv, mixed, graphs", [
    ("fp8", "auto", "full", True), ("none", "fp8", "full", True), ("fp8", "fp8", "full", True),
    ("fp8", "fp8", "piecewise", True), ("fp8", "fp8", "full", False)])
def test_fp8_engine_stays_close_to_bf16(tiny, references, tmp_path, quantization, kv, mixed,
                                        graphs):
    got, engine = run(tiny, tmp_path, quantization, kv, mixed, graphs)
    assert engine.quant.weights == quantization and engine.quant.kv_cache == kv
    assert engine.runner.kv_cache.dtype == (FP8_DTYPE if kv == "fp8" else torch.bfloat16)
    assert all(len(g) == m for g, m in zip(got, MAX_TOKENS, strict=True))
    # FP8 moves a random model's logits by a few percent: most sequences start like bf16's
    prefixes = [_agreeing_prefix(g, r) for g, r in zip(got, references["bf16"], strict=True)]
    assert sum(p >= 1 for p in prefixes) >= 12, prefixes
    assert sum(prefixes) / len(prefixes) >= 3, prefixes
    if quantization == kv == "fp8":
        # the compiled shapes compute what the eager FP8 forward does: each first token comes
        # from a prefill (whole-step graph, piecewise graphs or eager: the same attention per
        # row; only the GEMMs' kernel choice for the step's row count can move a rounding)
        eager = references["fp8 eager"]
        assert sum(g[0] == e[0] for g, e in zip(got, eager, strict=True)) >= 15
    r = engine.runner
    if graphs:
        assert r.num_graph_steps > 0 and r.num_piecewise_steps > 0
        assert engine.cuda_info["mixed_graphs"] == mixed
        assert "piecewise_eager_from" in engine.cuda_info  # the cost model measured FP8 steps
    else:
        assert r.num_graph_steps == 0 and r.num_piecewise_steps == 0


def test_fp8_engine_with_deferred_products_in_every_band(tiny, references, tmp_path,
                                                       monkeypatch):
    """The engine with o_proj's, gate_up's and down's products deferred to their readers in
    every row band above 64 (as use_gemv sets where the per-tensor GEMM measures faster),
    through the decode graphs, whole-step mixed graphs of up to 256 tokens: its first tokens
    are the eager row-wise engine's but for roundings."""
    from bucketserve.kernels import triton_fp8_gemm

    def every_band(ws, ss, max_rows=triton_fp8_gemm.BANDS[-1], min_gain=0.03):
        return {b: ({"forced": True}, True) for b in triton_fp8_gemm.BANDS}

    monkeypatch.setattr(triton_fp8_gemm, "choose_deferred", every_band)
    monkeypatch.setenv("BUCKETSERVE_FP8_DEFER", "1")
    got, engine = run(tiny, tmp_path, "fp8", "fp8")
    layer = engine.runner.model.model.layers[0]
    assert layer.mlp.down_proj.deferred == frozenset(triton_fp8_gemm.BANDS)
    assert layer.self_attn.qkv_proj.deferred == frozenset()
    assert any(k.endswith("(fp8, 65+ rows, scales)") for k in engine.cuda_info["gemv"])
    eager = references["fp8 eager"]
    assert sum(g[0] == e[0] for g, e in zip(got, eager, strict=True)) >= 15
    prefixes = [_agreeing_prefix(g, r) for g, r in zip(got, references["bf16"], strict=True)]
    assert sum(p >= 1 for p in prefixes) >= 12, prefixes


def test_fp8_engine_with_pdl_gives_the_tokens_it_gives_without(tiny, tmp_path, monkeypatch):
    """The FP8 engine (weights and KV) with its decode kernels launched with programmatic
    dependent launch (kernels/pdl.py: quantizers, one-row and few-row products, rotary, K/V
    write, decode attention) at every row count (BUCKETSERVE_PDL=all), through the decode
    graphs and mixed graphs: the same greedy tokens as with it off. `[decode] gemv = "on"` takes the kernels without timing them, so
    both engines run the same kernels and only PDL differs."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from bucketserve.kernels import pdl

    toml = '[decode]\ngemv = "on"\n'
    monkeypatch.setattr(pdl, "MAX_ROWS", 0)
    want, _ = run(tiny, tmp_path, "fp8", "fp8", toml=toml)
    monkeypatch.setattr(pdl, "MAX_ROWS", pdl.ALL_ROWS)
    got, engine = run(tiny, tmp_path, "fp8", "fp8", toml=toml)
    assert engine.runner.num_graph_steps > 0
    layer = engine.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.gemv is not None and layer.mlp.down_proj.rows is not None
    assert got == want


@pytest.mark.parametrize("f16_dot", [False, True])
@pytest.mark.parametrize("batch,ctx,splits", [(64, 512, 1), (3, 2000, 4)])
def test_decode_over_an_fp8_pool_matches_reference(f16_dot, batch, ctx, splits):
    """Llama-3-8B heads, bf16 queries, an FP8 pool with scales, pages scattered: the decode
    kernel with its dots in bf16 or fp16 against fp32 attention over the pool's values."""
    from bucketserve.kernels import triton_attention as ta
    from bucketserve.kernels.attention import AttentionMetadata, reference_attention

    torch.manual_seed(batch)
    hq, hkv, d, page, ks, vs = 32, 8, 128, 16, 0.03, 0.01
    per = -(-ctx // page)
    nb = batch * per + 1
    kc = torch.randn(nb, page, hkv, d, device="cuda").mul(60).clamp(-448, 448).to(FP8_DTYPE)
    vc = torch.randn(nb, page, hkv, d, device="cuda").mul(60).clamp(-448, 448).to(FP8_DTYPE)
    tables = (torch.randperm(nb - 1, device="cuda")[: batch * per] + 1).view(batch, per).int()
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    ta.paged_decode(q, kc, vc, tables, lens, batch, d ** -0.5, out, num_splits=splits,
                    kv_scales=(ks, vs), f16_dot=f16_dot)
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long, device="cuda"),
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32,
                                                          device="cuda"),
                             seq_lens=lens, block_tables=tables, num_decodes=batch,
                             max_query_len=1, max_seq_len=ctx, query_lens_cpu=[1] * batch,
                             seq_lens_cpu=lens.tolist())
    ref = reference_attention(q.float(), kc.float() * ks, vc.float() * vs, meta, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * vs * 60)
