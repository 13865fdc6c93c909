"""The one-row Triton GEMV (kernels/triton_gemv.py) and its use by the Llama model: products
agree with an fp32 reference to bf16 / fp16 rounding for every candidate config and awkward
shapes, repeat bit for bit, the start-up choice follows its own measurement, and a decode
step with it (eager and in a batch-1 CUDA graph) gives the logits and tokens of the cuBLAS
path. CUDA only."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(6144, 4096), (1000, 1000), (5, 64), (4096, 14336), (77, 300)])
def test_gemv_matches_fp32_reference_for_every_candidate(dtype, n, k):
    pytest.importorskip("triton")
    from bucketserve.kernels import triton_gemv

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    ref = (x.float() @ w.float().t())
    scale = ref.abs().max().item()
    for cfg in {*triton_gemv.CANDIDATES, triton_gemv.DEFAULT_CONFIG}:
        y = triton_gemv.gemv(x, w, config=cfg)
        assert y.shape == (1, n) and y.dtype == dtype
        err = (y.float() - ref).abs().max().item()
        assert err <= 1e-2 * scale, (cfg, err, scale)
        # (split-K configs add their partials in split order: the same bits too)
        assert torch.equal(triton_gemv.gemv(x, w, config=cfg), y), cfg
    # a strided weight view (rows of a fused projection) and a flat input
    sub = w[: n // 2 + 1]
    y = triton_gemv.gemv(x.view(-1), sub)
    torch.testing.assert_close(y.float(), ref[:, : n // 2 + 1], rtol=2e-2, atol=1e-2 * scale)


def test_choose_keeps_cublas_unless_the_gemv_measures_faster():
    pytest.importorskip("triton")
    from bucketserve.kernels import triton_gemv

    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    cfg, info = triton_gemv.choose(ws)
    assert info["cublas_us"] > 0 and info["gemv_us"] > 0 and tuple(info["config"]) in \
        triton_gemv.CANDIDATES
    if cfg is None:
        assert info["gemv_us"] > info["cublas_us"] * 0.98
    else:
        assert tuple(info["config"]) == cfg and info["gemv_us"] <= info["cublas_us"] * 0.98
    # no gain is enough when at least a 100% gain is asked for
    assert triton_gemv.choose(ws, min_gain=1.0)[0] is None


def _model(dtype, tied: bool):
    from bucketserve.kernels.triton_attention import TritonAttentionBackend
    from bucketserve.models.config import ModelConfig
    from bucketserve.models.loader import build_dummy_model

    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=tied)
    model = build_dummy_model(cfg, "cuda", dtype, attn_backend=TritonAttentionBackend(),
                              seed=0)
    return cfg, model


@pytest.mark.parametrize("tied", [True, False])
def test_use_gemv_modes_set_every_projection_and_the_lm_head(tied):
    pytest.importorskip("triton")
    from bucketserve.models.llama import Linear

    _, model = _model(torch.bfloat16, tied)
    projections = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    info = model.use_gemv("on")
    assert all(m.gemv is not None for m in projections) and model._lm_head_gemv is not None
    assert {r["choice"] for r in info.values()} == {"gemv"}
    # qkv, o, gate_up, down and the head: one entry per distinct weight shape
    assert len(info) == len({tuple(m.weight.shape) for m in projections}) + 1
    info = model.use_gemv("auto")
    for m in projections:
        row = info[f"{m.weight.shape[0]}x{m.weight.shape[1]}"]
        assert (m.gemv is not None) == (row["choice"] == "gemv")
    assert model.use_gemv("off") == {}
    assert all(m.gemv is None for m in projections) and model._lm_head_gemv is None
    with pytest.raises(ValueError, match="gemv mode"):
        model.use_gemv("fast")
    _, fp32 = _model(torch.float32, tied)
    assert fp32.use_gemv("on") == {}  # fp32 keeps cuBLAS: the GEMV is for 16-bit weights


def test_a_failed_measurement_keeps_cublas(monkeypatch):
    pytest.importorskip("triton")
    from bucketserve.kernels import triton_gemv
    from bucketserve.models.llama import Linear

    def broken(weights, *a, **kw):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(triton_gemv, "choose", broken)
    _, model = _model(torch.bfloat16, tied=True)
    info = model.use_gemv("auto")
    assert info and all(r["choice"] == "cublas" and "no kernel" in r["error"]
                        for r in info.values())
    assert all(m.gemv is None for m in model.modules() if isinstance(m, Linear))
    assert model._lm_head_gemv is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_with_gemv_matches_cublas_eager_and_in_a_graph(dtype):
    pytest.importorskip("triton")
    from test_cuda_graphs_gpu import NUM_BLOCKS, PAGE, decode_meta

    from bucketserve.kernels.attention import forward_context
    from bucketserve.kernels.cuda_graphs import DecodeGraphs

    cfg, model = _model(dtype, tied=True)
    kv = torch.randn(cfg.num_layers, 2, NUM_BLOCKS, PAGE, cfg.num_kv_heads, cfg.head_dim,
                     device="cuda", dtype=dtype)
    model.bind_kv_cache(kv)
    gen = torch.Generator().manual_seed(3)
    meta = decode_meta([300], gen)
    ids = torch.randint(0, cfg.vocab_size, (1,), generator=gen).cuda()
    pos = torch.tensor([299], device="cuda")
    kv0 = kv.clone()
    model.use_gemv("off")
    with torch.inference_mode(), forward_context(meta):
        want = model.compute_logits(model(ids, pos))
    model.use_gemv("on")
    kv.copy_(kv0)
    with torch.inference_mode(), forward_context(meta):
        got = model.compute_logits(model(ids, pos))
    tol = 3e-2 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=tol)
    top2 = want[0].topk(2).values
    if top2[0] - top2[1] > 2 * tol:  # a clear winner: the same token
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:  # a near-tie either path may break: the token taken is one of the tied ones
        assert want[0, got.argmax(-1)] >= top2[0] - 2 * tol
    kv.copy_(kv0)
    graphs = DecodeGraphs(model, [1, 2], max_blocks_per_seq=32, max_seq_len=512, device="cuda")
    graphs.capture()  # the batch-1 graph records the GEMV launches
    with torch.inference_mode():
        replay = model.compute_logits(graphs.run(ids, pos, meta).clone())
    # the graph's attention runs unsplit, the eager one may split the context: rounding only
    torch.testing.assert_close(replay, got, rtol=2e-2, atol=tol)


def _fp8_gpu() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("m", [2, 7, 16, 17, 33, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (77, 300), (4096, 14336)])
def test_fp8_rows_match_the_w8a8_product_for_every_candidate(m, n, k):
    """rows_fp8 (2..64 rows, FP8 or fp16 dots) against kernels/fp8_ops.fp8_linear
    (torch._scaled_mm) on the same quantized operands, every candidate config; repeatable."""
    pytest.importorskip("triton")
    if not _fp8_gpu():
        pytest.skip("needs FP8 tensor cores")
    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    q, s = quantize_rows(torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16))
    # the W8A8 product in float32 (torch._scaled_mm itself needs K divisible by 16)
    ref = (q.float() * s) @ (w.float() * ws[:, None]).t()
    if k % 16 == 0:
        torch.testing.assert_close(fp8_linear((q, s), w, ws, None, torch.float32), ref,
                                   rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    scale = ref.abs().max().item()
    for cfg in triton_gemv.ROW_CANDIDATES:
        y = triton_gemv.rows_fp8(q, s, w, ws, torch.float32, config=cfg)
        assert y.shape == (m, n)
        err = (y - ref).abs().max().item()
        # 1e-3 of the largest output: Hopper's FP8 MMA adds within a tile with fewer bits than
        # fp32 (measured up to 1.6e-4); the projections' bf16 outputs round at 4e-3
        assert err <= 1e-3 * scale + 1e-6, (cfg, err, scale)
        assert torch.equal(triton_gemv.rows_fp8(q, s, w, ws, torch.float32, config=cfg), y), cfg


def _fp8_model():
    """The small test model with FP8 projections on the GPU, and its Fp8Linear modules."""
    from bucketserve.kernels.triton_attention import TritonAttentionBackend
    from bucketserve.models.llama import Fp8Linear
    from bucketserve.models.loader import build_dummy_model

    cfg, _ = _model(torch.bfloat16, tied=True)
    model = build_dummy_model(cfg, "cuda", torch.bfloat16, attn_backend=TritonAttentionBackend(),
                              seed=0, quantization="fp8")
    return model, [m for m in model.modules() if isinstance(m, Fp8Linear)]


def test_fp8_projections_take_the_rows_kernel_where_chosen():
    """use_gemv on an FP8 model: "on" gives every FP8 projection a config per row band and a
    decode step of 5 rows then equals the _scaled_mm path ("off") to bf16 rounding; "auto"
    records a choice per band."""
    pytest.importorskip("triton")
    if not _fp8_gpu():
        pytest.skip("needs FP8 tensor cores")
    model, fp8 = _fp8_model()
    assert fp8
    x = torch.randn(5, fp8[0].weight.shape[1], device="cuda", dtype=torch.bfloat16)
    model.use_gemv("off")
    want = fp8[0](x)
    model.use_gemv("on")
    assert all(m.rows is not None for m in fp8)
    torch.testing.assert_close(fp8[0](x).float(), want.float(), rtol=2e-2, atol=2e-2)
    info = model.use_gemv("auto")
    rows = [v for k, v in info.items() if k.endswith("(fp8, 2..64 rows)")]
    assert rows and all("choice" in r for r in rows)


@pytest.mark.parametrize("m", [65, 256, 300, 1024])
@pytest.mark.parametrize("n, k", [(6144, 4096), (77, 300), (4096, 14336)])
def test_fp8_tiles_match_the_w8a8_product_for_every_config(m, n, k):
    """triton_fp8_gemm.fp8_mm (65+ rows) against the float32 W8A8 product of the same
    quantized operands, every config, K-tile sums promoted to float32; repeatable. With the
    MMA's own accumulation (promote False) the error is larger (bounded loosely)."""
    pytest.importorskip("triton")
    if not _fp8_gpu():
        pytest.skip("needs FP8 tensor cores")
    from bucketserve.kernels import triton_fp8_gemm
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    q, s = quantize_rows(torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16))
    ref = (q.float() * s) @ (w.float() * ws[:, None]).t()
    scale = ref.abs().max().item()
    for cfg in triton_fp8_gemm.CONFIGS:
        y = triton_fp8_gemm.fp8_mm(q, s, w, ws, cfg, promote=True, out_dtype=torch.float32)
        assert y.shape == (m, n)
        err = (y - ref).abs().max().item()
        # 1e-3 of the largest output, as rows_fp8: within a K tile Hopper's FP8 MMA adds with
        # fewer bits than fp32 (measured 2.4e-4 at BK 256 on an H200); bf16 outputs round at 4e-3
        assert err <= 1e-3 * scale + 1e-6, (cfg, err, scale)
        assert torch.equal(triton_fp8_gemm.fp8_mm(q, s, w, ws, cfg, out_dtype=torch.float32),
                           y), cfg
        fast = triton_fp8_gemm.fp8_mm(q, s, w, ws, cfg, promote=False, out_dtype=torch.float32)
        # the MMA's own accumulation over all of K: measured up to 8.1e-3 at K 14,336 on an
        # H200 (the reason it is not the default)
        assert (fast - ref).abs().max().item() <= 1.5e-2 * scale + 1e-6, cfg


