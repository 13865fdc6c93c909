"""Server plumbing in isolation: the app over a scripted stand-in engine, in process.

The stand-in isolates what the server itself decides (status codes, error bodies, auth,
body limit, SSE framing, n-choice merging, aborts when a consumer goes away) from model
behaviour, which the live-server tests (test_server_live.py) cover with the real engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi.testclient import TestClient

from bucketserve.engine.outputs import QueueFullError, RequestOutput
from bucketserve.engine.sequence import SamplingParams
from bucketserve.engine.stats import EngineStats
from bucketserve.server.app import create_app
from bucketserve.server.context import ServerContext
from bucketserve.server.generation import InFlight, Job, run_choices
from bucketserve.server.metrics import ServerMetrics

REPLY = "hello world, this is the scripted reply."


class ByteTokenizer:
    """One token per UTF-8 byte; enough to exercise the server's text handling."""

    vocab_size = 256
    max_token_bytes = 1
    bos_token_id = None
    eos_token_ids = {0}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class ScriptedEngine:
    """Emits REPLY one byte per output; `hold` keeps requests open until released."""

    def __init__(self, max_waiting: int = 100) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_name = "scripted"
        self.info = {"model": "scripted", "device": "cpu", "dtype": "float32",
                     "quantization": "none", "kv_cache_dtype": "auto"}
        self.max_model_len = 128
        self.stats = EngineStats()
        self.pool_tokens = 8 * 16  # a pool of 8 blocks of 16 tokens
        self.aborted: list[str] = []
        self.started: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.max_waiting = max_waiting
        self.alive = False

    def is_alive(self) -> bool:
        return self.alive

    def start(self) -> None:
        self.alive = True

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        self.alive = False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if len(self.started) >= self.max_waiting:
            raise QueueFullError("scripted queue is full")
        self.started.append(request_id)
        text = ""
        ids: list[int] = []
        reply = REPLY.encode()[: params.max_tokens]
        for k, b in enumerate(reply):
            await self.hold.wait()
            ids.append(b)
            text += chr(b)
            done = k == len(reply) - 1
            yield RequestOutput(request_id, [b], chr(b), text, list(ids), done,
                                ("length" if len(reply) == params.max_tokens else "stop") if done else None,
                                len(prompt_token_ids), len(ids))
            await asyncio.sleep(0)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def client(engine: ScriptedEngine):
    app = create_app(ServerContext(engine), max_body_bytes=4096)
    with TestClient(app) as c:
        yield c


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 300]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"300": 5}}, "logit_bias"),
    ({"prompt": "hi", "guided_regex": "(a"}, "guided_regex"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ({}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "max_tokens": 3.0}, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "stop": ["x" * 513]}, "stop"),
    ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"prompt": "hi", "priority": 2**63}, "priority"),
    ({"prompt": "hi", "top_k": 2**31}, "top_k"),
    ({"prompt": "hi", "min_tokens": 2**31}, "min_tokens"),
    ({"prompt": "hi", "n": 129}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
])
def test_bad_completion_requests_get_400_and_an_openai_error_body(client, body, param) -> None:
    assert_error(client.post("/v1/completions", json=body), 400, param)
    assert client.get("/health").status_code == 200


def test_context_length_error_names_both_numbers(client) -> None:
    err = assert_error(client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 50}),
                       400, "max_tokens")
    assert "128" in err["message"] and "150" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_malformed_json_wrong_shape_unknown_route_and_model(client) -> None:
    err = assert_error(client.post("/v1/completions", content=b'{"prompt": "hi",',
                                   headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    assert_error(client.post("/v1/completions", json=["not", "an", "object"]), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/completions"), 405)
    err = assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                       "model")
    assert err["code"] == "model_not_found"


def test_headers_over_the_limit_are_431(client) -> None:
    err = assert_error(client.get("/v1/models", headers={"x-big": "a" * 40_000}), 431)
    assert err["code"] == "headers_too_large"
    many = [(f"x-h{i}", "v" * 20) for i in range(2000)]
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}, headers=many), 431)
    assert client.get("/v1/models", headers={"x-fine": "a" * 1000}).status_code == 200


def test_a_text_that_cannot_fit_the_context_is_refused_before_tokenizing(client, engine) -> None:
    calls = []
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    # one byte per token: more characters than the 128-token context cannot fit
    err = assert_error(client.post("/v1/completions", json={"prompt": "x" * 129}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "129 characters" in err["message"]
    err = assert_error(client.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "x" * 200}]}),
                       400, "messages")
    assert err["code"] == "context_length_exceeded"
    assert calls == []


