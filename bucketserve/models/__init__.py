"""Decoder models (Llama family), tokenizer, loaders and the model registry."""

from bucketserve.models.config import ModelConfig, UnsupportedModelError
from bucketserve.models.llama import LlamaForCausalLM
from bucketserve.models.loader import (
    LoadedModel,
    build_dummy_model,
    load_model,
    resolve_dtype,
)
from bucketserve.models.registry import DEFAULT_MODEL, ModelEntry, known_models, resolve
from bucketserve.models.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "ChatTemplateError",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelEntry",
    "Tokenizer",
    "UnsupportedModelError",
    "build_dummy_model",
    "known_models",
    "load_model",
    "resolve",
    "resolve_dtype",
]
