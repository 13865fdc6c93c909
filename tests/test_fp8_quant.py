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