def test_body_over_the_limit_is_413_with_and_without_content_length(client) -> None:
    big = json.dumps({"prompt": "x" * 5000}).encode()
    assert_error(client.post("/v1/completions", content=big,
                             headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    assert_error(client.post("/v1/completions", content=chunks(),
                             headers={"content-type": "application/json"}), 413)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200


def test_api_key_guards_v1_routes_only(engine) -> None:
    app = create_app(ServerContext(engine), api_key="sekret")
    with TestClient(app) as c:
        err = assert_error(c.get("/v1/models"), 401)
        assert err["type"] == "authentication_error"
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_api_key_guards_the_schema_and_refuses_two_authorization_headers(engine) -> None:
    app = create_app(ServerContext(engine), api_key="sekret")
    good = ("Authorization", "Bearer sekret")
    with TestClient(app) as c:
        assert_error(c.get("/openapi.json"), 401)
        assert c.get("/openapi.json", headers=[good]).status_code == 200
        for second in (good, ("Authorization", "Bearer wrong")):
            for headers in ([good, second], [second, good]):
                err = assert_error(c.get("/v1/models", headers=headers), 401)
                assert "exactly one" in err["message"]
        assert c.get("/v1/models", headers=[good]).status_code == 200


def test_api_key_middleware_compares_in_constant_time(monkeypatch, engine) -> None:
    import bucketserve.server.app as app_module

    seen = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    with TestClient(create_app(ServerContext(engine), api_key="sekret")) as c:
        c.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert seen == [(b"Bearer nope", b"Bearer sekret")]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}),
    ("/v1/completions", {"prompt": "a", "n": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 5}),
])
def test_more_sequences_than_the_queue_holds_is_a_400_not_a_503(path, body) -> None:
    engine = ScriptedEngine(max_waiting=4)
    with TestClient(create_app(ServerContext(engine))) as c:
        err = assert_error(c.post(path, json=body), 400)
        assert err["code"] == "too_many_sequences" and "max_waiting = 4" in err["message"]
        assert engine.started == []  # refused before anything was queued
        body = {**body, "n": 1}
        if isinstance(body.get("prompt"), list):
            body["prompt"] = body["prompt"][:2]
        assert c.post(path, json={**body, "max_tokens": 2}).status_code == 200


def test_health_is_503_when_the_engine_loop_is_not_running(engine) -> None:
    with TestClient(create_app(ServerContext(engine))) as c:
        assert c.get("/health").status_code == 200
        engine.alive = False
        resp = c.get("/health")
        assert resp.status_code == 503 and resp.json()["status"] == "engine loop not running"


def test_queue_full_is_503_with_retry_after() -> None:
    engine = ScriptedEngine(max_waiting=1)
    engine.started.append("another request, still waiting")
    with TestClient(create_app(ServerContext(engine))) as c:
        for stream in (False, True):
            resp = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            err = assert_error(resp, 503)
            assert err["code"] == "queue_full"
            assert int(resp.headers["retry-after"]) >= 1


def test_n_choices_merge_and_echo(client) -> None:
    resp = client.post("/v1/completions",
                       json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "echo": True})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in body["choices"]]
    assert texts == ["ab" + REPLY[:5]] * 2 + ["cd" + REPLY[:5]] * 2
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 20, "total_tokens": 24}


def test_sse_framing_role_chunk_and_usage(client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = "".join(resp.iter_text())
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    firsts = {}
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        firsts.setdefault(choice["index"], choice["delta"])
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    text = {0: "", 1: ""}
    for ch in chunks[:-1]:
        text[ch["choices"][0]["index"]] += ch["choices"][0]["delta"].get("content") or ""
        assert ch["usage"] is None
    assert text == {0: REPLY[:4], 1: REPLY[:4]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_closing_the_merged_stream_aborts_unfinished_choices(engine) -> None:
    async def scenario() -> None:
        engine.hold.clear()
        stats = EngineStats()
        jobs = [Job([1, 2], SamplingParams(max_tokens=8)) for _ in range(3)]
        outputs = run_choices(engine, jobs, "req", 0, InFlight(), ServerMetrics(lambda: stats))
        first = asyncio.ensure_future(anext(outputs))
        await asyncio.sleep(0.05)
        engine.hold.set()
        await first
        await outputs.aclose()

    asyncio.run(scenario())
    assert sorted(engine.aborted) == ["req-0", "req-1", "req-2"]


def test_a_consumer_that_stops_taking_outputs_gets_its_requests_aborted(engine) -> None:
    """A client that stops reading its stream blocks the sender; the outputs held for it are
    bounded: past the limit its engine requests are aborted and the stream ends in an error."""
    from bucketserve.server.errors import APIError

    async def scenario() -> None:
        jobs = [Job([1, 2], SamplingParams(max_tokens=40)) for _ in range(2)]
        stats = EngineStats()
        outputs = run_choices(engine, jobs, "slow", 0, InFlight(), ServerMetrics(lambda: stats),
                              max_buffered_per_choice=3)
        await anext(outputs)
        await asyncio.sleep(0.2)  # the consumer stalls while the engine produces
        assert set(engine.aborted) == {"slow-0", "slow-1"}
        taken = 1
        with pytest.raises(APIError) as err:
            async for _ in outputs:
                taken += 1
        assert err.value.status == 408 and err.value.code == "client_too_slow"
        assert taken <= 1 + 2 * 3 + 2  # the limit, plus at most one more per choice

    asyncio.run(scenario())