def test_fp8_projections_take_the_tiles_where_chosen(monkeypatch):
    """With BUCKETSERVE_FP8_TILES=1, use_gemv("auto", max_rows) on an FP8 model measures fp8_mm against _scaled_mm per row
    band up to the band of max_rows (600 rows: 1,024) and records each; a projection given tiles computes a
    300-row step as the _scaled_mm path does, to bf16 rounding."""
    pytest.importorskip("triton")
    if not _fp8_gpu():
        pytest.skip("needs FP8 tensor cores")
    from bucketserve.kernels import triton_fp8_gemm
    model, fp8 = _fp8_model()
    x = torch.randn(300, fp8[0].weight.shape[1], device="cuda", dtype=torch.bfloat16)
    model.use_gemv("off")
    assert all(m.tiles is None for m in fp8)
    want = fp8[0](x)
    assert not any(k.endswith("(fp8, 65+ rows)") for k in model.use_gemv("auto", max_rows=600))
    monkeypatch.setenv("BUCKETSERVE_FP8_TILES", "1")
    info = model.use_gemv("auto", max_rows=600)
    rows = [v for k, v in info.items() if k.endswith("(fp8, 65+ rows)")]
    assert len(rows) == len({tuple(m.weight.shape) for m in fp8})
    assert all(sorted(r["bands"]) == [128, 256, 512, 1024] for r in rows), rows
    fp8[0].tiles = {256: None, 512: triton_fp8_gemm.CONFIGS[4]}
    torch.testing.assert_close(fp8[0](x).float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 5, 64])
