"""load_model(name) -> LoadedModel: weights, tokenizer and config from a registered name, a
Hugging Face directory or a .gguf file; build_dummy_model(config) for benchmarks.

Models are built on the meta device and the checkpoint tensors are assigned in, so no memory
is spent on a random initialisation that would be overwritten. q/k/v and gate/up are fused
here (one copy at load time) to save GEMM launches at run time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from bucketserve.kernels import cpu_quant
from bucketserve.kernels.attention import AttentionBackend
from bucketserve.kernels.fp8 import dequantize_fp8, quantize_fp8_per_channel
from bucketserve.models.config import ModelConfig
from bucketserve.models.fp8_checkpoint import apply_fp8_checkpoint, fuse_fp8_linear
from bucketserve.models.llama import (
    FP8_PROJECTIONS,
    LlamaForCausalLM,
    QuantLinear,
    quantize_state_dict_fp8,
)
from bucketserve.models.registry import resolve
from bucketserve.models.tokenizer import Tokenizer

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    name: str
    max_model_len: int


def get_backend(device: torch.device | str) -> AttentionBackend:
    """The attention backend of a device: the Triton kernels on CUDA (imported only there),
    the torch reference with the C kernels elsewhere."""
    if torch.device(device).type == "cuda":
        from bucketserve.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    return AttentionBackend()


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch floating dtype from a dtype or a name ("float32", "bf16", ...)."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    elif dtype in (torch.float32, torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(
        f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")


def load_model(name_or_path: str, device: torch.device | str = "cpu",
               dtype: torch.dtype | str = torch.float32,
               attn_backend: AttentionBackend | None = None,
               quantization: str = "none") -> LoadedModel:
    """Registered name ("smollm2-135m-instruct"), a Hugging Face directory or a .gguf path.
    quantization "fp8": the decoder projections quantized on load (quantize_state_dict_fp8);
    "q4_1" (CPU, a GGUF whose projections are Q4_1): the projections kept in their GGUF
    blocks and the tied LM head in the token embedding's (Q8_0) blocks; "int8" (CPU): the
    projections quantized on load, per output channel, the LM head left float32
    (kernels/cpu_quant.py)."""
    dtype = resolve_dtype(dtype)
    device = torch.device(device)
    entry = resolve(name_or_path)
    if entry.kind != "llm":
        raise ValueError(
            f"{entry.name!r} is an embedding model, not a text generator; serve it through the "
            "embeddings endpoint (bucketserve.models.bert_loader)")
    why = quantization_refusal(entry.path, quantization, device, dtype)
    if why is not None:
        raise ValueError(why)
    blocks: dict[str, tuple[int, torch.Tensor]] = {}
    if entry.path.suffix == ".gguf":
        from bucketserve.models.gguf_loader import read_gguf

        keep = frozenset(cpu_quant.BLOCKS) if quantization == "q4_1" else frozenset()
        contents = read_gguf(entry.path, keep_blocks=keep)
        config, tensors, tokenizer = contents.config, contents.tensors, contents.tokenizer
        blocks = contents.blocks
    else:
        config, tensors = read_hf_dir(entry.path)
        tokenizer = Tokenizer.from_hf_dir(entry.path)
        if not tokenizer.eos_token_ids and config.eos_token_ids:
            tokenizer.eos_token_ids = set(config.eos_token_ids)
    backend = attn_backend or get_backend(device)
    model = model_from_hf_tensors(config, {**tensors, **_projection_blocks(blocks)}, device,
                                  dtype, backend, quantization)
    if quantization in cpu_quant.CPU_MODES:
        model.lm_head_quant = _quantized_lm_head(model, blocks)
    return LoadedModel(model, tokenizer, config, entry.name, config.max_position_embeddings)


def quantization_refusal(path: Path, quantization: str, device: torch.device | str = "cpu",
                         dtype: torch.dtype | str = torch.float32) -> str | None:
    """Why `quantization` cannot serve the checkpoint at `path` (one line), or None. The CPU
    modes (q4_1, int8) need the CPU and float32; q4_1 needs a GGUF file whose decoder
    projections are all Q4_1 blocks (read from the header only)."""
    if quantization not in cpu_quant.CPU_MODES:
        return None
    if torch.device(device).type != "cpu":
        return (f"--quantization {quantization} is a CPU weight format; on "
                f"{torch.device(device).type} use --quantization none or fp8")
    if resolve_dtype(dtype) != torch.float32:
        return f"--quantization {quantization} computes in float32; use --dtype float32 (or auto)"
    if quantization != "q4_1":
        return None
    if path.suffix != ".gguf":
        return (f"--quantization q4_1 multiplies a GGUF file's own Q4_1 blocks; {path} is not a "
                ".gguf file (use --quantization int8 for a Hugging Face checkpoint)")
    from bucketserve.models.gguf_loader import _PER_LAYER, read_gguf_file

    _, raw = read_gguf_file(path)
    projections = {f".{kind}." for kind in _PER_LAYER if not kind.endswith("_norm")}
    other = sorted({cpu_quant.QTYPE_NAMES.get(t.qtype, str(t.qtype)) for t in raw
                    if any(p in t.name for p in projections) and t.qtype != cpu_quant.Q4_1})
    if other:
        return (f"--quantization q4_1 needs a GGUF whose projections are Q4_1 blocks; {path.name} "
                f"has projections in {', '.join(other)} (use --quantization int8 or none)")
    return None


def _projection_blocks(blocks: dict[str, tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The decoder projections' GGUF blocks (uint8 [N, row bytes]), by HF name: fused like
    float32 weights (rows concatenated) by fuse_hf_tensors."""
    return {name: b for name, (_, b) in blocks.items()
            if name not in ("model.embed_tokens.weight", "lm_head.weight")}


