"""A live `bucketserve serve --request-log`: `bucketserve bench --trace` replays a trace against
it, the log holds one line per request (no text) whose arrival pattern matches the trace's,
and `tune-buckets` turns the log into a TOML that passes the checker."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bucketserve.bench.launch import start_server
from bucketserve.bench.replay import ks_critical, ks_statistic
from bucketserve.bench.workload import generate, save_trace
from bucketserve.buckets import load_buckets

N = 16


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench_live")
    log = work / "requests.jsonl"
    server = start_server(work, "bench", "[scheduler]\nmax_running = 16\n",
                          "--request-log", str(log))
    yield server, log, work
    server.stop()


def test_replay_against_live_server_logs_the_arrival_pattern(logged_server):
    server, log, work = logged_server
    trace = work / "trace.jsonl"
    reqs = generate(N, "uniform:8:40", "4", seed=11, rate=4.0)
    save_trace(reqs, str(trace))
    out = work / "replay.json"
    done = subprocess.run([sys.executable, "-m", "bucketserve.bench", "bench", "--base-url",
                           server.base_url, "--trace", str(trace), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == N and report["total_output_tokens"] == 4 * N
    assert report["server"]["scraped"] is True and report["server"]["engine_steps"] > 0
    # the header says what ran (the server's bucketserve_engine_info)
    engine = report["engine"]
    assert {k: engine[k] for k in ("device", "dtype", "quantization", "kv_cache_dtype")} == {
        "device": "cpu", "dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto"}
    assert engine["model"] == report["model"] == report["server"]["engine"]["model"]
    assert (f"engine: model {engine['model']}, device cpu, dtype float32, quantization none, "
            "kv_cache_dtype auto") in done.stdout
    # every token went out in an SSE event, one event per step (the server's own count)
    assert report["server"]["sse_tokens"] == 4 * N
    assert N <= report["server"]["sse_token_events"] <= 4 * N
    assert report["server"]["engine_step_ms_p50"] > 0

    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == N
    assert sorted(x["prompt_tokens"] for x in lines) == sorted(r.prompt_tokens for r in reqs)
    for x in lines:
        assert "text" not in x and "prompt" not in x
        assert x["endpoint"] == "completions" and x["output_tokens"] == 4
        assert x["finish_reason"] == "length" and x["bucket"] in (16, 32, 64)
        assert 0 <= x["queue_s"] <= x["ttft_s"] <= x["e2e_s"]
    logged = np.diff(sorted(x["arrival"] for x in lines))
    planned = np.diff([r.arrival for r in reqs])
    assert ks_statistic(logged.tolist(), planned.tolist()) <= ks_critical(len(logged),
                                                                          len(planned))
    # the whole span is reproduced to within a fraction of a mean gap per request
    assert abs(logged.sum() - planned.sum()) < 0.5 + 0.05 * planned.sum()

    # chat requests are streamed, counted and logged as "chat"
    done = subprocess.run([sys.executable, "-m", "bucketserve.bench", "bench", "--base-url",
                           server.base_url, "--endpoint", "chat", "--num-requests", "3",
                           "--prompt-len", "6", "--output-len", "3", "--concurrency", "3",
                           "--out", str(work / "chat.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    chat = json.loads((work / "chat.json").read_text())
    assert chat["completed"] == 3 and chat["total_output_tokens"] == 9
    assert chat["token_events"] >= 3 and chat["ttft_ms"]["p50"] > 0
    chat_lines = [json.loads(x) for x in log.read_text().splitlines()][N:]
    assert [x["endpoint"] for x in chat_lines] == ["chat"] * 3
    assert all(x["output_tokens"] == 3 for x in chat_lines)

    tuned = work / "tuned.toml"
    done = subprocess.run([sys.executable, "-m", "bucketserve.bench", "tune-buckets", str(log),
                           "--out", str(tuned)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cfg = load_buckets(str(tuned))
    assert cfg.prefill_boundaries[-1] >= max(r.prompt_tokens for r in reqs)
    assert "expected padding" in tuned.read_text()
