"""FP8 (issue 28) on the CPU: the config keys and CLI flags, the refusal without FP8 tensor
cores, quantize-on-load's state dict (the format pre-quantized checkpoints load into, with
block-wise / static / KV scales accepted), and the quantized model's arithmetic through the
torch reference path (kernels/fp8_ops), close to the unquantized model. The kernels and the
engine run on a GPU: tests/test_fp8_gpu.py."""

from __future__ import annotations

import pytest
import torch

from bucketserve.buckets import ConfigError, load_buckets
from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8
from bucketserve.kernels.fp8_ops import fp8_linear, quantize_rows_torch
from bucketserve.kernels.quant import QuantizationUnsupported, QuantPlan, resolve_quant_plan
from bucketserve.models.config import ModelConfig
from bucketserve.models.llama import (
    FP8_PROJECTIONS,
    Fp8Linear,
    LlamaForCausalLM,
    quantize_state_dict_fp8,
)
from bucketserve.models.loader import build_dummy_model

SMALL = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                    tie_word_embeddings=False)


def write(tmp_path, text: str):
    path = tmp_path / "b.toml"
    path.write_text(text)
    return path


def test_config_keys_validate_with_one_line_errors(tmp_path):
    b = load_buckets(write(tmp_path, '[model]\nquantization = "fp8"\n[kv_cache]\ndtype = "fp8"\n'))
    assert (b.quantization, b.kv_cache_dtype) == ("fp8", "fp8")
    assert load_buckets().quantization == "none" and load_buckets().kv_cache_dtype == "auto"
    for text, key in (('[model]\nquantization = "int4"\n', "model.quantization"),
                      ('[kv_cache]\ndtype = "fp16"\n', "kv_cache.dtype"),
                      ("[model]\nquantization = 8\n", "model.quantization")):
        with pytest.raises(ConfigError) as info:
            load_buckets(write(tmp_path, text))
        assert info.value.key == key and "\n" not in str(info.value)
        assert "expected one of" in str(info.value)


def test_fp8_is_refused_on_the_cpu_with_one_line_saying_why():
    for q, kv in (("fp8", "auto"), ("none", "fp8"), ("fp8", "fp8")):
        with pytest.raises(QuantizationUnsupported) as info:
            resolve_quant_plan("cpu", q, kv)
        msg = str(info.value)
        assert "\n" not in msg and "compute capability >= 8.9" in msg and "cpu" in msg
        assert ("--quantization fp8" in msg) == (q == "fp8")
        assert ("--kv-cache-dtype fp8" in msg) == (kv == "fp8")
    plan = resolve_quant_plan("cpu")
    assert plan == QuantPlan(weights="none", kv_cache="auto", gemm="dense", device="cpu")
    assert plan.kv_dtype(torch.float32) == torch.float32
    assert "weights none" in plan.describe()
    with pytest.raises(ValueError, match="quantization 'int4'"):
        resolve_quant_plan("cpu", "int4")


