"""The benchmark-only fake runner (engine/fake_runner.py): real host work, made-up ids."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bucketserve.bench.hooks import seams_from
from bucketserve.buckets import load_buckets
from bucketserve.engine.fake_runner import install
from bucketserve.engine.faults import Seams
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.models import load_model


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(loaded, tmp_path_factory) -> LLMEngine:
    path = tmp_path_factory.mktemp("fake") / "b.toml"
    path.write_text("[scheduler]\nmax_running = 8\nasync_scheduling = true\n"
                    "[kv_cache]\ncpu_memory_gib = 0.05\n")
    e = LLMEngine(loaded, load_buckets(str(path), max_model_len=loaded.max_model_len), "cpu")
    install(e, 0.0)
    return e


def test_fake_runner_runs_every_request_to_its_length_without_eos(engine) -> None:
    prompts = [[5, 6, 7] * k for k in (1, 4, 30)] + [[9]]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=False, detokenize=False)
              for m in (3, 17, 40, 1)]
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3, 17, 40, 1]
    assert all(o.finish_reason == "length" for o in outs)
    eos = engine.tokenizer.eos_token_ids
    assert not any(t in eos for o in outs for t in o.token_ids)
    # made up from the sequence's length: the same requests give the same ids
    again = engine.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    # the block manager was rebuilt for every running sequence at full length
    bm = engine.block_manager
    assert bm.num_usable_blocks >= 8 * (engine.max_model_len // bm.block_size)
    assert bm.num_used_blocks == 0


def test_fake_runner_step_time_paces_the_steps(engine) -> None:
    engine.runner.step_s = 0.02
    try:
        t0 = time.perf_counter()
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0,
                                                    detokenize=False))
        assert time.perf_counter() - t0 >= 5 * 0.02
    finally:
        engine.runner.step_s = 0.0


def test_fake_runner_is_off_unless_asked() -> None:
    # the production server gets no seams; the test launcher passes the fake runner in
    assert seams_from({}) == Seams()
    asked = seams_from({"BUCKETSERVE_FAKE_RUNNER": "0.004"}).prepare_engine
    assert asked.func is install and asked.keywords == {"step_s": 0.004}


def test_core_trace_records_the_asked_steps_then_unwraps(engine, tmp_path) -> None:
    from bucketserve.bench.hooks import _trace_spec, trace_steps

    path = tmp_path / "trace.json"
    seams = seams_from({"BUCKETSERVE_FAKE_RUNNER": "0", "BUCKETSERVE_CORE_TRACE": f"{path}:0:3"})
    calls = seams.prepare_engine.args[0]  # the fake runner, then the trace: in turn
    assert [c.func for c in calls] == [install, trace_steps]
    assert calls[1].keywords == {"path": str(path), "guided": 0, "steps": 3, "skip": 0}
    assert _trace_spec("t.json:96:30:200") == {"path": "t.json", "guided": 96, "steps": 30,
                                               "skip": 200}
    inner = engine.step_news
    trace_steps(engine, str(path), steps=3)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0, detokenize=False))
    assert engine.step_news == inner  # three steps traced, then the engine's own method again
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"schedule", "resolve", "launch"} <= names  # the engine's parts, named
    assert "_resolve" not in vars(engine) and "schedule" not in vars(engine.scheduler)
    assert (tmp_path / "trace.json.txt").read_text().startswith("3 steps")
    # a grammar count no running sequence reaches: nothing is traced
    other = tmp_path / "none.json"
    trace_steps(engine, str(other), guided=1, steps=2)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))
    assert not other.exists()
    engine.step_news = inner
    # skipped steps: a request of 3 tokens (at most 5 steps) is inside the 10 skipped, the
    # next one of 20 reaches the 2 traced
    skipped = tmp_path / "skipped.json"
    trace_steps(engine, str(skipped), steps=2, skip=10)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, detokenize=False))
    assert not skipped.exists()
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=20, temperature=0.0, detokenize=False))
    assert skipped.exists() and engine.step_news == inner
    for bad in (":1", "f:-1", "f:0:0", "f:x", "f:0:1:-1", "f:0:1:0:9"):
        with pytest.raises(ValueError, match="BUCKETSERVE_CORE_TRACE"):
            _trace_spec(bad)
