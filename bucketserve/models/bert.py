"""BERT-family sentence encoder (BERT, MiniLM, BGE, E5): absolute position and token-type
embeddings, post-LN transformer layers, GELU, then sentence-transformers-style pooling.

The encoder always runs a whole padded batch at one shape: input_ids [B, L] with a boolean
attention mask [B, L] (True = real token, padding on the right). Padded positions are computed
(so every bucket has one fixed shape) but masked out of attention keys and out of pooling, so
they never change a real token's result.

Weight names follow Hugging Face's BertModel (with or without the "bert." prefix); query, key and
value are fused into one [3H, H] projection at load time (bert_loader.py) for one GEMM per layer.
On a float32 CPU model, `pack_cpu_weights()` lets the projections use the packed GEMM of
kernels/cpu_plan.default_cpu_plan (oneDNN's where torch has it, else MKL's): oneDNN's for
every forward, MKL's for forwards of at most PACKED_MAX_ROWS tokens, where it is faster. With
oneDNN's, the feed-forward GELU and the two residual adds of a layer run in the GEMMs'
epilogues (_Linear.activated / .plus) instead of as passes of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.kernels import bert_ops
from bucketserve.models import llama
from bucketserve.models.llama import Linear, pack_linear_weights

# Largest B * L for which the projections use MKL's packed sgemm. Measured on the 2-core dev
# machine (whole forward, fastest of 12-16 interleaved runs, packed vs F.linear): 1x16 1.37x,
# 1x208 1.08x, 1x256 1.16x, 2x144 1.09x faster; from ~350 rows on no faster (2x192 0.90x,
# 3x144 0.99x, 4x128 0.95x) and slower at offline batch sizes (32x128 0.87x, 32x256 0.94x).
# oneDNN's packed GEMM has no such limit: on the AMD EPYC (AVX-512) kind, where "auto" picks
# it, the whole MiniLM forward ran 1.0-1.05x faster than F.linear at 1-2 x 136 tokens and
# 1.6-2.0x at 3 x 136 .. 32 x 256 (2026-12-02), sizes this limit had sent to F.linear.
PACKED_MAX_ROWS = 320
NO_ROW_LIMIT = 1 << 62

# Pooling modes in the order sentence-transformers concatenates them when several are set.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")

# oneDNN's GELU post-op algorithm for each GELU activation ("none": erf, as HF "gelu")
_ONEDNN_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # exact (erf) GELU, as HF "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> BertConfig:
        """Build from a Hugging Face BERT config.json dict; refuses variants we do not run."""
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(
                f"position_embedding_type {pos!r} is not supported; only 'absolute' BERT "
                "position embeddings are implemented"
            )
        act = d.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; expected one of "
                             f"{sorted(_ACTIVATIONS)}")
        if d["hidden_size"] % d["num_attention_heads"]:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=int(d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            pad_token_id=int(d.get("pad_token_id") or 0),
        )


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        # input_ids [B, L] -> [B, L, H]. Positions are 0..L-1 for every row (right padding).
        L = input_ids.shape[1]
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:L]
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class _Linear(Linear):
    """Llama's Linear (uninitialised parameters, the loader assigns them; optional packed
    weight), using the packed weight only for inputs of at most `max_packed_rows` rows
    (PACKED_MAX_ROWS with MKL's packed sgemm, no limit with oneDNN's: pack_cpu_weights)."""

    max_packed_rows = PACKED_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        if x.shape[0] > self.max_packed_rows:
            return F.linear(x, self.weight, self.bias)
        return super().forward(x)

    def _onednn(self) -> bool:
        return self.gemm == "onednn" and self.packed is not None  # no row limit

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T + b [T, out]; with oneDNN's packed GEMM the add is the GEMM's
        epilogue (a binary post-op), not a pass of its own over [T, out]."""
        if self._onednn():
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias,
                                                             "add")
        return residual + self(x)

    def activated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """_ACTIVATIONS[act](x W^T + b) [T, out]; with oneDNN's packed GEMM a GELU is the
        GEMM's epilogue (its erf or tanh form, as `act` asks)."""
        if act in _ONEDNN_GELU and self._onednn():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [],
                                                      _ONEDNN_GELU[act])
        return _ACTIVATIONS[act](self(x))