def test_split_k_products_replay_from_a_cuda_graph(m):
    """A split-K FP8 product (gemv_fp8 for one row, rows_fp8 for more) captured in a CUDA
    graph: every replay, with new inputs copied in, gives the W8A8 product of those inputs,
    and the counters are at rest after each (a counter left over would make the next replay
    skip its stores and leave the previous output)."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    from bucketserve.kernels import triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel
    from bucketserve.kernels.fp8_ops import quantize_rows

    n, k = 4096, 14336
    gen = torch.Generator(device="cuda").manual_seed(m)
    w, ws = quantize_fp8_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    q, s = quantize_rows(torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16))
    cfg = (8, 512, 4, 3, 4) if m == 1 else (32, 256, 4, 3, 1, 4)
    out = torch.empty(m, n, device="cuda", dtype=torch.float32)

    def run():
        if m == 1:
            triton_gemv.gemv_fp8(q, s, w, ws, torch.float32, out=out, config=cfg)
        else:
            triton_gemv.rows_fp8(q, s, w, ws, torch.float32, config=cfg, out=out)

    run()  # sizes the scratch outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    locks = triton_gemv._SCRATCH[out.device][-1][1]
    for i in range(5):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        q2, s2 = quantize_rows(x)
        q.copy_(q2)
        s.copy_(s2)
        g.replay()
        torch.cuda.synchronize()
        ref = (q.float() * s) @ (w.float() * ws[:, None]).t()
        err = (out - ref).abs().max().item()
        assert err <= 1e-3 * ref.abs().max().item() + 1e-6, (i, err)
        assert int(locks.count_nonzero()) == 0, i


@pytest.mark.parametrize("m", [1, 16, 64])
def test_pdl_chain_gives_the_same_bits_eager_and_in_a_cuda_graph(monkeypatch, m):
    """A decode layer's chain of FP8 kernels (rms_norm_quant with a residual, a product,
    silu_and_mul_quant, a product, quantize_rows, a split-K product) launched with
    programmatic dependent launch (kernels/pdl.py), eager and captured in a CUDA graph and
    replayed with new inputs: the same bits as the chain launched without it, every time.
    A product that read its input before the kernel before it had written it would differ."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from bucketserve.kernels import pdl, triton_fp8, triton_gemv
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel

    h, i = 4096, 7168
    gen = torch.Generator(device="cuda").manual_seed(m)

    def weight(n, k):
        return quantize_fp8_per_channel(torch.randn(n, k, device="cuda", generator=gen) * 0.02)

    w1, w2, w3 = weight(2 * i, h), weight(h, i), weight(h, h)
    norm = torch.rand(h, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    x = torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16)

    def prod(q, s, w, split=1):
        if m == 1:
            return triton_gemv.gemv_fp8(q, s, *w, config=(8, 512, 4, 3, split))
        return triton_gemv.rows_fp8(q, s, *w, config=(32, 256, 4, 3, 1, split))

    def chain():
        (q, s), r = triton_fp8.rms_norm_quant(x, norm, 1e-5, res)
        q, s = triton_fp8.silu_and_mul_quant(prod(q, s, w1))
        q, s = triton_fp8.quantize_rows(prod(q, s, w2) + r)
        return prod(q, s, w3, split=4)

    def fresh():
        x.copy_(torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16))
        res.copy_(torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16))

    monkeypatch.setattr(pdl, "MAX_ROWS", 0)
    want = chain()  # also sizes the split scratch before the capture
    monkeypatch.setattr(pdl, "MAX_ROWS", pdl.ALL_ROWS)
    assert pdl.use_pdl(x.device, m)
    assert torch.equal(chain(), want)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain()
    for step in range(5):
        fresh()
        g.replay()
        monkeypatch.setattr(pdl, "MAX_ROWS", 0)
        ref = chain()
        monkeypatch.setattr(pdl, "MAX_ROWS", pdl.ALL_ROWS)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), step
