"""Pre-quantized FP8 checkpoints (models/fp8_checkpoint.py): compressed-tensors directories
written by the real compressed-tensors package, plain `fp8` ones (block-wise and per tensor)
written by hand, all read through the loader into the one contract the model consumes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8_per_channel
from bucketserve.models import LlamaForCausalLM, UnsupportedModelError
from bucketserve.models.loader import fuse_hf_tensors, get_backend, read_hf_dir
from tests.test_models import Pool, hf_logits

FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


def tiny_hf(hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 128,
            layers: int = 2, dtype: torch.dtype = torch.bfloat16, std: float = 0.3):
    """A tiny random transformers Llama (untied lm_head) in `dtype`."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = HFLlama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # rows of very different magnitudes: per-channel scales matter
                p.copy_(torch.randn_like(p) * torch.rand(p.shape[0], 1) * std)
    return model.to(dtype).eval()


def hf_weights(hf) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in hf.state_dict().items()}


def fused_reference(sd: dict[str, torch.Tensor], layer: int, fused: str) -> torch.Tensor:
    p = f"model.layers.{layer}."
    return torch.cat([sd[p + part + ".weight"] for part in FUSED[fused]])


def save_compressed_tensors(path: Path, hf, static_inputs: bool = False,
                            strategy: str = "channel", ignore: tuple[str, ...] = ("lm_head",)
                            ) -> None:
    """Quantizes `hf` (in place) to FP8 with compressed-tensors (weight scales per output
    channel, per tensor or per 128 x 128 block) and saves it the way llmcompressor does:
    apply_quantization_config, scales by min-max (what llmcompressor's default observer
    computes), ModelCompressor compress + save + update_config. Static inputs get
    input_scale = 0.01 * (1 + module index)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                               dynamic=False,
                               block_structure=[128, 128] if strategy == "block" else None)
    inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                              strategy="tensor" if static_inputs else "token",
                              dynamic=not static_inputs)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme},
                                                     ignore=list(ignore)))
    with torch.no_grad():
        for i, (_, mod) in enumerate(hf.named_modules()):
            if hasattr(mod, "weight_scale"):
                w = mod.weight
                if strategy == "tensor":
                    w = w.reshape(1, -1)
                elif strategy == "block":  # [rows/128, 128, cols/128, 128] -> per block
                    w = w.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).transpose(1, 2)
                    w = w.flatten(2)
                scale, _ = calculate_qparams(w.amin(dim=-1), w.amax(dim=-1), weights)
                scale = scale.reshape(mod.weight_scale.shape)
                mod.weight_scale.copy_(scale)
            if hasattr(mod, "input_scale"):
                mod.input_scale.fill_(0.01 * (1 + i))
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(path)
    compressor.update_config(str(path))


def edit_checkpoint(path: Path, qc_update: dict | None = None, tensors_update: dict | None = None,
                    drop: tuple[str, ...] = ()) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(qc_update or {})
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    tensors.update(tensors_update or {})
    save_file({k: v.contiguous() for k, v in tensors.items() if k not in drop},
              path / "model.safetensors")


def load_contract(path: Path):
    config, tensors = read_hf_dir(path)
    return config, fuse_hf_tensors(config, tensors, torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---- compressed-tensors, per channel, written by the real package ------------------------


@pytest.mark.parametrize("ct_dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_equals_quantizing_on_load(ct_dtype, tmp_path):
    """The same bf16 weights, quantized by compressed-tensors and saved, or quantized on load
    by quantize_fp8_per_channel, give the same FP8 weights and scales. compressed-tensors
    computes in the model's dtype: from a float32 copy (exact in float32) the results are
    bit-identical; from the bf16 model its scales are bf16 (max|row| / 448 rounded to bf16) and
    each weight element may round to the neighbouring FP8 value."""
    hf = tiny_hf()
    ref = hf_weights(hf)  # bf16
    save_compressed_tensors(tmp_path, hf.to(ct_dtype))
    config, fused = load_contract(tmp_path)
    assert (config.quantization, config.fp8_weight_block, config.fp8_activation_scheme,
            config.fp8_ignored, config.fp8_kv_scales) == ("fp8", None, "dynamic", (), False)
    assert fused["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(fused["lm_head.weight"], ref["lm_head.weight"])
    for layer in range(config.num_layers):
        for name in FUSED:
            w = fused_reference(ref, layer, name)
            q_ref, s_ref = quantize_fp8_per_channel(w)
            key = f"model.layers.{layer}.{name}"
            q, s = fused[key + ".weight"], fused[key + ".weight_scale"]
            assert q.dtype == FP8_DTYPE and q.shape == w.shape
            assert s.dtype == torch.float32 and s.shape == (w.shape[0],)
            assert key + ".input_scale" not in fused
            if ct_dtype == torch.float32:
                assert torch.equal(s, s_ref) and torch.equal(bits(q), bits(q_ref))
            else:
                assert torch.equal(s, s_ref.bfloat16().float())
                # one FP8 step of each value at most: e4m3 steps are <= 2^-3 of the value
                # (normal range) and 2^-9 * scale (subnormal)
                diff = (dequantize_fp8(q, s) - dequantize_fp8(q_ref, s_ref)).abs()
                tol = 2 ** -3 * w.float().abs() + 2 ** -9 * s_ref[:, None] * 1.01
                assert (diff <= tol).all()
                assert (bits(q) != bits(q_ref)).float().mean() < 0.1


def test_compressed_tensors_tensor_and_block_strategies(tmp_path):
    """compressed-tensors per-tensor scales are expanded to one per output row; its 128 x 128
    block scales (block_structure) are kept as blocks when every fused part fills whole row
    blocks. Quantized from float32, so both equal the reference quantization exactly."""
    for strategy in ("tensor", "block"):
        hf = tiny_hf(hidden=256, heads=4, kv_heads=2, inter=384, layers=1, dtype=torch.float32)
        ref = hf_weights(hf)
        save_compressed_tensors(tmp_path / strategy, hf, strategy=strategy)
        config, fused = load_contract(tmp_path / strategy)
        assert config.fp8_weight_block == ((128, 128) if strategy == "block" else None)
        for name in FUSED:
            key = "model.layers.0." + name
            parts = [ref["model.layers.0." + x + ".weight"] for x in FUSED[name]]
            if strategy == "block":
                quantized = [block_quantize(w, (128, 128)) for w in parts]
            else:
                quantized = []
                for w in parts:
                    scale = w.abs().max() / FP8_MAX
                    quantized.append(((w / scale).to(FP8_DTYPE), scale.expand(w.shape[0])))
            assert torch.equal(fused[key + ".weight_scale"], torch.cat([s for _, s in quantized]))
            assert torch.equal(bits(fused[key + ".weight"]),
                               bits(torch.cat([q for q, _ in quantized])))


def test_fp8_lm_head_is_dequantized_and_ignored_projections_listed(tmp_path):
    """The LM head stays in the model dtype: stored in FP8, it is dequantized on load. A decoder
    projection the checkpoint keeps in float (here every down_proj) is named in fp8_ignored."""
    hf = tiny_hf()
    save_compressed_tensors(tmp_path, hf, ignore=("re:.*down_proj",))
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["lm_head.weight"].dtype == FP8_DTYPE
    config, fused = load_contract(tmp_path)
    assert config.fp8_ignored == ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")
    assert "lm_head.weight_scale" not in fused
    want = dequantize_fp8(stored["lm_head.weight"], stored["lm_head.weight_scale"])
    assert torch.equal(fused["lm_head.weight"], want.bfloat16())
    down = "model.layers.1.mlp.down_proj.weight"
    assert fused[down].dtype == torch.bfloat16 and torch.equal(fused[down], stored[down])
    assert fused["model.layers.1.mlp.gate_up_proj.weight"].dtype == FP8_DTYPE


def test_static_input_scales_and_kv_scales(tmp_path):
    """Static activations: each projection's input_scale, the largest of the fused parts'.
    KV scales: compressed-tensors' kv_cache_scheme with k_scale / v_scale per layer (written
    into the saved checkpoint: compressed-tensors 0.20 does not attach KV observers to
    transformers 5 attention modules)."""
    hf = tiny_hf()
    save_compressed_tensors(tmp_path, hf, static_inputs=True)
    saved = load_file(tmp_path / "model.safetensors")
    kv = {f"model.layers.{i}.self_attn.{x}_scale": torch.tensor([0.5 + i + (x == "v")],
                                                                 dtype=torch.bfloat16)
          for i in range(2) for x in "kv"}
    edit_checkpoint(tmp_path, {"kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                   "strategy": "tensor", "dynamic": False,
                                                   "symmetric": True}}, kv)
    config, fused = load_contract(tmp_path)
    assert config.fp8_activation_scheme == "static" and config.fp8_kv_scales
    for i in range(2):
        p = f"model.layers.{i}."
        for name, parts in FUSED.items():
            got = fused[p + name + ".input_scale"]
            want = max(saved[p + part + ".input_scale"].float().item() for part in parts)
            assert got.dtype == torch.float32 and got.shape == () and got.item() == want
        assert fused[p + "self_attn.k_scale"].item() == 0.5 + i
        assert fused[p + "self_attn.v_scale"].item() == 1.5 + i
        assert fused[p + "self_attn.k_scale"].dtype == torch.float32
    assert "lm_head.input_scale" not in fused


def test_dequantized_checkpoint_logits_close_to_bf16(tmp_path):
    """Our model (CPU, float32) run with the loaded FP8 weights dequantized gives logits close
    to the bf16 model's (transformers, float32): FP8's ~3% weight error, not a misplaced scale
    (measured on this model: correct scales give cosine >= 0.994, mean 0.998; one layer's
    down_proj scales 1.2x too large give min 0.973, mean 0.991; scales on the wrong rows < 0.8)."""
    reference = tiny_hf(std=0.12).float()
    tokens = list(range(3, 40))
    want = hf_logits(reference, tokens)
    save_compressed_tensors(tmp_path, tiny_hf(std=0.12))
    config, fused = load_contract(tmp_path)
    plain = {k: dequantize_fp8(v, fused[k + "_scale"]) if v.dtype == FP8_DTYPE else v.float()
             for k, v in fused.items() if not k.endswith("_scale")}
    model = LlamaForCausalLM(dataclasses.replace(config, quantization=None, fp8_ignored=()),
                             get_backend("cpu"), device="meta", dtype=torch.float32)
    model.load_state_dict(plain, strict=True, assign=True)
    model.init_rope_cache()
    got = Pool(model.eval()).step([(0, tokens, 0)])[0]
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.99 and cos.mean() > 0.997
    assert ((got - want).abs().amax(dim=-1) / want.abs().amax(dim=-1)).max() < 0.2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_checkpoint_runs_through_the_fp8_model(tmp_path):
    """The loader's path end to end: a compressed-tensors directory becomes the FP8 model
    (--quantization fp8; its own weights and scales, not quantized again), whose logits (the
    torch reference GEMM on the CPU) stay close to the bf16 model's; without --quantization
    fp8 the checkpoint is refused with one line."""
    from bucketserve.models.loader import model_from_hf_tensors

    reference = tiny_hf(std=0.12).float()
    tokens = list(range(3, 40))
    want = hf_logits(reference, tokens)
    save_compressed_tensors(tmp_path, tiny_hf(std=0.12))
    config, tensors = read_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="--quantization fp8") as err:
        model_from_hf_tensors(config, dict(tensors), "cpu", torch.float32)
    assert "\n" not in str(err.value)
    model = model_from_hf_tensors(config, dict(tensors), "cpu", torch.float32,
                                  get_backend("cpu"), quantization="fp8")
    down = model.model.layers[1].mlp.down_proj
    stored = tensors["model.layers.1.mlp.down_proj.weight"]
    assert down.weight.dtype == FP8_DTYPE and torch.equal(bits(down.weight), bits(stored))
    got = Pool(model).step([(0, tokens, 0)])[0]
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.98 and (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


# ---- plain `fp8` format (Qwen3-FP8 / DeepSeek), written by hand ---------------------------


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference block-wise quantization: one scale per block = its max|w| / 448."""
    out, inp = w.shape
    rows, cols = math.ceil(out / block[0]), math.ceil(inp / block[1])
    scale = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]].float()
            scale[r, c] = tile.abs().max() / FP8_MAX
    full = scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def save_plain_fp8(path: Path, hf, qc: dict, per_tensor: bool = False) -> dict:
    """Saves `hf` as a plain-fp8 checkpoint: block-wise `weight_scale_inv` when qc has
    weight_block_size, else a per-tensor `weight_scale` (+ `input_scale` when static);
    lm_head stays bf16. Returns the stored tensors."""
    hf.save_pretrained(path)
    block = qc.get("weight_block_size")
    tensors = {}
    for key, w in hf_weights(hf).items():
        if not key.endswith("_proj.weight"):
            tensors[key] = w
            continue
        p = key.removesuffix(".weight")
        if block:
            tensors[key], tensors[p + ".weight_scale_inv"] = block_quantize(w, tuple(block))
        else:
            scale = w.float().abs().max() / FP8_MAX
            tensors[key] = (w.float() / scale).to(FP8_DTYPE)
            tensors[p + ".weight_scale"] = scale.reshape(())
        if qc.get("activation_scheme") == "static":
            tensors[p + ".input_scale"] = torch.tensor(0.02 + 0.001 * len(tensors))
    save_file(tensors, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", **qc}
    (path / "config.json").write_text(json.dumps(cfg))
    return tensors


def test_fp8_block_wise_keeps_aligned_blocks(tmp_path):
    """128 x 128 blocks (Qwen3-FP8 / DeepSeek): every fused part fills whole row blocks (q 256,
    k 128, v 128; gate/up 384 rows each), so the block scales are concatenated as stored and
    the fused weight dequantizes to the parts' dequantized weights, stacked."""
    hf = tiny_hf(hidden=256, heads=4, kv_heads=2, inter=384, layers=1)
    stored = save_plain_fp8(tmp_path, hf, {"activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    config, fused = load_contract(tmp_path)
    assert config.fp8_weight_block == (128, 128) and config.fp8_ignored == ()
    p = "model.layers.0."
    for name, parts in FUSED.items():
        q, s = fused[p + name + ".weight"], fused[p + name + ".weight_scale"]
        assert s.dtype == torch.float32 and s.shape == (math.ceil(q.shape[0] / 128),
                                                        math.ceil(q.shape[1] / 128))
        assert torch.equal(s, torch.cat([stored[p + x + ".weight_scale_inv"] for x in parts]))
        want = torch.cat([dequantize_fp8(stored[p + x + ".weight"],
                                         stored[p + x + ".weight_scale_inv"]) for x in parts])
        assert torch.equal(dequantize_fp8(q, s, config.fp8_weight_block), want)


def test_fp8_block_wise_misaligned_is_requantized_per_channel(tmp_path):
    """k has 64 rows, half a 128-row block: concatenated block scales would straddle k and v,
    so every block-wise weight is requantized per output channel from its dequantized value."""
    hf = tiny_hf(hidden=256, heads=4, kv_heads=1, inter=384, layers=1)
    stored = save_plain_fp8(tmp_path, hf, {"activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    config, fused = load_contract(tmp_path)
    assert config.fp8_weight_block is None
    p = "model.layers.0."
    for name, parts in FUSED.items():
        exact = torch.cat([dequantize_fp8(stored[p + x + ".weight"],
                                          stored[p + x + ".weight_scale_inv"]) for x in parts])
        q_ref, s_ref = quantize_fp8_per_channel(exact)
        q, s = fused[p + name + ".weight"], fused[p + name + ".weight_scale"]
        assert s.shape == (exact.shape[0],)
        assert torch.equal(s, s_ref) and torch.equal(bits(q), bits(q_ref))


def test_fp8_per_tensor_static(tmp_path):
    """Per-tensor weight scales are expanded to one per output row of each part; static
    input scales of fused parts become their maximum."""
    hf = tiny_hf(layers=1)
    stored = save_plain_fp8(tmp_path, hf, {"activation_scheme": "static"})
    config, fused = load_contract(tmp_path)
    assert config.fp8_activation_scheme == "static" and config.fp8_weight_block is None
    p = "model.layers.0."
    for name, parts in FUSED.items():
        want = torch.cat([stored[p + x + ".weight_scale"].expand(stored[p + x + ".weight"].shape[0])
                          for x in parts])
        assert torch.equal(fused[p + name + ".weight_scale"], want)
        assert torch.equal(bits(fused[p + name + ".weight"]),
                           bits(torch.cat([stored[p + x + ".weight"] for x in parts])))
        assert fused[p + name + ".input_scale"].item() == max(
            stored[p + x + ".input_scale"].item() for x in parts)


@pytest.mark.parametrize("k_name, v_name", [
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # AutoFP8
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
    ("self_attn.kv_scale", None),  # deprecated: one scale for both
])
def test_kv_scale_spellings(k_name, v_name, tmp_path):
    save_plain_fp8(tmp_path, tiny_hf(layers=1), {"activation_scheme": "dynamic"})
    p = "model.layers.0."
    scales = {p + k_name: torch.tensor([0.25], dtype=torch.bfloat16)}
    if v_name:
        scales[p + v_name] = torch.tensor(0.5)
    edit_checkpoint(tmp_path, tensors_update=scales)
    config, fused = load_contract(tmp_path)
    assert config.fp8_kv_scales
    assert fused[p + "self_attn.k_scale"].dtype == torch.float32
    assert fused[p + "self_attn.k_scale"].item() == 0.25
    assert fused[p + "self_attn.v_scale"].item() == (0.5 if v_name else 0.25)


# ---- what is refused ----------------------------------------------------------------------

_CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                "symmetric": True, "dynamic": False}}}}


def _ct(weights: dict | None = None, inputs: dict | None = None, **top) -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
         "dynamic": False, **(weights or {})}
    group = {"targets": ["Linear"], "weights": w, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, **top}


