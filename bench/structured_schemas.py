"""Issue 18 must-show 1, second half: the 50 JSON schemas of tests/data/json_schemas.json
(nested objects, arrays, enums, required fields, string patterns, bounded numbers) on the
default model with max_tokens 200, all in one batch through the in-process engine (CPU).
Prints how many outputs validate with jsonschema and finish with "stop", and the time.

Run: PYTHONPATH=$PWD python bench/structured_schemas.py [--every K] [--async-scheduling]
(--every 5: the 10-schema sample tests/test_structured_schemas.py runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jsonschema

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import GuidedDecoding, SamplingParams
from bucketserve.models import load_model

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json"


def load_schemas(every: int = 1) -> list[dict]:
    return json.loads(SCHEMAS.read_text())[::every]


def run(engine: LLMEngine, schemas: list[dict], max_tokens: int = 200) -> list[tuple[dict, str, str]]:
    """(schema, text, finish_reason) per schema: one greedy request each, all at once."""
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content":
               f"Write a JSON value for this schema: {json.dumps(s)}"}]), add_special_tokens=False)
               for s in schemas]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             guided=GuidedDecoding("json", json.dumps(s))) for s in schemas]
    outs = engine.generate(prompts, params)
    return [(s, o.text, o.finish_reason) for s, o in zip(schemas, outs, strict=True)]


def failures(results: list[tuple[dict, str, str]]) -> list[str]:
    bad = []
    for i, (schema, text, finish) in enumerate(results):
        if finish != "stop":
            bad.append(f"#{i}: finish {finish}: {text[:120]!r}")
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append(f"#{i}: {type(exc).__name__}: {str(exc)[:120]} in {text[:120]!r}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--backend", default="xgrammar", help="[structured] backend")
    args = ap.parse_args()
    loaded = load_model("smollm2-135m-instruct", device="cpu")
    buckets = dataclasses.replace(load_buckets(None, max_model_len=loaded.max_model_len),
                                  structured_backend=args.backend)
    engine = LLMEngine(loaded, buckets, "cpu", async_scheduling=args.async_scheduling)
    schemas = load_schemas(args.every)
    t0 = time.perf_counter()
    results = run(engine, schemas)
    took = time.perf_counter() - t0
    bad = failures(results)
    tokens = sum(len(engine.tokenizer.encode(t, add_special_tokens=False)) for _, t, _ in results)
    print(f"{len(schemas) - len(bad)}/{len(schemas)} valid and finished 'stop'; {took:.1f} s, "
          f"~{tokens} output tokens")
    for line in bad:
        print(line)


if __name__ == "__main__":
    main()
