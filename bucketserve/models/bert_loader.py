"""Load a sentence-transformers / Hugging Face BERT directory into BertEmbeddingModel.

A directory holds config.json, model.safetensors, tokenizer.json and, for sentence-transformers
models, modules.json (Transformer -> Pooling -> optional Normalize), 1_Pooling/config.json and
sentence_bert_config.json (max_seq_length, do_lower_case). Without modules.json the model is
read as a plain BertModel with mean pooling and no normalisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from bucketserve.models.bert import POOLING_MODES, BertConfig, BertCrossEncoder, BertEmbeddingModel
from bucketserve.models.embedding_tokenizer import EmbeddingTokenizer
from bucketserve.models.registry import resolve

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"

# sentence-transformers Pooling config keys -> our mode names.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULES = {"Transformer", "Pooling", "Normalize"}


@dataclass
class LoadedEncoder:
    """A BERT-family model (sentence embeddings or a cross-encoder) and its tokenizer."""

    model: BertEmbeddingModel | BertCrossEncoder
    tokenizer: EmbeddingTokenizer
    config: BertConfig
    name: str
    max_seq_length: int  # longest accepted input in tokens, special tokens included
    path: Path


def resolve_embedding_model(name_or_path: str) -> tuple[str, Path]:
    """(served model name, directory) for a registry name or an HF directory."""
    entry = resolve(name_or_path)
    if entry.kind != "embedding" or not entry.path.is_dir():
        raise ValueError(f"{name_or_path!r} is not an embedding model (a BERT-family Hugging "
                         f"Face directory); the default is {DEFAULT_EMBEDDING_MODEL!r}")
    return entry.name, entry.path


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_pooling(model_dir: Path) -> tuple[tuple[str, ...], bool]:
    """(pooling modes, normalize) from the sentence-transformers modules of model_dir."""
    modules_file = model_dir / "modules.json"
    modes: tuple[str, ...] = ("mean",)
    normalize = False
    for module in _read_json(modules_file) if modules_file.is_file() else []:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in _ST_MODULES:
            raise ValueError(f"sentence-transformers module {module['type']} in {modules_file} is "
                             f"not supported; supported: {sorted(_ST_MODULES)}")
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            modes = _pooling_modes(_read_json(model_dir / module["path"] / "config.json"))
    return modes, normalize


def _pooling_modes(cfg: dict) -> tuple[str, ...]:
    if cfg.get("pooling_mode_weightedmean_tokens"):
        raise ValueError("weighted-mean pooling is not supported")
    if cfg.get("include_prompt") is False:
        raise ValueError("pooling with include_prompt=false is not supported")
    if isinstance(cfg.get("pooling_mode"), str):  # newer single-key form
        name = {"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(cfg["pooling_mode"],
                                                             cfg["pooling_mode"])
        if name not in POOLING_MODES:
            raise ValueError(f"pooling mode {cfg['pooling_mode']!r} is not supported")
        return (name,)
    modes = tuple(m for m in POOLING_MODES
                  if any(cfg.get(k) for k, v in _POOLING_FLAGS.items() if v == m))
    if not modes:
        raise ValueError("the Pooling config sets no pooling mode")
    return modes


def _config_and_weights(model_dir: Path) -> tuple[BertConfig, dict[str, torch.Tensor]]:
    cfg = BertConfig.from_hf_dict(_read_json(model_dir / "config.json"))
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found; only safetensors weights are supported")
    return cfg, load_file(str(weights))


# BertEncoder layer names <- HF BertModel's (query, key and value are fused into qkv)
_LAYER_NAMES = {"attn_out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
                "ffn_in": "intermediate.dense", "ffn_out": "output.dense",
                "ffn_norm": "output.LayerNorm"}


def _load_encoder(model: BertEmbeddingModel | BertCrossEncoder, raw: dict[str, torch.Tensor],
                  cfg: BertConfig) -> None:
    """The HF BertModel weights into model.encoder, with q/k/v fused into qkv."""
    sd = {(k[len("bert."):] if k.startswith("bert.") else k): v for k, v in raw.items()}
    names = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm")
    out = {k: sd[k] for k in [f"embeddings.{n}.weight" for n in names]
           + ["embeddings.LayerNorm.bias"]}
    for i in range(cfg.num_layers):
        src, dst = f"encoder.layer.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            out[dst + f"qkv.{p}"] = torch.cat(
                [sd[src + f"attention.self.{n}.{p}"] for n in ("query", "key", "value")])
            out.update({dst + f"{ours}.{p}": sd[src + f"{hf}.{p}"]
                        for ours, hf in _LAYER_NAMES.items()})
    model.encoder.load_state_dict(out, strict=True)


def load_embedding_model(name_or_path: str = DEFAULT_EMBEDDING_MODEL,
                         device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> LoadedEncoder:
    """Load encoder weights, tokenizer, pooling and max_seq_length from an HF directory."""
    name, model_dir = resolve_embedding_model(name_or_path)
    cfg, raw = _config_and_weights(model_dir)
    pooling, normalize = read_pooling(model_dir)
    st_cfg_file = model_dir / "sentence_bert_config.json"
    st_cfg = _read_json(st_cfg_file) if st_cfg_file.is_file() else {}
    max_seq_length = min(int(st_cfg.get("max_seq_length") or cfg.max_position_embeddings),
                         cfg.max_position_embeddings)
    model = BertEmbeddingModel(cfg, pooling=pooling, normalize=normalize)
    _load_encoder(model, raw, cfg)
    model = model.to(device=device, dtype=dtype).eval()
    model.pack_cpu_weights()  # after .to(): packs the final weights; no-op off float32 CPU

    tokenizer = EmbeddingTokenizer(model_dir / "tokenizer.json",
                                   do_lower_case=bool(st_cfg.get("do_lower_case", False)))
    return LoadedEncoder(model, tokenizer, cfg, name, max_seq_length, model_dir)


def load_cross_encoder(path: str | Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> LoadedEncoder:
    """A BERT cross-encoder (BertForSequenceClassification) from an HF directory:
    config.json, model.safetensors, tokenizer.json (vocabulary with [CLS] and [SEP])."""
    model_dir = Path(path)
    cfg, raw = _config_and_weights(model_dir)
    tokenizer = EmbeddingTokenizer(model_dir / "tokenizer.json",
                                   do_lower_case=bool(_read_json(model_dir / "tokenizer_config.json")
                                                      .get("do_lower_case", False)))
    sep_id = tokenizer.token_to_id("[SEP]")
    if tokenizer.token_to_id("[CLS]") is None or sep_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no [CLS] / [SEP] token")
    num_labels = raw["classifier.weight"].shape[0]
    model = BertCrossEncoder(cfg, sep_id, num_labels)
    _load_encoder(model, raw, cfg)
    for module, prefix in ((model.pooler, "bert.pooler.dense."), (model.classifier, "classifier.")):
        module.load_state_dict({p: raw[prefix + p] for p in ("weight", "bias")})
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedEncoder(model, tokenizer, cfg, model_dir.name, cfg.max_position_embeddings,
                         model_dir)