class BertLayer(nn.Module):
    """Post-LN layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        # Projections take 2-D input (MKL's packed sgemm does), so layers work on [B * L, H].
        self.qkv = _Linear(H, 3 * H, bias=True)  # rows: [query; key; value]
        self.attn_out = _Linear(H, H, bias=True)
        self.attn_norm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.ffn_in = _Linear(H, cfg.intermediate_size, bias=True)
        self.ffn_out = _Linear(cfg.intermediate_size, H, bias=True)
        self.ffn_norm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.act = cfg.hidden_act
        # kernels/bert_ops.py (BertEmbeddingModel.use_fused_kernels): residual add +
        # LayerNorm as one kernel; the feed-forward bias + GELU in the GEMM's epilogue
        self.fused_add_norm = False
        self.gelu_epilogue = False

    def forward(self, x: torch.Tensor, batch: int, attn_mask: torch.Tensor | None) -> torch.Tensor:
        # x [T = B * L, H] (row b * L + i is token i of sequence b); attn_mask [B, 1, 1, L]
        # additive (0 = attend, -inf = padding) or None.
        T, H = x.shape
        L = T // batch
        qkv = self.qkv(x).view(batch, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, L, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        a = a.transpose(1, 2).reshape(T, H)
        if not self.fused_add_norm:
            x = self.attn_norm(self.attn_out.plus(a, x))
            return self.ffn_norm(self.ffn_out.plus(self._ffn_in(x), x))
        n1, n2 = self.attn_norm, self.ffn_norm
        x = bert_ops.add_layer_norm(self.attn_out(a), x, n1.weight, n1.bias, n1.eps)
        return bert_ops.add_layer_norm(self.ffn_out(self._ffn_in(x)), x, n2.weight, n2.bias,
                                       n2.eps)

    def _ffn_in(self, x: torch.Tensor) -> torch.Tensor:
        # [T, H] -> act(x W_in^T + b_in) [T, I]; the epilogue computes the tanh GELU
        if self.gelu_epilogue:
            return bert_ops.linear_gelu(x, self.ffn_in.weight, self.ffn_in.bias)
        return self.ffn_in.activated(x, self.act)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, key_mask: torch.Tensor | None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] long, key_mask [B, 1, 1, L] additive (0 / -inf) or None -> hidden
        [B, L, H]. No host sync: CUDA graphs capture this."""
        x = self.embeddings(input_ids, token_type_ids)
        B, L, H = x.shape
        x = x.view(B * L, H)
        for layer in self.layers:
            x = layer(x, B, key_mask)
        return x.view(B, L, H)

    def key_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """Boolean key mask [B, L] (True = real) -> additive [B, 1, 1, L] (0 / -inf) in the
        model's dtype, built once per forward: SDPA would convert a boolean mask again in every
        layer (two extra ops each, which on a busy CPU cost as much as a GEMM). Every row keeps
        >= 1 real key ([CLS])."""
        key_mask = torch.zeros(mask.shape, dtype=self.embeddings.LayerNorm.weight.dtype,
                               device=mask.device)
        return key_mask.masked_fill_(~mask, -math.inf)[:, None, None, :]


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """Sentence vectors from token vectors: hidden [B, L, H], mask [B, L] bool -> [B, H * len(modes)].

    Each row of mask must have its real tokens first (right padding) and at least one of them.
    """
    m = mask.unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
    lengths = mask.sum(dim=1)  # [B]
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(~mask.unsqueeze(-1), -math.inf).amax(dim=1))
        elif mode in ("mean", "mean_sqrt_len"):
            summed = (hidden * m).sum(dim=1)
            denom = lengths.to(hidden.dtype).clamp(min=1.0).unsqueeze(-1)
            parts.append(summed / (denom if mode == "mean" else denom.sqrt()))
        else:  # "lasttoken" (BertEmbeddingModel refuses any other mode)
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            parts.append(hidden[rows, lengths - 1])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class _EncoderModel(nn.Module):
    """A BertEncoder with a head: rows of token ids in, one float32 row per input out."""

    config: BertConfig
    encoder: BertEncoder

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        return None

    def head(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] long, attention_mask [B, L] bool -> [B, D] float32."""
        # A mask with no padding changes nothing; None lets SDPA take its unmasked fast path
        # (checking costs a host sync: embed_lengths below is the sync-free variant).
        key_mask = None if bool(attention_mask.all()) else self.encoder.key_mask(attention_mask)
        hidden = self.encoder(input_ids, key_mask, self.token_types(input_ids))
        return self.head(hidden, attention_mask)

    @torch.inference_mode()
    def embed_lengths(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] (int32 or long), lengths [B] (each 1..L; row b holds lengths[b]
        real tokens then padding) -> [B, D] float32. Never syncs with the host, so one CUDA
        graph per (B, L) can capture it; padding rows of a graph are rows of length 1."""
        ids = input_ids.long()
        mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        hidden = self.encoder(ids, self.encoder.key_mask(mask), self.token_types(ids))
        return self.head(hidden, mask)


