"""Model hyper-parameters, read from a Hugging Face config.json or a GGUF header.

One frozen dataclass describes every decoder we run (Llama and Qwen2 layouts). Both the old
config.json spelling (`rope_theta` + `rope_scaling`) and the transformers 5 spelling
(`rope_parameters`) are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF architecture name -> whether q/k/v projections carry a bias by default.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}

# rope_type values that llama.py implements.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this package cannot run; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3"|"linear", "factor": ..., ...} (rope_theta removed)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have a bias
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    o_proj_bias: bool = False  # HF Llama with attention_bias=True biases o_proj too (Qwen2 does not)
    mlp_bias: bool = False
    # Pre-quantized FP8 checkpoints (models/fp8_checkpoint.py fills these in; None = float
    # weights). "fp8": every decoder projection (qkv_proj, o_proj, gate_up_proj, down_proj) not
    # named in fp8_ignored holds a float8_e4m3fn weight with a float32 weight_scale, [out] per
    # channel, or [ceil(out/b0), ceil(in/b1)] when fp8_weight_block = (b0, b1). The LM head and
    # embeddings are never FP8.
    quantization: str | None = None
    fp8_weight_block: tuple[int, int] | None = None
    fp8_activation_scheme: str = "dynamic"  # "static": each FP8 projection has an input_scale
    fp8_ignored: tuple[str, ...] = ()  # decoder projections the checkpoint stores in float
    fp8_kv_scales: bool = False  # each layer's self_attn has k_scale / v_scale

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {rope_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.quantization not in (None, "fp8"):
            raise UnsupportedModelError(
                f"quantization {self.quantization!r} is not supported; supported: fp8")
        if self.fp8_activation_scheme not in ("dynamic", "static"):
            raise UnsupportedModelError(
                f"FP8 activation scheme {self.fp8_activation_scheme!r} is not supported; "
                "supported: dynamic, static")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Builds the config from a parsed config.json (transformers 4.x or 5.x spelling)."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported for text generation; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise UnsupportedModelError(f"config.json has no {key!r}; is it a decoder config?")
        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_from_hf(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bias_default = SUPPORTED_ARCHITECTURES[arch]
        qkv_bias = bool(d.get("attention_bias", bias_default))
        max_pos = int(d.get("max_position_embeddings", 2048))
        window = d.get("sliding_window")
        if window and (arch == "MistralForCausalLM" or d.get("use_sliding_window")):
            # Every layer attends to at most `window` positions; up to that length this is
            # plain causal attention, which is all we implement, so cap the context there.
            max_pos = min(max_pos, int(window))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            o_proj_bias=qkv_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(d.get("mlp_bias", False)),
        )


def _arch_from_model_type(model_type: str | None) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}.get(model_type or "", f"<model_type {model_type!r}>")


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config spelling."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers >= 5
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:  # legacy key name
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling
