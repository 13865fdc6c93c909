"""Read a GGUF file (llama.cpp format) into a ModelConfig, dense weights and a Tokenizer.

Weights are dequantized with the `gguf` package to float32 and renamed to the Hugging Face
names (the loader fuses them afterwards). One layout change has to be undone: for the
`llama` architecture llama.cpp's converter reorders the rows of attn_q / attn_k inside each
head so that rotary pairs are adjacent (GPT-J "interleaved" form, row h*D + 2i + j holds HF
row h*D + j*D/2 + i). We put them back into HF's "rotate half" order so one RoPE
implementation serves both sources. Qwen2 files are written without that reordering.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bucketserve.models.config import ModelConfig, UnsupportedModelError
from bucketserve.models.tokenizer import Tokenizer

# general.architecture -> (HF architecture, q/k rows permuted by the converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class GGUFContents:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names, float32, unfused
    tokenizer: Tokenizer


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key -> python value (str, int, float, bool, or list of those)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face parameter name."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    parts = gguf_name.split(".")  # blk.N.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in this model")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row reorder. w: [n_head * D, ...] (weight or bias)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "this GGUF stores per-frequency RoPE factors (rope_freqs, Llama 3.1 style), which "
            "are not supported; load the model's Hugging Face directory instead")

    def key(name: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise UnsupportedModelError(f"GGUF metadata lacks '{arch}.{name}'")
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(
            f"GGUF rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    return ModelConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        architecture=GGUF_ARCHITECTURES[arch][0],
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
    )


def read_gguf(path: str | Path) -> GGUFContents:
    """Parses the header, dequantizes every tensor to float32, builds the tokenizer."""
    import gguf  # imported here: only GGUF loading needs it

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found; check the path")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, names)
    permuted = GGUF_ARCHITECTURES[meta["general.architecture"]][1]
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # [out, in] float32 (the reader already reverses ggml's dimension order)
        arr = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                   dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as read-only views of the file
            arr = arr.copy()
        w = torch.from_numpy(arr)
        name = hf_name(t.name)
        if permuted and ".q_proj." in name:
            w = unpermute_rows(w, config.num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rows(w, config.num_kv_heads)
        tensors[name] = w
    tokenizer = Tokenizer.from_gguf_metadata(
        {k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    return GGUFContents(config, tensors, tokenizer)