@pytest.mark.parametrize("flags", [["--quantization", "fp8"], ["--kv-cache-dtype", "fp8"]])
def test_serve_refuses_fp8_on_the_cpu_before_starting(flags, capsys):
    pytest.importorskip("fastapi")  # the server's own dependency (absent on the GPU image)
    from bucketserve.server.cli import main

    assert main(["serve", "--device", "cpu", "--embedding-model", "none", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bucketserve: error: ") and "\n" not in err
    assert "refused" in err and "compute capability" in err


def test_engine_refuses_fp8_on_the_cpu():
    from bucketserve.engine.core import build_engine
    from bucketserve.engine.options import EngineOptions

    with pytest.raises(QuantizationUnsupported, match="--quantization fp8 refused"):
        build_engine(EngineOptions("smollm2-135m-instruct", quantization="fp8"))


def test_quantize_on_load_gives_the_checkpoint_format():
    model = build_dummy_model(SMALL, dtype=torch.bfloat16)
    state = model.state_dict()
    q = quantize_state_dict_fp8(state)
    projections = [k for k in state if k.removesuffix(".weight").endswith(FP8_PROJECTIONS)]
    assert len(projections) == 4 * SMALL.num_layers
    for key, value in state.items():
        if key in projections:
            p = key.removesuffix(".weight")
            assert q[key].dtype == FP8_DTYPE and q[key].shape == value.shape
            assert q[p + ".weight_scale"].dtype == torch.float32
            assert q[p + ".weight_scale"].shape == (value.shape[0],)
            back = dequantize_fp8(q[key], q[p + ".weight_scale"])
            assert ((back - value.float()).abs() <= value.float().abs().amax(1, keepdim=True)
                    * 2 ** -4 + 1e-6).all()
        else:  # embeddings, norms and the LM head stay as they are
            assert q[key] is value
    assert set(q) == set(state) | {k.removesuffix("weight") + "weight_scale" for k in projections}
    # already-quantized weights pass through unchanged
    assert quantize_state_dict_fp8(q).keys() == q.keys()
    fp8 = build_dummy_model(SMALL, dtype=torch.bfloat16, quantization="fp8")
    assert fp8.quantization == "fp8"
    assert fp8.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    assert fp8.lm_head.weight.dtype == torch.bfloat16
    assert fp8.model.embed_tokens.weight.dtype == torch.bfloat16
    for key, value in fp8.state_dict().items():  # the same weights as quantizing the bf16 ones
        assert torch.equal(value.float(), q[key].float()), key


def test_checkpoint_scales_are_accepted():
    """Block-wise weight scales are turned into per-channel ones, static input scales and KV
    scales are kept (the contract with the pre-quantized checkpoint loader)."""
    state = quantize_state_dict_fp8(build_dummy_model(SMALL, dtype=torch.bfloat16).state_dict())
    p = "model.layers.1.mlp.down_proj"
    w = dequantize_fp8(state[p + ".weight"], state[p + ".weight_scale"])
    # the same weight as a block-wise checkpoint ships it: 32 x 32 blocks, one scale each
    blocks = w.view(2, 32, 4, 32).abs().amax(dim=(1, 3)) / FP8_MAX
    full = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
    state[p + ".weight"] = (w / full).to(FP8_DTYPE)
    state[p + ".weight_scale"] = blocks
    state[p + ".input_scale"] = torch.tensor(0.0625)
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    model = LlamaForCausalLM(SMALL, device="meta", dtype=torch.bfloat16, quantization="fp8")
    down = model.model.layers[1].mlp.down_proj
    down.block = (32, 32)
    model.load_state_dict(state, strict=True, assign=True)
    assert isinstance(down, Fp8Linear) and down.weight_scale.shape == (64,)
    want = dequantize_fp8(state[p + ".weight"], blocks, (32, 32))
    got = dequantize_fp8(down.weight, down.weight_scale)
    assert ((got - want).abs() <= want.abs().amax(1, keepdim=True) * 2 ** -4 + 1e-6).all()
    assert float(down.input_scale) == 0.0625
    assert model.model.layers[1].mlp.gate_up_proj.input_scale is None
    a0 = model.model.layers[0].self_attn
    assert (float(a0.k_scale), float(a0.v_scale)) == (0.5, 0.25)
    assert model.model.layers[1].self_attn.k_scale is None
    # a pool in the model dtype is not scaled; an FP8 one takes the scales (1.0 where absent)
    model.init_rope_cache()
    c = SMALL
    model.bind_kv_cache(torch.zeros(c.num_layers, 2, 4, 4, c.num_kv_heads, c.head_dim))
    assert a0.kv_scales is None
    model.bind_kv_cache(torch.zeros(c.num_layers, 2, 4, 4, c.num_kv_heads, c.head_dim,
                                    dtype=FP8_DTYPE))
    assert a0.kv_scales == (0.5, 0.25)
    assert model.model.layers[1].self_attn.kv_scales == (1.0, 1.0)


def test_activation_quantization_and_product_reference():
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * torch.tensor([0.01, 1, 10, 100, 0]
                                                                ).bfloat16()[:, None]
    q, s = quantize_rows_torch(x)
    assert q.dtype == FP8_DTYPE and s.shape == (5, 1) and s.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(1)[:4], torch.full((4,), FP8_MAX))
    assert (q[4].float() == 0).all() and torch.isfinite(s).all()
    back = q.float() * s
    assert ((back - x.float()).abs() <= x.float().abs().amax(1, keepdim=True) * 2 ** -4).all()
    qs, ss = quantize_rows_torch(x, torch.tensor(0.125))  # static: one scale for every row
    assert torch.equal(ss, torch.full((5, 1), 0.125))
    assert qs.float().abs().max() == FP8_MAX  # the row of 100s saturates
    w = torch.randn(48, 64)
    wq, ws = quantize_state_dict_fp8({"l.mlp.down_proj.weight": w}).values()
    out = fp8_linear((q, s), wq, ws, None, torch.float32)
    ref = back @ dequantize_fp8(wq, ws).t()
    torch.testing.assert_close(out, ref)


def test_quantized_model_stays_close_to_the_unquantized_one():
    """The same random weights, bf16 vs FP8 weights and activations (torch reference path on
    the CPU): logits agree to FP8 rounding and the greedy tokens mostly agree."""
    from test_models import Pool

    ref = build_dummy_model(SMALL, dtype=torch.float32, seed=3)
    fp8 = build_dummy_model(SMALL, dtype=torch.float32, seed=3, quantization="fp8")
    tokens = [(7 * i) % 300 for i in range(40)]
    a = Pool(ref).step([(0, tokens, 0)])[0]
    b = Pool(fp8).step([(0, tokens, 0)])[0]
    rel = (a - b).norm() / a.norm()
    assert 0 < rel < 0.1, rel
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def _all_bands_deferred(model: LlamaForCausalLM) -> None:
    """What use_gemv sets where the deferred product measured faster, for every row band."""
    from bucketserve.kernels.triton_fp8_gemm import BANDS

    unit = torch.ones(())
    for layer in model.model.layers:
        for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            m.deferred, m.unit = frozenset(BANDS), unit


def test_a_deferred_product_is_the_scaled_product():
    """Fp8Linear.forward(x, defer=True) in a row band use_gemv chose: the product without
    its scales (fp8_ops.Deferred) whose value, and whose fused readers' results, are those of
    the row-wise product; other bands, 64 rows or fewer, and defer=False give the tensor."""
    from bucketserve.kernels import fp8_ops
    from bucketserve.kernels.fp8 import quantize_fp8_per_channel

    gen = torch.Generator().manual_seed(5)
    lin = Fp8Linear(96, 80, bias=False, dtype=torch.float32)
    lin.weight.data, lin.weight_scale.data = quantize_fp8_per_channel(
        torch.randn(80, 96, generator=gen) * torch.rand(80, 1, generator=gen))
    x = torch.randn(200, 96, generator=gen) * torch.rand(200, 1, generator=gen) * 10
    want = lin(x)
    lin.deferred, lin.unit = frozenset({128}), torch.ones(())
    d = lin(x[:100], defer=True)
    assert isinstance(d, fp8_ops.Deferred) and d.raw.shape == (100, 80)
    torch.testing.assert_close(fp8_ops.apply_scales(d), want[:100], rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())
    # the raw sums are unscaled: dropping either scale would change them
    assert not torch.allclose(d.raw, want[:100], rtol=0.1)
    for got in (lin(x[:100]), lin(x, defer=True), lin(x[:64], defer=True)):
        assert isinstance(got, torch.Tensor)
    w = torch.rand(80) + 0.5
    res = torch.randn(100, 80, generator=gen)
    value = fp8_ops.apply_scales(d)
    for r in (None, res):
        (q, s), out_res = fp8_ops.rms_norm_quant(d, w, 1e-5, r)
        (q_ref, s_ref), ref_res = fp8_ops.rms_norm_quant(value, w, 1e-5, r)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert (r is None and out_res is None) or torch.equal(out_res, ref_res)
    gu = Fp8Linear(96, 160, bias=False, dtype=torch.float32)
    gu.weight.data, gu.weight_scale.data = quantize_fp8_per_channel(
        torch.randn(160, 96, generator=gen))
    gu.deferred, gu.unit = frozenset({128}), torch.ones(())
    dg = gu(x[:100], defer=True)
    q, s = fp8_ops.silu_and_mul_quant(dg)
    q_ref, s_ref = fp8_ops.silu_and_mul_quant(fp8_ops.apply_scales(dg))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_the_fused_forward_with_deferred_products_matches_the_row_wise_one():
    """_post_attention (the fused forward's o_proj, norm, MLP) with every FP8 row band
    deferred gives what the row-wise products give: o_proj's and gate_up's products deferred
    into the fused norm and SiLU-and-mul, down's into the next layer's norm (the last
    layer's stays a tensor for the final norm)."""
    from unittest import mock

    from bucketserve.kernels import fp8_ops

    model = build_dummy_model(SMALL, dtype=torch.float32, seed=4, quantization="fp8")
    gen = torch.Generator().manual_seed(6)
    t = 150
    o = torch.randn(t, SMALL.num_heads, SMALL.head_dim, generator=gen)
    res = torch.randn(t, SMALL.hidden_size, generator=gen)
    want = [model._post_attention(i, o, res.clone(), last=i == 1) for i in (0, 1)]
    _all_bands_deferred(model)
    with mock.patch.object(fp8_ops, "fp8_linear_deferred",
                           wraps=fp8_ops.fp8_linear_deferred) as spy:
        got = [model._post_attention(i, o, res.clone(), last=i == 1) for i in (0, 1)]
    assert spy.call_count == 3 + 2
    assert isinstance(got[0][0], fp8_ops.Deferred) and isinstance(got[1][0], torch.Tensor)
    for (gd, gr), (wd, wr) in zip(got, want, strict=True):
        torch.testing.assert_close(gr, wr, rtol=1e-5, atol=1e-5 * wr.abs().max().item())
        w = wd.float()
        torch.testing.assert_close(fp8_ops.apply_scales(gd), w, rtol=1e-4,
                                   atol=1e-4 * w.abs().max().item())