_CT_MIXED = _ct()
_CT_MIXED["config_groups"]["group_1"] = _ct(inputs={"num_bits": 8, "type": "float",
                                                    "strategy": "tensor"})["config_groups"]["group_0"]


@pytest.mark.parametrize("qc, match", [
    (_CT_INT4, "format 'pack-quantized'"),
    (_ct({"type": "int"}), "type 'int' with 8 bits"),
    (_ct({"num_bits": 4}), "with 4 bits"),
    (_ct({"strategy": "group", "group_size": 64}), "weight strategy 'group'"),
    (_ct({"symmetric": False}), "asymmetric"),
    (_ct(inputs={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}),
     "static input activations with strategy 'token'"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head"}),
     "kv_cache_scheme strategy 'attn_head'"),
    (_ct(quantization_status="frozen"), "not stored in FP8"),
    (_ct(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
    (_ct(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format"),
    (_CT_MIXED, "mix activation schemes"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
])
def test_unsupported_configs_are_refused(qc, match, tmp_path):
    save_plain_fp8(tmp_path, tiny_hf(layers=1), {"activation_scheme": "dynamic"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=match) as err:
        read_hf_dir(tmp_path)
    assert "\n" not in str(err.value)


def test_unsupported_tensors_are_refused(tmp_path):
    p = "model.layers.0."
    stored = save_plain_fp8(tmp_path, tiny_hf(layers=1), {"activation_scheme": "dynamic"})
    e5m2 = stored[p + "mlp.down_proj.weight"].float().to(torch.float8_e5m2)
    edit_checkpoint(tmp_path, tensors_update={p + "mlp.down_proj.weight": e5m2})
    with pytest.raises(UnsupportedModelError, match="float8_e4m3fn"):
        read_hf_dir(tmp_path)

    save_plain_fp8(tmp_path, tiny_hf(layers=1), {"activation_scheme": "dynamic"})
    edit_checkpoint(tmp_path, tensors_update={
        p + "self_attn.k_proj.weight": stored[p + "self_attn.k_proj.weight"].float()},
        drop=(p + "self_attn.k_proj.weight_scale",))
    with pytest.raises(UnsupportedModelError, match="only some are quantized"):
        read_hf_dir(tmp_path)

    save_plain_fp8(tmp_path, tiny_hf(layers=1), {"activation_scheme": "static"})
    edit_checkpoint(tmp_path, drop=(p + "mlp.up_proj.input_scale",))
    with pytest.raises(UnsupportedModelError, match="up_proj.input_scale is missing"):
        read_hf_dir(tmp_path)

    save_plain_fp8(tmp_path, tiny_hf(layers=2), {"activation_scheme": "dynamic"})
    edit_checkpoint(tmp_path, tensors_update={p + "self_attn.k_scale": torch.tensor(1.0),
                                              p + "self_attn.v_scale": torch.tensor(1.0)})
    with pytest.raises(UnsupportedModelError, match="but not model.layers.1.self_attn.k_scale"):
        read_hf_dir(tmp_path)
