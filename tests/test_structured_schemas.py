"""Issue 18 must-show 1 (schemas): JSON schemas of varied shape on the default model, greedy,
max_tokens 200, batched through the in-process engine: every output validates with jsonschema
and finishes "stop". The full 50 (tests/data/json_schemas.json) take ~130 s on the 2-core dev
CPU, so they run in bench/structured_schemas.py; here every 5th schema (10), under overlapped
scheduling (the harder path: each guided step resolves the previous one first), on each
structured-output backend."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.models import load_model

_path = Path(__file__).resolve().parent.parent / "bench" / "structured_schemas.py"
_spec = importlib.util.spec_from_file_location("structured_schemas", _path)
schemas_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(schemas_bench)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_sampled_schemas_all_validate_and_stop(backend):
    loaded = load_model("smollm2-135m-instruct", device="cpu")
    buckets = dataclasses.replace(load_buckets(None, max_model_len=loaded.max_model_len),
                                  structured_backend=backend)
    engine = LLMEngine(loaded, buckets, "cpu", async_scheduling=True)
    schemas = schemas_bench.load_schemas(every=5)
    assert len(schemas) == 10
    results = schemas_bench.run(engine, schemas, max_tokens=200)
    assert schemas_bench.failures(results) == []
