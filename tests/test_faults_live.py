"""Injected faults in the real server (subprocess): a model step that raises, a CUDA-style
out-of-memory error at one step, a detokenizer failure for one request, the embedding encoder
raising once, and a part that stays broken.

Faults come from the test-only BUCKETSERVE_FAULTS variable (bucketserve/engine/faults.py),
read at start-up; a rule fires on the request whose first prompt token id is its marker.
The requests of a failed step get an error body, their KV blocks go back to the pool, and the
server serves on; a part that keeps failing makes the process exit with status 1.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess

import httpx
import pytest

from bucketserve.bench.launch import LiveServer, start_server

BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.1\n"
STEP, OOM, DETOK, ENCODE, BROKEN, DETOK_STREAM = 9001, 9002, 9003, 9004, 9005, 9006


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    faults = f"step:{STEP},oom:{OOM},detok:{DETOK},encode:{ENCODE},detok:{DETOK_STREAM}"
    srv = start_server(tmp_path_factory.mktemp("faults"), "faults", BUCKETS,
                       "--embedding-model", "all-minilm-l6-v2",
                       env={"BUCKETSERVE_FAULTS": faults})
    yield srv
    srv.stop()


def complete(server: LiveServer, prompt, max_tokens: int = 4, **extra) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=300,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            **extra})


def assert_server_error(resp: httpx.Response, *words: str) -> dict:
    assert resp.status_code == 500, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    for word in words:
        assert word in err["message"], err
    return err


def assert_recovered(server: LiveServer) -> None:
    resp = complete(server, "The capital of France is")
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.base_url + "/health").status_code == 200
    server.wait_for_metric("bucketserve_kv_blocks_used", lambda v: v == 0)
    server.wait_for_metric("bucketserve_requests_running", lambda v: v == 0)


@pytest.mark.parametrize("marker, words", [
    (STEP, ("engine step", "InjectedFault")),
    (OOM, ("engine step", "OutOfMemoryError")),
])
def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server, marker, words):
    with cf.ThreadPoolExecutor(2) as pool:
        # a bystander decoding while the fault hits: it finishes or gets an error, never hangs
        bystander = pool.submit(complete, server, "Tell me a story.", 48, ignore_eos=True)
        server.wait_for_metric("bucketserve_requests_running", lambda v: v >= 1)
        faulty = complete(server, [marker, 504, 2270, 314])
        other = bystander.result(timeout=300)
    assert_server_error(faulty, *words)
    if other.status_code != 200:  # it shared the failed step
        assert_server_error(other, *words)
    errors = server.metric('bucketserve_request_success_total{finish_reason="error"}')
    assert errors >= 1
    assert_recovered(server)
    # the rule fired once: the same prompt now runs
    assert complete(server, [marker, 504, 2270, 314]).status_code == 200


def test_a_detokenizer_failure_fails_only_its_request(server):
    with cf.ThreadPoolExecutor(2) as pool:
        normal = pool.submit(complete, server, "Count to ten:", 24, ignore_eos=True)
        faulty = pool.submit(complete, server, [DETOK, 504, 2270], 24, ignore_eos=True)
        normal, faulty = normal.result(timeout=300), faulty.result(timeout=300)
    assert_server_error(faulty, "into text failed", "InjectedFault")
    assert normal.status_code == 200
    assert normal.json()["usage"]["completion_tokens"] == 24
    assert_recovered(server)


def test_a_detokenizer_failure_of_a_stream_is_an_error_not_a_hang(server):
    # the stream's status is sent with its first output, which is the error here
    resp = httpx.post(server.base_url + "/v1/completions", timeout=300,
                      json={"prompt": [DETOK_STREAM, 1], "max_tokens": 3, "stream": True})
    assert_server_error(resp, "into text failed")
    assert_recovered(server)


def test_the_embedding_encoder_raising_once(server):
    url = server.base_url + "/v1/embeddings"
    resp = httpx.post(url, json={"input": [[ENCODE, 2023, 2003]]}, timeout=120)
    err = assert_server_error(resp, "embedding model failed", "InjectedFault")
    assert err["code"] == "encoder_error"
    server.wait_for_metric("bucketserve_embedding_requests_waiting", lambda v: v == 0)
    again = httpx.post(url, json={"input": [[ENCODE, 2023, 2003], [101, 2307, 102]]}, timeout=120)
    assert again.status_code == 200 and len(again.json()["data"]) == 2
    assert_recovered(server)


def test_a_part_that_stays_broken_makes_the_server_exit_non_zero(tmp_path):
    srv = start_server(tmp_path, "broken", BUCKETS, env={"BUCKETSERVE_FAULTS": f"step:{BROKEN}:*"})
    try:
        statuses = []
        for _ in range(3):  # engine.MAX_FAILED_STEPS failed steps in a row
            resp = complete(srv, [BROKEN, 1, 2])
            statuses.append(resp.status_code)
            assert resp.json()["error"]["message"]
        assert statuses[:2] == [500, 500] and statuses[2] in (500, 503)
        code = srv.proc.wait(60)  # exits by itself, does not hang
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit:\n{srv.log()[-3000:]}")
    finally:
        srv.stop()
    assert code == 1
    assert "exiting with status 1" in srv.log()
