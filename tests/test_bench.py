"""`bucketserve bench` and `tune-buckets` on CPU: stats math, tuner, trace parsing, request log,
the SSE client against the stub server (in-process and through the CLI)."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from bucketserve.bench import runner, stats, tuner
from bucketserve.bench.replay import ks_critical, ks_statistic
from bucketserve.bench.stub_server import StubConnection, StubServer
from bucketserve.bench.workload import (
    BenchRequest,
    WorkloadError,
    generate,
    load_jsonl,
    parse_dist,
    save_trace,
)
from bucketserve.buckets import load_buckets
from bucketserve.buckets.__main__ import main as buckets_check
from bucketserve.engine.outputs import RequestOutput
from bucketserve.server.request_log import RequestLog


# ------------------------------------------------------------------------------ stats
def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        for p in (0, 50, 90, 99, 100):
            assert stats.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert stats.percentile([], 50) is None


def _res(kind="completion", ttft=0.1, itl=(0.01,), tokens=None, error=None, start=0.0):
    e2e = None if error else ttft + sum(itl)
    n = tokens if tokens is not None else len(itl) + 1
    return {"i": 0, "kind": kind, "prompt_tokens": 10, "max_tokens": n, "start": start,
            "ttft": None if error else ttft, "e2e": e2e, "itl": list(itl), "chunks": len(itl) + 1,
            "usage_completion_tokens": n, "usage_prompt_tokens": 10, "error": error,
            "inputs": 1}


def test_summary_throughput_tpot_and_goodput():
    results = [
        _res(ttft=0.1, itl=[0.02] * 9),   # TPOT 20 ms, TTFT 100 ms: meets both SLOs
        _res(ttft=0.5, itl=[0.02] * 9),   # TTFT over 200 ms
        _res(ttft=0.1, itl=[0.06] * 9),   # TPOT 60 ms, over 50 ms
        _res(error="HTTP 503: busy"),
    ]
    s = stats.summarize(results, 2.0, stats.SLO(ttft_ms=200, tpot_ms=50))
    assert s["completed"] == 3 and s["errors"] == 1
    assert s["output_throughput"] == pytest.approx(30 / 2.0)
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * (0.1 + 0.5 + 0.1) / 3)
    assert s["itl_ms"]["p99"] == pytest.approx(60.0)
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 2.0)
    assert s["goodput_output_tokens_per_s"] == pytest.approx(10 / 2.0)
    assert s["slo_attainment"] == pytest.approx(1 / 4)
    no_slo = stats.summarize(results, 2.0)
    assert "goodput_requests_per_s" not in no_slo


def test_tpot_uses_usage_tokens_over_chunks():
    r = _res(ttft=0.1, itl=[0.1], tokens=11)  # 2 events but 11 tokens (server batched them)
    assert stats.tpot_s(r) == pytest.approx(0.1 / 10)


# ------------------------------------------------------------------------------ tuner
def _brute(values, k, align):
    cands = sorted({-(-v // align) * align for v in values})
    top = cands[-1]
    return min(tuner.padding_cost(values, None, [*c, top])
               for r in range(k) for c in itertools.combinations(cands[:-1], r))


def test_optimal_shapes_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        values = rng.integers(1, 50, size=int(rng.integers(1, 14))).tolist()
        k = int(rng.integers(1, 5))
        align = int(rng.choice([1, 4, 8]))
        shapes, cost = tuner.optimal_shapes(values, None, k, align)
        assert len(shapes) <= k
        assert shapes == sorted(set(shapes)) and shapes[-1] >= max(values)
        assert all(s % align == 0 for s in shapes)
        assert cost == pytest.approx(tuner.padding_cost(values, None, shapes))
        assert cost == pytest.approx(_brute(values, k, align))


def test_shape_curve_never_gets_worse_with_more_shapes():
    values = np.random.default_rng(3).integers(1, 300, size=200)
    costs = [c for _, c in tuner.shape_curve(values, None, 12, 1)]
    assert all(b <= a + 1e-9 for a, b in zip(costs, costs[1:], strict=False))
    assert costs[-1] < costs[0]


def test_weighted_shapes_follow_the_weights():
    # sizes 1 and 10 with size 9 rare: two shapes go to 1 and 10 unless 9 is heavy
    assert tuner.optimal_shapes([1, 9, 10], [100, 1, 100], 2)[0] == [1, 10]
    assert tuner.optimal_shapes([1, 9, 10], [1, 100, 1], 2)[0] == [9, 10]


def test_decode_concurrency_is_time_weighted():
    sizes, weights = tuner.decode_concurrency([(0.0, 2.0), (1.0, 4.0)], cap=256)
    assert dict(zip(sizes, weights, strict=True)) == pytest.approx({1: 3.0, 2: 1.0})
    sizes, _ = tuner.decode_concurrency([(0.0, 1.0)] * 5, cap=4)
    assert sizes == [4]


def _skewed_trace(path, n=300, seed=0):
    reqs = generate(n, "mix:0.7*normal:40:6:16:64+0.3*normal:700:50:560:840", "16", seed,
                    embedding_fraction=0.4, embedding_len="mix:0.6*normal:12:3:4:24+"
                    "0.4*normal:180:15:140:220", embedding_inputs="uniform:1:8", rate=20.0)
    save_trace(reqs, str(path))
    return reqs


def test_tune_buckets_beats_default_padding_and_passes_checker(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    reqs = _skewed_trace(trace)
    # decode timings as a request log would carry them
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    for d in lines:
        if d["endpoint"] != "embeddings":
            d["ttft_s"], d["e2e_s"] = 0.2, 2.0
    trace.write_text("".join(json.dumps(d) + "\n" for d in lines))
    limits = tuner.TuneLimits()
    text = tuner.tune_file(str(trace), limits)
    out = tmp_path / "tuned.toml"
    out.write_text(text)
    assert buckets_check(["check", str(out), "--embedding-max-len",
                          str(limits.embedding_max_len), "--max-model-len",
                          str(limits.max_model_len)]) == 0
    capsys.readouterr()
    tuned, default = load_buckets(str(out)), load_buckets()
    assert len(tuned.prefill_boundaries) <= limits.max_graphs
    assert len(tuned.embedding.boundaries) <= min(limits.max_graphs,
                                                  len(default.embedding.boundaries))
    assert tuned.embedding.boundaries[-1] == limits.embedding_max_len
    plens = [r.prompt_tokens for r in reqs if r.kind != "embedding"]
    elens = [n for r in reqs if r.kind == "embedding" for n in r.input_lengths]
    for values, t, d in ((plens, tuned.prefill_boundaries, default.prefill_boundaries),
                         (elens, tuned.embedding.boundaries, default.embedding.boundaries)):
        assert tuner.describe(values, None, list(t)).waste < tuner.describe(values, None,
                                                                             list(d)).waste
        # as many shapes as the default, on the default's 8-token grid: never more padding
        same, _ = tuner.optimal_shapes(values, None, len(d), align=8)
        assert tuner.padding_cost(values, None, same) <= tuner.padding_cost(values, None, list(d))
    assert "expected padding" in text and "% of traffic" in text


def test_memory_budget_limits_the_shapes(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _skewed_trace(trace)
    # 4 shapes of 32 MiB in all: prefill and embedding (one forced 512) share them
    text = tuner.tune_file(str(trace), tuner.TuneLimits(memory_gib=4 * 32 / 1024))
    (tmp_path / "t.toml").write_text(text)
    cfg = load_buckets(str(tmp_path / "t.toml"))
    assert len(cfg.prefill_boundaries) + len(cfg.embedding.boundaries) <= 4


# ------------------------------------------------------------------------------ traces
def test_parse_dist_forms():
    rng = np.random.default_rng(0)
    assert set(parse_dist("7")(rng, 5)) == {7}
    u = parse_dist("uniform:3:5")(rng, 500)
    assert u.min() == 3 and u.max() == 5
    lu = parse_dist("loguniform:16:1024")(rng, 500)
    assert lu.min() >= 16 and lu.max() <= 1024
    m = parse_dist("mix:0.5*normal:40:1:30:50+0.5*normal:700:1:690:710")(rng, 400)
    assert set(np.unique((m > 100).astype(int))) == {0, 1} and np.all((m <= 50) | (m >= 690))
    with pytest.raises(WorkloadError):
        parse_dist("gamma:1:2")


def test_load_request_log_workload_and_generic_lines(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in [
        {"arrival": 1000.5, "endpoint": "completions", "prompt_tokens": 12, "output_tokens": 5,
         "ttft_s": 0.1, "e2e_s": 0.4, "finish_reason": "length"},
        {"arrival": 1000.0, "endpoint": "embeddings", "input_tokens": [3, 9]},
        {"arrival": 1001.25, "endpoint": "chat", "prompt_tokens": 4, "output_tokens": 2},
        {"arrival": 1002.0, "endpoint": "completions", "prompt_tokens": 4, "output_tokens": 0,
         "finish_reason": "abort"},
    ]) + "\n\n")
    reqs = load_jsonl(str(p))
    assert [r.kind for r in reqs] == ["embedding", "completion", "chat"]  # sorted, abort dropped
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.25]
    assert reqs[0].input_lengths == [3, 9] and [len(x) for x in reqs[0].inputs] == [3, 9]
    assert len(reqs[1].prompt) == 12 and reqs[1].max_tokens == 5
    # a workload line keeps its text; no arrival -> None
    w = tmp_path / "w.jsonl"
    w.write_text(json.dumps({"id": 0, "prompt": "Hello there", "prompt_tokens": 2,
                             "max_tokens": 3}) + "\n")
    (r,) = load_jsonl(str(w))
    assert r.prompt == "Hello there" and r.arrival is None
    # generic offsets
    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps({"offset_s": 2.0, "prompt_len": 8, "output_len": 4}) + "\n"
                 + json.dumps({"offset_s": 3.5, "input_len": 9, "max_tokens": 1}) + "\n")
    assert [x.arrival for x in load_jsonl(str(g))] == [0.0, 1.5]


def test_trace_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"arrival": 1, "prompt_tokens": 3, "output_tokens": 2}) + "\n"
                 + json.dumps({"arrival": 2, "endpoint": "completions"}) + "\n")
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2:"):
        load_jsonl(str(p))
    p.write_text("{not json\n")
    with pytest.raises(WorkloadError, match=r":1:"):
        load_jsonl(str(p))


def test_save_trace_round_trips(tmp_path):
    reqs = generate(30, "uniform:5:50", "uniform:1:9", seed=4, embedding_fraction=0.3, rate=5.0)
    save_trace(reqs, str(tmp_path / "t.jsonl"))
    back = load_jsonl(str(tmp_path / "t.jsonl"))
    assert [(r.kind, r.prompt_tokens, r.max_tokens, r.input_lengths) for r in back] == \
        [(r.kind, r.prompt_tokens, r.max_tokens, r.input_lengths) for r in reqs]
    assert [r.arrival for r in back] == pytest.approx([r.arrival for r in reqs])


# ------------------------------------------------------------------------------ request log
def _final_output(request_id="cmpl-abc-0"):
    return RequestOutput(request_id=request_id, new_token_ids=[5], new_text="lo",
                         text="secret hello", token_ids=[4, 5], finished=True,
                         finish_reason="length", num_prompt_tokens=7, num_output_tokens=2,
                         metrics={"arrival": 100.0, "first_scheduled": 100.25,
                                  "first_token": 100.5, "finished": 101.0, "bucket": 16})


def test_request_log_lines_have_no_text_unless_asked(tmp_path):
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path))
    log.record_generation(_final_output())
    log.record_generation(_final_output("chatcmpl-x-1"))
    log.record_embeddings(time.monotonic(), [3, 12], [8, 16])
    log.close()
    raw = path.read_text()
    assert "secret" not in raw and "hello" not in raw
    a, b, c = [json.loads(line) for line in raw.splitlines()]
    assert a["endpoint"] == "completions" and b["endpoint"] == "chat"
    assert (a["prompt_tokens"], a["output_tokens"], a["bucket"]) == (7, 2, 16)
    assert (a["queue_s"], a["ttft_s"], a["e2e_s"]) == (0.25, 0.5, 1.0)
    assert a["finish_reason"] == "length"
    assert abs(a["arrival"] - (time.time() - (time.monotonic() - 100.0))) < 5
    assert c["endpoint"] == "embeddings" and c["input_tokens"] == [3, 12]
    assert c["buckets"] == [8, 16] and c["e2e_s"] >= 0
    # the log is a replayable trace
    assert [r.kind for r in load_jsonl(str(path))] in (
        ["completion", "chat", "embedding"], ["embedding", "completion", "chat"])

    log = RequestLog(str(path), text=True)  # appends
    log.record_generation(_final_output())
    log.close()
    assert json.loads(path.read_text().splitlines()[-1])["text"] == "secret hello"


# ------------------------------------------------------------------------------ SSE client
def _feed(handler, pieces, t=1.0):
    handler.head(200, t)
    for k, piece in enumerate(pieces):
        handler.body(piece)
        handler.flush(t + 0.1 * (k + 1))
    handler.end(t + 0.1 * (len(pieces) + 1))


@pytest.mark.parametrize("sep", ["\n\n", "\r\n\r\n"])
@pytest.mark.parametrize("space", ["", " "])
def test_stream_handler_counts_token_events(sep, space):
    def ev(text, finish):
        fr = "null" if finish is None else f'"{finish}"'
        return (f'data:{space}{{"choices":{space}[{{"index":0,"text":{space}"{text}",'
                f'"finish_reason":{space}{fr}}}]}}{sep}')
    usage = (f'data: {{"choices":{space}[],"usage":{space}{{"prompt_tokens":{space}7,'
             f'"completion_tokens":{space}3}}}}{sep}')
    body = (ev("a", None) + ev("", None) + ": ping" + sep + ev("c", "length")
            + ev("", "length") + usage + "data: [DONE]" + sep).encode()
    res = runner.new_result(0, BenchRequest("completion", 7, 3))
    h = runner.StreamHandler(res, chat=False, start=0.5)
    # split at every byte boundary position class: one piece per 7 bytes
    _feed(h, [body[i:i + 7] for i in range(0, len(body), 7)])
    assert res["error"] is None and res["chunks"] == 3  # empty text counted, closing chunk not
    assert res["usage_completion_tokens"] == 3 and res["usage_prompt_tokens"] == 7
    assert res["finish"] == "length"
    assert res["ttft"] > 0 and len(res["itl"]) == 2 and res["e2e"] >= res["ttft"]


def test_stream_handler_chat_counts_content_and_reports_http_errors():
    body = (b'data: {"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
            b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
            b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    res = runner.new_result(0, BenchRequest("chat", 3, 4))
    _feed(runner.StreamHandler(res, chat=True, start=0.0), [body])
    assert res["chunks"] == 1 and res["finish"] == "stop" and res["error"] is None
    res = runner.new_result(0, BenchRequest("completion", 3, 4))
    h = runner.StreamHandler(res, chat=False, start=0.0)
    h.head(503, 1.0)
    h.body(b'{"error":{"message":"busy"}}')
    h.end(1.1)
    assert res["error"].startswith("HTTP 503") and "busy" in res["error"]


async def _with_stub(fn):
    server = StubServer()
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: StubConnection(server), "127.0.0.1", 0)
    stepper = asyncio.create_task(server.step_loop())
    try:
        return await fn(srv.sockets[0].getsockname()[1])
    finally:
        stepper.cancel()
        srv.close()


def test_client_against_stub_closed_loop_counts_every_token():
    reqs = generate(40, "uniform:4:30", "uniform:1:40", seed=2, embedding_fraction=0.2)
    reqs += generate(5, "8", "6", seed=3, kind="chat")

    async def go(port):
        cfg = runner.RunConfig("127.0.0.1", port, "stub", concurrency=8)
        return await runner.run(cfg, reqs)

    results, _, duration, cpu_s = asyncio.run(_with_stub(go))
    assert 0 < cpu_s
    assert duration > 0 and all(r["error"] is None for r in results)
    for r, req in zip(results, reqs, strict=True):
        if req.kind == "embedding":
            assert r["e2e"] is not None
        else:
            assert r["chunks"] == req.max_tokens == r["usage_completion_tokens"]
            assert len(r["itl"]) == req.max_tokens - 1
    s = stats.summarize(results, duration)
    assert s["total_output_tokens"] == sum(r.max_tokens for r in reqs if r.kind != "embedding")


def test_open_loop_sends_at_the_trace_times():
    reqs = generate(40, "8", "2", seed=5, rate=50.0)  # mean gap 20 ms

    async def go(port):
        cfg = runner.RunConfig("127.0.0.1", port, "stub", open_loop=True, speed=2.0)
        return await runner.run(cfg, reqs)

    results, _, _, _ = asyncio.run(_with_stub(go))
    sent = np.diff([r["start"] for r in results])
    planned = np.diff([r.arrival / 2.0 for r in reqs])
    # each send within a few timer ticks of its plan; the gap distributions agree
    assert np.max(np.abs(sent - planned)) < 0.05
    assert ks_statistic(sent.tolist(), planned.tolist()) <= ks_critical(len(sent), len(planned))


def test_ks_statistic():
    assert ks_statistic([1, 2, 3], [1, 2, 3]) == 0.0
    assert ks_statistic([1, 2, 3], [10, 11, 12]) == 1.0
    assert ks_statistic([1, 2, 3, 4], [3, 4, 5, 6]) == pytest.approx(0.5)


def test_bench_cli_against_stub_server(tmp_path):
    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    stub = subprocess.Popen([sys.executable, "-m", "bucketserve.bench.stub_server", "--port",
                             str(number)], stdout=subprocess.PIPE)
    try:
        assert stub.stdout.readline().startswith(b"stub server")
        out = tmp_path / "r.json"
        cmd = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url",
               f"http://127.0.0.1:{number}", "--num-requests", "60", "--output-len", "20",
               "--prompt-len", "uniform:5:50", "--concurrency", "16", "--workers", "2",
               "--slo-ttft-ms", "10000", "--out", str(out), "--plot", str(tmp_path / "fig")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "output tok/s" in done.stdout
        r = json.loads(out.read_text())
        assert r["completed"] == 60 and r["total_output_tokens"] == 60 * 20
        assert r["goodput_requests_per_s"] == pytest.approx(r["request_throughput"])
        assert r["machine"]["cpu_count"] and r["server"]["scraped"] is False
        assert r["client_cpu_s"] > 0 and r["client_cpu_us_per_token_event"] > 0
        # not a bucketserve server: the header says so instead of guessing
        assert r["engine"] is None and "engine: not reported" in done.stdout
        assert r["tokens_per_token_event"] == r["total_output_tokens"] / r["token_events"]
        figs = sorted(p.name for p in (tmp_path / "fig").iterdir())
        assert figs == ["latency_cdf.png", "padding_per_bucket.png", "throughput.png"]
    finally:
        stub.terminate()
        stub.wait(10)


def test_embeddings_route_writes_the_request_log(tmp_path):
    from types import SimpleNamespace

    import httpx
    from fastapi import FastAPI

    from bucketserve.models.bert_loader import load_embedding_model
    from bucketserve.server.embeddings import EmbeddingService
    from bucketserve.server.errors import install_exception_handlers

    service = EmbeddingService(load_embedding_model("all-minilm-l6-v2"), load_buckets())
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(service.router)
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path))
    app.state.ctx = SimpleNamespace(inflight=SimpleNamespace(draining=False),
                                    metrics=SimpleNamespace(request_log=log))

    async def go():
        await service.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                ok = await client.post("/v1/embeddings", json={"input": [[101, 7592, 102],
                                                                          list(range(1000, 1020))]})
                bad = await client.post("/v1/embeddings", json={"input": []})
                return ok.status_code, bad.status_code
        finally:
            await service.shutdown(10.0)

    assert asyncio.run(go()) == (200, 400)
    log.close()
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]  # the 400 is not logged
    assert line["endpoint"] == "embeddings" and line["input_tokens"] == [3, 20]
    assert line["buckets"] == [service.batcher.spec.lookup(3), service.batcher.spec.lookup(20)]
    assert line["e2e_s"] > 0 and "input" not in line


def test_bucketserve_cli_has_bench_tune_and_request_log_flags():
    from bucketserve.server.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "--trace", "t.jsonl", "--speed", "2", "--workers", "3"])
    assert (args.command, args.trace, args.speed, args.workers) == ("bench", "t.jsonl", 2.0, 3)
    args = parser.parse_args(["tune-buckets", "log.jsonl", "--max-graphs", "4"])
    assert (args.command, args.trace, args.max_graphs) == ("tune-buckets", "log.jsonl", 4)
    args = parser.parse_args(["serve", "--request-log", "r.jsonl"])
    assert args.request_log == "r.jsonl" and args.request_log_text is False


def test_non_streaming_requests_take_usage_from_the_body():
    reqs = generate(6, "8", "uniform:2:9", seed=8)

    async def go(port):
        cfg = runner.RunConfig("127.0.0.1", port, "stub", stream=False, concurrency=3)
        return await runner.run(cfg, reqs)

    results, _, duration, _ = asyncio.run(_with_stub(go))
    assert [r["usage_completion_tokens"] for r in results] == [r.max_tokens for r in reqs]
    assert all(r["finish"] == "length" and r["ttft"] == r["e2e"] > 0 for r in results)
    assert stats.summarize(results, duration)["total_output_tokens"] == sum(
        r.max_tokens for r in reqs)


def test_tuned_batch_sizes_keep_headroom_above_a_light_trace(tmp_path):
    # a trace recorded at a light load: at most 3 requests decoding at once
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(60):
        lines.append({"arrival": i * 1.0, "endpoint": "completions", "prompt_tokens": 40,
                      "ttft_s": 0.1, "e2e_s": 2.5 + (i % 3) * 0.2})
        lines.append({"arrival": i * 1.0 + 0.5, "endpoint": "embeddings",
                      "input_lengths": [12, 14]})
    trace.write_text("".join(json.dumps(d) + "\n" for d in lines))
    limits = tuner.TuneLimits(max_running=256)
    traffic = tuner.read_traffic(str(trace), limits.max_running)
    assert max(traffic.decode_sizes) == 3
    tuned = tuner.tune(traffic, limits, delay_s=0.005, preferred=32, max_batch_tokens=8192)
    # the trace's own sizes, then a doubling ladder to the limit: no size up to
    # max_running pads by more than half
    assert tuned.decode.shapes[-1] == 256 and {1, 2, 3} <= set(tuned.decode.shapes)
    above = [s for s in tuned.decode.shapes if s > 3]
    assert above[0] == 6 and all(b <= 2 * a for a, b in zip(above, above[1:], strict=False))
    assert tuned.embedding_batch.shapes[-1] == 32
    assert tuned.decode.per_shape[-1]["min"] is None  # headroom: no traffic in the trace
    # --no-headroom: the trace only
    bare = tuner.tune(traffic, tuner.TuneLimits(max_running=256, headroom=False), delay_s=0.005,
                      preferred=32, max_batch_tokens=8192)
    assert bare.decode.shapes[-1] == 3
    assert tuner.headroom_ladder(3, 256) == [6, 12, 24, 48, 96, 192, 256]
    assert tuner.headroom_ladder(256, 256) == [] and tuner.headroom_ladder(200, 256) == [256]
    text = tuner.render_toml(tuned, load_buckets(), str(trace), limits)
    assert "no traffic in the trace (kept: headroom or the upper limit)" in text


def test_tune_file_takes_the_decode_headroom_limit_from_the_base_file_per_device(tmp_path):
    # without --max-running the headroom ladder ends at the base file's running limit on the
    # device the file is for: the shipped "auto" is 256 on cpu and 1024 on cuda
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival": i * 1.0, "endpoint": "completions",
                                         "prompt_tokens": 40, "ttft_s": 0.1, "e2e_s": 2.5})
                             + "\n" for i in range(40)))

    def decode_sizes(text: str) -> list[int]:
        cfg = tmp_path / "tuned.toml"
        cfg.write_text(text)
        return list(load_buckets(str(cfg)).decode_batch_sizes)

    cpu = decode_sizes(tuner.tune_file(str(trace), tuner.TuneLimits(device="cpu")))
    gpu = decode_sizes(tuner.tune_file(str(trace), tuner.TuneLimits(device="cuda")))
    assert cpu[-1] == 256 and gpu[-1] == 1024
    base = tmp_path / "base.toml"
    base.write_text("[scheduler]\nmax_running = 64\n")
    own = decode_sizes(tuner.tune_file(str(trace), tuner.TuneLimits(device="cuda"), base=str(base)))
    assert own[-1] == 64
    given = decode_sizes(tuner.tune_file(str(trace), tuner.TuneLimits(device="cuda", max_running=96)))
    assert given[-1] == 96


def test_slo_sweep_merge_judges_every_rate_of_every_part(tmp_path):
    # bench/embedding_slo_sweep.py --merge: sweeps of different rates (e.g. 2,000 texts/s in
    # its own command with more rounds) merge into one verdict over all their rates
    from bench import embedding_slo_sweep as sweep

    def run(setting: str, rate: float, thr: float, p99: float) -> dict:
        return {"setting": setting, "rate": rate, "requests": 10, "throughput_inputs_s": thr,
                "goodput_inputs_s": thr, "p50_ms": p99 / 2, "p99_ms": p99, "p99_all_ms": p99,
                "within_slo": 1.0, "slo_met": p99 <= 50.0, "slo_ms": 50.0,
                "server": {"batches": 1}}

    parts = []
    for rate, fb_thr in ((2000.0, 2010.0), (10.0, 9.0)):
        part = {"machine": {"device": "cpu", "cpu_model": "x"}, "slo_ms": 50.0, "rates": [rate],
                "settings": ["feedback", "fixed=0"],
                "runs": [run("feedback", rate, fb_thr, 20.0), run("fixed=0", rate, rate, 30.0)]}
        path = tmp_path / f"part{rate:g}.json"
        path.write_text(json.dumps(part))
        parts.append(str(path))
    out = tmp_path / "merged.json"
    assert sweep.main(["--merge", *parts, "--out", str(out), "--plot", str(tmp_path / "m.png")]) == 0
    merged = json.loads(out.read_text())
    assert merged["rates"] == [10.0, 2000.0]
    by_rate = {v["rate"]: v for v in merged["verdict"]}
    assert set(by_rate) == {10.0, 2000.0}
    assert by_rate[2000.0]["throughput_ok"]  # 2,010 vs fixed 0's 2,000
    assert not by_rate[10.0]["throughput_ok"]  # 9 vs 10: outside the 3% tolerance


def test_server_summary_reads_engine_info_sse_counts_and_step_time_median():
    from bucketserve.bench.plots import server_summary
    from bucketserve.bench.scrape import engine_info, parse_prometheus
    from bucketserve.engine.stats import EngineStats, StepStats
    from bucketserve.server.metrics import ServerMetrics

    info = {"model": 'm "1"', "device": "cuda", "dtype": "bfloat16", "quantization": "fp8",
            "kv_cache_dtype": "fp8"}
    es = EngineStats()
    metrics = ServerMetrics(lambda: es, lambda: info)

    def step(ms: float) -> StepStats:
        return StepStats("decode", 8, 8, 0, 8, 8, 8, 1, 10, 0, 0, 8, ms / 1000)

    def scrape() -> dict[str, float]:
        return parse_prometheus(metrics.render().decode())

    for ms in (100, 100, 100):  # before the run: far from the run's steps
        es.record(step(ms))
    metrics.count_stream("completions", 5, 9)
    first = scrape()
    assert engine_info(first) == info  # label values round-trip, quotes included
    # the run: steps of 2.2 ms (6 of them) and 6 ms (3): the median lies in (2, 2.5] ms
    for ms in (2.2,) * 6 + (6,) * 3:
        es.record(step(ms))
    metrics.count_stream("completions", 10, 12)
    metrics.count_stream("chat", 4, 4)
    out = server_summary([(0.0, first), (1.0, scrape())])
    assert out["engine"] == info and out["engine_steps"] == 9
    assert (out["sse_token_events"], out["sse_tokens"]) == (14, 16)
    assert out["sse_tokens_per_event"] == pytest.approx(16 / 14)
    # rank 4.5 of 9, all 6 below 2.5 ms are in the (2, 2.5] bucket: 2 + 0.5 * 4.5 / 6
    assert out["engine_step_ms_p50"] == pytest.approx(2.375)
    assert stats.engine_line(info) == ('engine: model m "1", device cuda, dtype bfloat16, '
                                       "quantization fp8, kv_cache_dtype fp8")
