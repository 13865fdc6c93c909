"""Grammar-constrained decoding on CUDA (engine/structured.py): the token bitmask applied on the
device between the CUDA-graph forward and sampling, with overlapped scheduling, on a random
SmolLM2-135M-shaped model with SmolLM2's byte-level tokenizer (random weights: the grammar
alone must make every output valid and terminate it).

The tokenizer comes from the default model's package where it is installed, else from
$SMOLLM2_TOKENIZER_DIR (a directory with tokenizer.json, as the GPU machine is given it)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
PICK = {"type": "object", "properties": {"c": {"enum": ["x", "y"]}, "n": {"type": "boolean"}},
        "required": ["c", "n"]}


def smollm2_tokenizer():
    from bucketserve.models.tokenizer import Tokenizer

    path = os.environ.get("SMOLLM2_TOKENIZER_DIR")
    if path:
        return Tokenizer.from_hf_dir(path)
    try:
        from bucketserve.models.gguf_loader import read_gguf
        from bucketserve.models.registry import resolve

        return read_gguf(resolve("smollm2-135m-instruct").path).tokenizer
    except (ImportError, FileNotFoundError, ValueError) as exc:
        pytest.skip(f"no SmolLM2 tokenizer here ({exc}); set SMOLLM2_TOKENIZER_DIR")


@pytest.mark.parametrize("overlapped", [False, True, "fill", "early", "ahead"],
                         ids=["sync", "overlapped", "fill", "early_fill", "schedule_ahead"])
def test_guided_outputs_on_cuda_graphs(overlapped):
    """Every kind of guide, sampled greedily and not, beside plain rows, with each way of
    overlapping the grammar's host work (LLMEngine.overlap_fill, early_fill, schedule_ahead)."""
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.llm_engine import LLMEngine
    from bucketserve.engine.sequence import GuidedDecoding, SamplingParams
    from bucketserve.models.config import ModelConfig
    from bucketserve.models.loader import LoadedModel, build_dummy_model

    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_ids=(2,))
    tok = smollm2_tokenizer()
    model = build_dummy_model(cfg, "cuda", torch.bfloat16, seed=0)
    loaded = LoadedModel(model, tok, cfg, "smollm2-shape-random", 8192)
    engine = LLMEngine(loaded, load_buckets(None, max_model_len=8192), "cuda", num_blocks=2048,
                       async_scheduling=bool(overlapped))
    engine.overlap_fill = overlapped in ("fill", "early", "ahead")
    engine.early_fill = overlapped == "early"
    engine.schedule_ahead = overlapped == "ahead"
    prompt = tok.encode("Describe a person as JSON:")
    # every kind bounded (json_object alone is not: a random model writes strings forever)
    guided = [GuidedDecoding("json", json.dumps(PERSON)), GuidedDecoding("json", json.dumps(PICK)),
              GuidedDecoding("choice", json.dumps(["red", "green", "blue"])),
              GuidedDecoding("regex", r"[0-9]{3}-[a-z]{2}")]
    params = [SamplingParams(max_tokens=120, temperature=t, seed=i, guided=g)
              for i, (g, t) in enumerate([(g, t) for g in guided for t in (0.0, 1.0)])]
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(6)]
    outs = engine.generate([prompt] * (len(params) + len(free)), params + free)
    texts = [o.text for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    jsonschema.validate(json.loads(texts[1]), PERSON)
    jsonschema.validate(json.loads(texts[2]), PICK)
    jsonschema.validate(json.loads(texts[3]), PICK)
    assert {texts[4], texts[5]} <= {"red", "green", "blue"}
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in texts[6:8]), texts[6:8]
    assert all(o.finish_reason == "stop" for o in outs[:8])
    assert all(len(o.token_ids) == 24 for o in outs[8:])  # unconstrained batch mates
    assert engine.runner.num_graph_steps > 0  # decode steps ran as CUDA graphs
