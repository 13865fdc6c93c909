"""The real server (subprocess, SmolLM2 + MiniLM) against a hostile client: malformed text,
clients that go away, slow and stalled clients, dropped connections, and what the API key
and the logs reveal. One server for the module; every test ends by checking that it still
serves a normal request and holds no KV blocks or embedding requests.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from server_launch import LiveServer, start_server

API_KEY = "reliab-key-8f2c1e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# small KV pool; small SSE buffers so that a stalled reader hits its limit quickly
BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.1\n"
SURROGATE = "abc\ud800def"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    srv = start_server(tmp_path_factory.mktemp("reliab"), "reliab", BUCKETS, "--api-key", API_KEY,
                       "--embedding-model", "all-minilm-l6-v2")
    yield srv
    srv.stop()


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_serving_and_idle(server: LiveServer) -> None:
    """A normal request succeeds; no KV block and no embedding request is left behind."""
    resp = httpx.post(server.base_url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    server.wait_for_metric("bucketserve_kv_blocks_used", lambda v: v == 0)
    server.wait_for_metric("bucketserve_requests_waiting", lambda v: v == 0)
    server.wait_for_metric("bucketserve_embedding_requests_waiting", lambda v: v == 0)


def raw_json(value: str) -> bytes:
    """JSON text as a client sends it: a lone surrogate becomes the escape \\ud800."""
    return json.dumps(value).encode()


def connection_port(resp: httpx.Response) -> int:
    """The client-side port of the TCP connection that carried `resp`."""
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


SURROGATE_CASES = [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", %s], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "fine", "stop": [%s], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}',
     "messages"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}', "messages"),
    ("/v1/embeddings", '{"input": %s}', "input"),
    ("/v1/embeddings", '{"input": ["fine", %s]}', "input"),
]


def test_lone_surrogates_get_400_and_the_keep_alive_connection_survives(server):
    """Once a 500 from the tokenizer that also dropped the keep-alive connection."""
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120,
                      limits=httpx.Limits(max_connections=1)) as c:
        first = c.get("/v1/models")
        port = connection_port(first)
        for path, template, param in SURROGATE_CASES:
            body = (template % raw_json(SURROGATE).decode()).encode()
            resp = c.post(path, content=body, headers={"content-type": "application/json"})
            err = assert_error(resp, 400, param)
            assert "surrogate" in err["message"]
            ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert ok.status_code == 200
            assert connection_port(resp) == connection_port(ok) == port
        # a surrogate pair is valid text (one emoji) and is served
        pair = c.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                      headers={"content-type": "application/json"})
        assert pair.status_code == 200
    assert_serving_and_idle(server)


def test_embedding_work_stops_when_its_client_goes_away(server):
    """2,000 inputs, a client that gives up after 2 s: the server drops the inputs not yet
    encoded instead of encoding all of them (it once went on for minutes)."""
    before = server.metric("bucketserve_embedding_inputs")
    texts = [f"sentence number {i} about the weather, the sea and the mountains " * 6
             for i in range(2000)]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/embeddings", headers=AUTH, timeout=2.0,
                   json={"input": texts})
    server.wait_for_metric("bucketserve_embedding_requests_waiting", lambda v: v == 0, 30)
    encoded = server.metric("bucketserve_embedding_inputs") - before
    time.sleep(1.0)
    assert server.metric("bucketserve_embedding_inputs") - before == encoded  # nothing more
    assert encoded < 1000, f"{encoded} of 2000 inputs were encoded for a client that left"
    resp = httpx.post(server.base_url + "/v1/embeddings", headers=AUTH, timeout=60,
                      json={"input": "one more"})
    assert resp.status_code == 200 and len(resp.json()["data"]) == 1
    assert_serving_and_idle(server)
