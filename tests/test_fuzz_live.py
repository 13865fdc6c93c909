"""Property-based fuzzing (hypothesis) of the real server: every route gets requests built from
its schema with wrong types, huge and negative numbers, NaN and infinity, empty and enormous
strings and lists, deep nesting, lone surrogates and unknown fields, and raw bodies that are
truncated, invalid UTF-8, full of duplicate keys or sent with the wrong content type.

Every answer must be a 2xx or a 4xx with OpenAI's error body: no 5xx, ever. After each input
the server must still answer /health and a normal request, and hold no KV block, waiting
request or embedding request. Runs are derandomized (the same inputs every run) and bounded
(max_examples per route); generation stays short (max_tokens is either small or invalid).
Set BUCKETSERVE_FUZZ_REPORT=path to write the number of inputs tried per route as JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bucketserve.bench.launch import LiveServer, start_server

MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.1\n[scheduler]\nmax_waiting = 64\n"
TRIED: Counter[str] = Counter()
IDLE_GAUGES = ("bucketserve_kv_blocks_used", "bucketserve_requests_waiting",
               "bucketserve_requests_running", "bucketserve_embedding_requests_waiting")
# Examples per property; BUCKETSERVE_FUZZ_SCALE=2.5 runs 2.5 times as many.
SCALE = float(os.environ.get("BUCKETSERVE_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int):
    return settings(max_examples=int(max_examples * SCALE), derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    srv = start_server(tmp_path_factory.mktemp("fuzz"), "fuzz", BUCKETS,
                       "--embedding-model", EMBEDDING_MODEL, "--max-body-bytes", str(2**20))
    yield srv
    srv.stop()
    report = os.environ.get("BUCKETSERVE_FUZZ_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"inputs_tried": dict(TRIED), "total": sum(TRIED.values())}, f, indent=1)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


# ---------------------------------------------------------------------------- strategies
def nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


BAD_INTS = st.sampled_from([-(2**64), -(2**63) - 1, -(2**31), -1, 0, 2**31, 2**63, 2**64,
                            10**30, 10**5])
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 5e-324])
ODD_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "a\udfffb", "\udc00\ud800", "😀" * 500,
                            "x" * 100_000, "<|im_start|>", "../../etc/passwd", "\u202e"])
SCALARS = (st.none() | st.booleans() | st.integers(-10, 10) | BAD_INTS
           | st.floats(allow_nan=True, allow_infinity=True) | ODD_FLOATS
           | st.text(max_size=40) | ODD_TEXT)
JSON = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)
HUGE = st.sampled_from([nested(400), nested(200, "x"), [0] * 100_000, ["a"] * 20_000,
                        {f"k{i}": i for i in range(5000)}])
ANYTHING = JSON | HUGE | SCALARS

# Generation is kept short: max_tokens is small, or a value the server must refuse.
MAX_TOKENS = st.integers(1, 4) | BAD_INTS | JSON
PROMPT = (st.text(min_size=1, max_size=30) | st.lists(st.text(min_size=1, max_size=10),
                                                      min_size=1, max_size=3)
          | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
          | st.lists(st.lists(st.integers(-5, 60000), max_size=4), max_size=3) | ANYTHING)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "bot"]) | JSON,
     "content": st.text(max_size=30) | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10) | JSON}),
         max_size=2) | ANYTHING},
    optional={"name": JSON, "tool_calls": JSON})
SAMPLING = {
    "model": st.sampled_from([MODEL, "gpt-4", "/etc/passwd", "../" + MODEL, ""]) | JSON,
    "temperature": st.floats(0, 2) | ODD_FLOATS | JSON,
    "top_p": st.floats(0, 1) | ODD_FLOATS | JSON,
    "n": st.integers(1, 3) | BAD_INTS | JSON,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | ANYTHING,
    "seed": st.integers() | BAD_INTS | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "presence_penalty": st.floats(-2, 2) | ODD_FLOATS | JSON,
    "frequency_penalty": ODD_FLOATS | JSON,
    "top_k": st.integers(-2, 100) | BAD_INTS | JSON,
    "min_p": ODD_FLOATS | st.floats(0, 1) | JSON,
    "repetition_penalty": ODD_FLOATS | st.floats(0, 2) | JSON,
    "min_tokens": st.integers(0, 8) | BAD_INTS | JSON,
    "ignore_eos": st.booleans() | JSON,
    "stop_token_ids": st.lists(st.integers(-1, 50000), max_size=80) | ANYTHING,
    "skip_special_tokens": st.booleans() | JSON,
    "priority": st.integers(-5, 5) | BAD_INTS | JSON,
    "logit_bias": JSON,
    "user": st.text(max_size=10) | ANYTHING,
    "unknown_field": ANYTHING,
}
COMPLETION = st.fixed_dictionaries(
    {"max_tokens": MAX_TOKENS},
    optional={"prompt": PROMPT, **SAMPLING, "echo": st.booleans() | JSON,
              "logprobs": st.integers(0, 21) | BAD_INTS | JSON, "best_of": JSON,
              "suffix": JSON})
CHAT = st.fixed_dictionaries(
    {"max_tokens": MAX_TOKENS},
    optional={"messages": st.lists(MESSAGE, max_size=3) | ANYTHING, **SAMPLING,
              "max_completion_tokens": MAX_TOKENS, "logprobs": st.booleans() | JSON,
              "top_logprobs": st.integers(0, 21) | BAD_INTS | JSON, "tools": JSON})
EMBEDDING = st.fixed_dictionaries({}, optional={
    "input": (st.text(max_size=30) | st.lists(st.text(max_size=20), max_size=4)
              | st.lists(st.integers(-2, 40000), max_size=6)
              | st.lists(st.lists(st.integers(0, 31000), max_size=5), max_size=3) | ANYTHING),
    "model": st.sampled_from([EMBEDDING_MODEL, MODEL, "x"]) | JSON,
    "encoding_format": st.sampled_from(["float", "base64", "int8"]) | JSON,
    "dimensions": st.integers(0, 1000) | BAD_INTS | JSON,
    "truncate_prompt_tokens": st.integers(-2, 600) | BAD_INTS | JSON,
    "priority": BAD_INTS | JSON, "user": JSON, "extra": ANYTHING})
VALID = {"/v1/completions": {"prompt": "Hello", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2},
         "/v1/embeddings": {"input": "Hello"}}


@st.composite
def raw_bodies(draw, path: str) -> tuple[bytes, str]:
    """(body bytes, content type) that are not a well-formed JSON request."""
    valid = json.dumps(VALID[path]).encode()
    kind = draw(st.sampled_from(["truncated", "bad_utf8", "duplicate", "content_type", "deep",
                                 "binary", "literals", "garbage_json"]))
    ctype = "application/json"
    if kind == "truncated":
        body = valid[:draw(st.integers(0, len(valid) - 1))]
    elif kind == "bad_utf8":
        at = draw(st.integers(0, len(valid)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf8\x88"]))
        body = valid[:at] + junk + valid[at:]
    elif kind == "duplicate":
        key = next(iter(VALID[path]))
        other = json.dumps(draw(JSON)).encode()
        body = valid[:-1] + b', "' + key.encode() + b'": ' + other + b"}"
    elif kind == "content_type":
        body = valid
        ctype = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "",
                                      "multipart/form-data; boundary=x", "application/xml",
                                      "application/json; charset=latin-1", "*/*"]))
    elif kind == "deep":
        depth = draw(st.integers(100, 200_000))
        body = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "binary":
        body = draw(st.binary(max_size=300))
    elif kind == "literals":
        body = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"null", b"true",
                                     b"[]", b"0", b'""', b'{"max_tokens": NaN}', b"{}" * 3]))
    else:
        body = draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    return body, ctype


# ---------------------------------------------------------------------------- checks
def check_answer(resp: httpx.Response) -> None:
    assert resp.status_code < 500, f"{resp.status_code}: {resp.text[:500]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert isinstance(err["message"], str)
        return
    assert 200 <= resp.status_code < 300
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    elif resp.request.url.path.startswith("/v1"):
        resp.json()


def check_still_serving(http: httpx.Client, server: LiveServer, embeddings: bool) -> None:
    assert http.get("/health").status_code == 200
    if embeddings:
        resp = http.post("/v1/embeddings", json=VALID["/v1/embeddings"])
    else:
        resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 60
    while busy := {k: v for k, v in server.metrics().items() if k in IDLE_GAUGES and v}:
        assert time.monotonic() < deadline, f"still held after 60 s: {busy}"
        time.sleep(0.05)


def send_json(http: httpx.Client, path: str, body: object) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return http.post(path, content=content, headers={"content-type": "application/json"})


# ---------------------------------------------------------------------------- the properties
@fuzz_settings(40)
@given(body=COMPLETION)
def test_fuzz_completions(server, http, body):
    TRIED["/v1/completions"] += 1
    check_answer(send_json(http, "/v1/completions", body))
    check_still_serving(http, server, embeddings=False)


@fuzz_settings(40)
@given(body=CHAT)
def test_fuzz_chat_completions(server, http, body):
    TRIED["/v1/chat/completions"] += 1
    check_answer(send_json(http, "/v1/chat/completions", body))
    check_still_serving(http, server, embeddings=False)


@fuzz_settings(40)
@given(body=EMBEDDING)
def test_fuzz_embeddings(server, http, body):
    TRIED["/v1/embeddings"] += 1
    check_answer(send_json(http, "/v1/embeddings", body))
    check_still_serving(http, server, embeddings=True)


@fuzz_settings(45)
@given(path=st.sampled_from(sorted(VALID)), data=st.data())
def test_fuzz_raw_bodies(server, http, path, data):
    body, ctype = data.draw(raw_bodies(path))
    TRIED[path + " (raw body)"] += 1
    headers = {"content-type": ctype} if ctype else {}
    check_answer(http.post(path, content=body, headers=headers))
    check_still_serving(http, server, embeddings=path == "/v1/embeddings")


@fuzz_settings(24)
@given(path=st.sampled_from(["/v1/models", "/health", "/metrics"]),
       method=st.sampled_from(["GET", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       params=st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
       body=st.binary(max_size=100))
def test_fuzz_models_health_metrics(server, http, path, method, params, body):
    TRIED[path] += 1
    resp = http.request(method, path, params=params, content=body or None)
    check_answer(resp)
    if method == "GET":
        assert resp.status_code == 200
    check_still_serving(http, server, embeddings=False)
