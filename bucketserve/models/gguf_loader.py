"""Read a GGUF file (llama.cpp format) into a ModelConfig, dense weights and a Tokenizer.

Weights are dequantized with the `gguf` package to float32 and renamed to the Hugging Face
names (the loader fuses them afterwards). One layout change has to be undone: for the
`llama` architecture llama.cpp's converter reorders the rows of attn_q / attn_k inside each
head so that rotary pairs are adjacent (GPT-J "interleaved" form, row h*D + 2i + j holds HF
row h*D + j*D/2 + i). We put them back into HF's "rotate half" order so one RoPE
implementation serves both sources. Qwen2 files are written without that reordering.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
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
    # read_gguf(keep_blocks=...): HF name -> (gguf qtype, [N, row bytes] uint8 blocks) of the
    # tensors kept in their GGUF blocks (projections: instead of a float32 entry in tensors)
    blocks: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


# ---- file parsing ----------------------------------------------------------------------
# gguf.GGUFReader builds numpy views for every element of every metadata array (about 150k
# for a 49k vocabulary: ~4 s); reading the header directly with struct takes ~0.1 s.
# Layout (little endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count, the kv
# pairs, the tensor infos, padding to `general.alignment`, then the tensor data.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
               10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass
class RawTensor:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    data: np.ndarray  # as gguf.quants.dequantize expects it (uint8 blocks, or f16/f32 values)


class _Cursor:
    def __init__(self, buf: memoryview | bytes) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype == _STRING:
                return [self.string() for _ in range(count)]
            if itype in _NP_SCALARS:
                arr = np.frombuffer(self.buf, dtype=_NP_SCALARS[itype], count=count,
                                    offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def read_gguf_file(path: str | Path) -> tuple[dict[str, Any], list[RawTensor]]:
    """(metadata key -> python value, tensors in file order). The tensor data are views of a
    read-only memory map of the file."""
    import gguf

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(mm[:4])!r})")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3 only)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, qtype, offset in infos:
        qt = gguf.GGMLQuantizationType(qtype)
        shape = tuple(reversed(dims))  # ggml lists the fastest-varying dimension first
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(dims)) // block * type_size
        raw = mm[start + offset: start + offset + nbytes]
        if qt == gguf.GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qt == gguf.GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qt))
        tensors.append(RawTensor(name, qtype, data))
    return meta, tensors


# ---- mapping to the HF layout -------------------------------------------------------------


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


def read_gguf(path: str | Path, keep_blocks: frozenset[int] = frozenset()) -> GGUFContents:
    """Parses the header, dequantizes every tensor to float32, builds the tokenizer.

    keep_blocks: gguf qtypes whose tensors are also kept in their GGUF blocks
    (GGUFContents.blocks, rows un-permuted like the float32 ones): the decoder projections
    then have no float32 entry in tensors (they are used as blocks only, never dequantized);
    the token embedding keeps both (the lookup reads float32 rows, the tied LM head the
    blocks)."""
    import gguf  # imported here: only GGUF loading needs it

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found; check the path")
    try:
        meta, raw = read_gguf_file(path)
    except (ValueError, OSError, struct.error) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    names = {t.name for t in raw}
    config = config_from_metadata(meta, names)
    permuted = GGUF_ARCHITECTURES[meta["general.architecture"]][1]
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, tuple[int, torch.Tensor]] = {}
    for t in raw:
        name = hf_name(t.name)
        if t.qtype in keep_blocks and t.data.ndim == 2:
            b = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # a copy out of the file map
            if permuted and ".q_proj." in name:
                b = unpermute_rows(b, config.num_heads)
            elif permuted and ".k_proj." in name:
                b = unpermute_rows(b, config.num_kv_heads)
            blocks[name] = (t.qtype, b)
            if name != "model.embed_tokens.weight":
                continue
        # [out, in] float32
        arr = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.qtype))
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as read-only views of the file
            arr = arr.copy()
        w = torch.from_numpy(arr)
        if permuted and ".q_proj." in name:
            w = unpermute_rows(w, config.num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rows(w, config.num_kv_heads)
        tensors[name] = w
    tokenizer = Tokenizer.from_gguf_metadata(
        {k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    return GGUFContents(config, tensors, tokenizer, blocks)