def _quantized_lm_head(model: LlamaForCausalLM,
                       blocks: dict[str, tuple[int, torch.Tensor]]) -> QuantLinear | None:
    """q4_1: the LM head as a QuantLinear on the GGUF's own blocks of the LM head (the token
    embedding when tied) where they are Q4_1 or Q8_0; else None (int8 too): the float32 head,
    packed by use_cpu_plan. int8 keeps the float32 head because the logits are the most
    rounding-sensitive product: an int8 head cost ~1.1 points of perplexity (docs/quantization.md)."""
    c = model.config
    if model.quantization != "q4_1":
        return None
    qtype, b = blocks.get("model.embed_tokens.weight" if c.tie_word_embeddings
                          else "lm_head.weight", (None, None))
    if qtype not in cpu_quant.BLOCKS or c.hidden_size % 32:
        return None
    lin = QuantLinear(c.hidden_size, c.vocab_size, False, "q4_1", qtype=qtype)
    lin.weight.data = b
    return lin.requires_grad_(False)


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + model.safetensors (or a sharded index) -> (config, HF-named tensors)."""
    from safetensors import safe_open

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found; the model directory needs config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    config = ModelConfig.from_hf_dict(raw)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {path}; save the model "
            "with save_pretrained(dir, safe_serialization=True) (.bin checkpoints are not read)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        fp = path / name
        if not fp.is_file():
            raise FileNotFoundError(f"shard {fp} listed in the index is missing")
        with safe_open(str(fp), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(("model.", "lm_head.")) and not key.endswith("inv_freq"):
                    tensors[key] = f.get_tensor(key)
    if raw.get("quantization_config"):
        config = apply_fp8_checkpoint(config, raw["quantization_config"], tensors,
                                      linear_parts(config))
    return config, tensors


def linear_parts(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """This package's decoder projections -> the HF projections concatenated (along rows) into
    each."""
    parts: dict[str, tuple[str, ...]] = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        parts[p + "self_attn.qkv_proj"] = tuple(p + f"self_attn.{x}_proj" for x in "qkv")
        parts[p + "self_attn.o_proj"] = (p + "self_attn.o_proj",)
        parts[p + "mlp.gate_up_proj"] = (p + "mlp.gate_proj", p + "mlp.up_proj")
        parts[p + "mlp.down_proj"] = (p + "mlp.down_proj",)
    return parts


def fuse_hf_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor],
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF parameter names -> this package's (q/k/v and gate/up concatenated along rows). FP8
    projections (config.quantization) keep their float8 weights and float32 scales
    (fp8_checkpoint.fuse_fp8_linear); everything else is cast to `dtype`."""
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise ValueError(f"checkpoint is missing tensor {key!r}")
        t = tensors.pop(key)  # GGUF blocks (uint8) stay as they are
        return t if t.dtype == torch.uint8 else t.to(dtype)

    for name, parts in linear_parts(config).items():
        if config.quantization == "fp8" and name not in config.fp8_ignored:
            out.update(fuse_fp8_linear(name, parts, tensors, config.fp8_weight_block))
        else:
            weights = [take(p + ".weight") for p in parts]
            out[name + ".weight"] = weights[0] if len(parts) == 1 else torch.cat(weights)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if config.attention_bias:
            out[p + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        keys = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if config.fp8_kv_scales:  # float32 scalars, kept in float32
            out[p + "self_attn.k_scale"] = tensors.pop(p + "self_attn.k_scale")
            out[p + "self_attn.v_scale"] = tensors.pop(p + "self_attn.v_scale")
        if config.o_proj_bias:
            keys.append("self_attn.o_proj.bias")
        if config.mlp_bias:
            out[p + "mlp.gate_up_proj.bias"] = torch.cat(
                [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
            keys.append("mlp.down_proj.bias")
        for key in keys:
            out[p + key] = take(p + key)
    out["model.embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["model.norm.weight"] = take("model.norm.weight")
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    if tensors:
        raise ValueError(f"checkpoint has tensors this model does not use: {sorted(tensors)[:5]}")
    return out


def model_from_hf_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor],
                          device: torch.device | str, dtype: torch.dtype,
                          attn_backend: AttentionBackend | None = None,
                          quantization: str = "none") -> LlamaForCausalLM:
    """Builds the model on the meta device and assigns the (fused) checkpoint tensors;
    quantization "fp8" quantizes the projections on `device` first."""
    fused = {k: v.to(device) for k, v in fuse_hf_tensors(config, dict(tensors), dtype).items()}
    if config.quantization == "fp8":  # a pre-quantized checkpoint: already in FP8 form
        if quantization != "fp8":
            raise ValueError(
                "this checkpoint is quantized to FP8 (config.json quantization_config); serve "
                "it with --quantization fp8")
        if config.fp8_weight_block is not None:  # block scales -> one scale per channel
            for key in [k for k in fused if k.endswith(".weight_scale") and fused[k].dim() == 2]:
                wkey = key[: -len("_scale")]
                w = dequantize_fp8(fused[wkey], fused[key], config.fp8_weight_block)
                fused[wkey], fused[key] = quantize_fp8_per_channel(w)
    elif quantization == "fp8":
        fused = quantize_state_dict_fp8(fused)
    elif quantization == "int8":
        fused = cpu_quant.quantize_state_dict_int8(fused, FP8_PROJECTIONS)
    model = LlamaForCausalLM(config, attn_backend, device="meta", dtype=dtype,
                             quantization=quantization)
    model.load_state_dict(fused, strict=True, assign=True)
    return _finish(model)


def build_dummy_model(config: ModelConfig, device: torch.device | str = "cpu",
                      dtype: torch.dtype | str = torch.float32,
                      attn_backend: AttentionBackend | None = None,
                      seed: int = 0, quantization: str = "none") -> LlamaForCausalLM:
    """Random weights (normal, std 0.02; norms 1) allocated directly in `dtype` on `device`;
    quantization "fp8": those weights, then quantized (quantize_state_dict_fp8)."""
    dtype = resolve_dtype(dtype)
    model = LlamaForCausalLM(config, attn_backend or get_backend(device), device=device,
                             dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if quantization not in ("none", "fp8", "int8"):
        raise ValueError(f"build_dummy_model: quantization {quantization!r} needs a checkpoint's "
                         "blocks; expected none, fp8 or int8")
    if quantization != "none":
        state = model.state_dict()
        state = (quantize_state_dict_fp8(state) if quantization == "fp8"
                 else cpu_quant.quantize_state_dict_int8(state, FP8_PROJECTIONS))
        backend = model.attn_backend
        del model
        model = LlamaForCausalLM(config, backend, device="meta", dtype=dtype,
                                 quantization=quantization)
        model.load_state_dict(state, strict=True, assign=True)
    return _finish(model)


def _finish(model: LlamaForCausalLM) -> LlamaForCausalLM:
    model.init_rope_cache()
    model.requires_grad_(False)
    return model.eval()