class BertEmbeddingModel(_EncoderModel):
    """Encoder + pooling + optional L2 normalisation: the sentence-transformers pipeline."""

    def __init__(self, cfg: BertConfig, pooling: tuple[str, ...] = ("mean",),
                 normalize: bool = True) -> None:
        super().__init__()
        for mode in pooling:
            if mode not in POOLING_MODES:
                raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
        self.config = cfg
        self.encoder = BertEncoder(cfg)
        self.pooling = tuple(pooling)
        self.normalize = normalize

    @property
    def embedding_dim(self) -> int:
        return self.config.hidden_size * len(self.pooling)

    def use_fused_kernels(self, add_norm: bool = True, gelu_epilogue: bool | None = None) -> None:
        """kernels/bert_ops.py in every layer: residual add + LayerNorm as one kernel
        (add_norm), and the feed-forward bias + GELU in cuBLASLt's epilogue (gelu_epilogue;
        None: only where that is the model's own activation, the tanh GELU). The torch
        versions of both run off CUDA, so this changes only a CUDA model's kernels."""
        if gelu_epilogue is None:
            gelu_epilogue = self.config.hidden_act in ("gelu_new", "gelu_pytorch_tanh")
        for layer in self.encoder.layers:
            layer.fused_add_norm = add_norm
            layer.gelu_epilogue = gelu_epilogue

    def pack_cpu_weights(self) -> bool:
        """Lets every projection of a float32 CPU model use the packed GEMM (llama.py's
        backend choice): oneDNN's for every forward, MKL's for forwards of at most
        PACKED_MAX_ROWS tokens (the original weights stay, for larger forwards and for
        autograd). Returns False, changing nothing, where packing does not apply. Call again
        after changing the weights."""
        if not pack_linear_weights(self, self.encoder.embeddings.word_embeddings.weight):
            return False
        limit = PACKED_MAX_ROWS if llama.packed_gemm_backend() == "mkl" else NO_ROW_LIMIT
        for sub in self.modules():
            if isinstance(sub, _Linear):
                sub.max_packed_rows = limit
        return True

    def head(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Pooling sums up to L vectors: done in float32 so that half-precision models lose
        # nothing there (cosine vs the float32 reference stays >= 0.9999).
        out = pool(hidden.float(), mask, self.pooling)
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out


class BertCrossEncoder(_EncoderModel):
    """A BERT cross-encoder (HF BertForSequenceClassification): a (query, document) pair as one
    row `[CLS] query [SEP] document [SEP]` -> relevance scores [B, num_labels] float32; with
    one label the sigmoid of the logit, as sentence-transformers' CrossEncoder reports it.
    The token types (0 up to and including the first [SEP], 1 after it) are derived from the
    ids, so a pair batches, pads and buckets like any embedding input."""

    def __init__(self, cfg: BertConfig, sep_token_id: int, num_labels: int = 1) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = BertEncoder(cfg)
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self.sep_token_id = sep_token_id
        self.num_labels = num_labels

    @property
    def embedding_dim(self) -> int:
        return self.num_labels

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        sep = (input_ids == self.sep_token_id).long()
        return ((sep.cumsum(dim=-1) - sep) > 0).long()  # strictly after the first [SEP]

    def head(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.classifier(torch.tanh(self.pooler(hidden[:, 0]))).float()
        return torch.sigmoid(logits) if self.num_labels == 1 else logits
