"""The real server (subprocess, real SmolLM2 model) driven by the official `openai` client
and by raw HTTP: completions and chat, streaming and not, n, seeds, stop strings, usage,
logprobs, echo, SSE framing, every bad input, auth, and client disconnects.

One server for the whole module (model load is the slow part). Requests are greedy or
seeded and short, to keep CPU time low.
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from bucketserve.bench.launch import RAY_API_KEY, RAY_MAX_BODY, LiveServer, start_server

API_KEY = RAY_API_KEY  # the Ray endpoint (conftest.py ray_server) is started with these
MAX_BODY = RAY_MAX_BODY
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit."}]
# A small KV pool (about 2300 tokens) keeps the server's memory low on a shared machine.
BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.1\n"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session", params=["single", "ray", "ray-haproxy"])
def server(request, tmp_path_factory) -> LiveServer:
    """The single server, and the same tests against the Ray Serve endpoint (2 replicas;
    tests/conftest.py ray_server, started with the same key and body limit), behind Ray's
    proxy and behind HAProxy (--ray-ingress haproxy)."""
    if request.param == "ray":
        yield request.getfixturevalue("ray_server")
        return
    if request.param == "ray-haproxy":
        yield request.getfixturevalue("ray_haproxy_server")
        return
    srv = start_server(tmp_path_factory.mktemp("live"), "live", BUCKETS, "--api-key", API_KEY,
                       "--max-body-bytes", str(MAX_BODY))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.openai_client(API_KEY)


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id


def _collect(chunks, piece) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Stream -> (text per choice, finish_reason per choice, all chunks); piece(choice) is
    the text a chunk's choice carries."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    seen = []
    for chunk in chunks:
        seen.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + piece(c)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, seen


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Completion stream -> (text per choice, finish_reason per choice, all chunks)."""
    return _collect(chunks, lambda c: c.text)


def chat_stream_text(chunks) -> tuple[dict[int, str], dict[int, str | None], list]:
    return _collect(chunks, lambda c: c.delta.content or "")


# ------------------------------------------------------------------------- openai client
def test_models_lists_the_served_model(client, server) -> None:
    models = [m.id for m in client.models.list().data]
    # the Ray endpoint (shared with test_embeddings_server.py) serves embeddings as well
    expected = ["smollm2-135m-instruct"] + (["all-minilm-l6-v2"] if server.metrics_lag_s else [])
    assert models == expected
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_completion_streamed_equals_non_streamed(client, model) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 12
    texts, reasons, chunks = stream_text(
        client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stream=True))
    assert texts == {0: choice.text}
    assert reasons == {0: choice.finish_reason}
    assert len(chunks) > 1  # one event per delta, not one at the end


def test_chat_streamed_equals_non_streamed_and_first_chunk_has_role(client, model) -> None:
    resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content
    texts, reasons, chunks = chat_stream_text(
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0,
                                       stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: msg.content}
    assert reasons == {0: resp.choices[0].finish_reason}
    assert resp.object == "chat.completion" and chunks[0].object == "chat.completion.chunk"


def test_n2_with_a_seed_is_reproducible_and_choice_i_uses_seed_plus_i(client, model) -> None:
    kw = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    first = client.completions.create(n=2, seed=1234, **kw)
    again = client.completions.create(n=2, seed=1234, **kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.text for c in again.choices]
    assert texts[0] != texts[1]
    single = client.completions.create(n=1, seed=1235, **kw)
    assert single.choices[0].text == texts[1]
    assert first.usage.completion_tokens == 24
    streamed, _, _ = stream_text(client.completions.create(n=2, seed=1234, stream=True, **kw))
    assert streamed == {0: texts[0], 1: texts[1]}


def test_chat_n2_streams_both_choices(client, model) -> None:
    kw = dict(model=model, messages=CHAT, max_tokens=8, temperature=0.8, seed=7, n=2)
    resp = client.chat.completions.create(**kw)
    texts, reasons, chunks = chat_stream_text(client.chat.completions.create(stream=True, **kw))
    assert texts == {c.index: c.message.content for c in resp.choices}
    assert set(reasons) == {0, 1}
    roles = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role}
    assert roles == {0, 1}


def test_stop_strings_cut_the_text_and_never_leak_into_a_stream(client, model) -> None:
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    k = len(text) // 2
    stop = text[k:k + 4]
    expected = text[: text.index(stop)]
    assert expected, "the chosen stop string must not start the text"
    kw = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\u2603never"],
              extra_body={"ignore_eos": True})
    resp = client.completions.create(**kw)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    texts, reasons, chunks = stream_text(client.completions.create(stream=True, **kw))
    assert texts == {0: expected} and reasons == {0: "stop"}
    assert all(stop not in c.choices[0].text for c in chunks if c.choices)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                          temperature=0)
    content = chat.choices[0].message.content
    if len(content) > 2:
        cut = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                             temperature=0, stop=content[1:3])
        assert cut.choices[0].message.content == content[: content.index(content[1:3])]
        assert cut.choices[0].finish_reason == "stop"


def test_include_usage_sends_a_final_usage_chunk(client, model) -> None:
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens == 6
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert last.usage.total_tokens == plain.usage.total_tokens
    chat_chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chat_chunks[-1].choices == [] and chat_chunks[-1].usage.completion_tokens == 5


def test_completion_logprobs_follow_openai_format(client, model) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    n = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    offset = 0
    for token, logprob, top, off in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                        lp.text_offset, strict=True):
        assert off == offset
        offset += len(token)
        assert logprob <= 0
        assert token in top and 3 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)  # greedy takes the argmax
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         logprobs=3, stream=True, extra_body={"ignore_eos": True})
    tokens, values = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens
    assert values == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_chat_logprobs_follow_openai_format(client, model) -> None:
    resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    assert "".join(e.token for e in content).startswith(resp.choices[0].message.content)


def test_echo_and_prompt_forms(client, model) -> None:
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    other = "Water boils at"
    batch = client.completions.create(model=model, prompt=[PROMPT, other], max_tokens=5,
                                      temperature=0)
    single_other = client.completions.create(model=model, prompt=other, max_tokens=5, temperature=0)
    assert [c.text for c in batch.choices] == [plain.choices[0].text, single_other.choices[0].text]
    ids = client.completions.create(model=model, prompt=[[1, 504, 3000], [42, 43]], max_tokens=3,
                                    temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_priority_and_vllm_fields_are_accepted(client, model) -> None:
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0.7, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4,
                    "priority": -1})
    assert resp.usage.completion_tokens == 4  # min_tokens == max_tokens: no early EOS


# ------------------------------------------------------------------------------ raw SSE
def raw_events(resp: httpx.Response) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    body = "".join(resp.iter_text())
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]  # ": ping" comments
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        events.append(lines[0][len("data: "):])
    return events


def test_raw_sse_framing_completions_and_chat(server) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=300) as http:
        with http.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
                "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = raw_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])

        with http.stream("POST", "/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            events = raw_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------------- bad input
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**15}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 9}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=300) as c:
        yield c


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_input_gets_the_right_status_and_error_body(http, path, body, status, param) -> None:
    assert_error(http.post(path, json=body), status, param)
    assert_still_serving(http)


def test_context_overflow_names_both_numbers(http) -> None:
    err = assert_error(http.post("/v1/completions", json={"prompt": [1] * 8000, "max_tokens": 500}),
                       400, "max_tokens")
    assert "8192" in err["message"] and "8500" in err["message"]
    assert_still_serving(http)


def test_malformed_json_and_unknown_routes(http) -> None:
    err = assert_error(http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                                 headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    assert_error(http.post("/v1/completions", content=b"[1, 2]",
                           headers={"content-type": "application/json"}), 400)
    assert_error(http.get("/v1/no-such-route"), 404)
    assert_error(http.delete("/v1/completions"), 405)
    assert_still_serving(http)


def test_body_over_the_limit_is_413(http) -> None:
    assert_error(http.post("/v1/completions", json={"prompt": "x" * (2 * MAX_BODY)}), 413)
    assert_still_serving(http)


def test_api_key_is_required_on_v1_routes(server) -> None:
    assert_error(httpx.get(server.base_url + "/v1/models"), 401)
    assert_error(httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"},
                            headers={"Authorization": "Bearer wrong"}), 401)
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_openai_client_sees_bad_input_as_bad_request(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, temperature=3)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


# --------------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_frees_its_kv_blocks(server, http) -> None:
    aborted = server.metric('bucketserve_request_success_total{finish_reason="abort"}')
    useful_before = server.metric("bucketserve_useful_tokens_total")
    max_tokens = 1500
    with http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as resp:
        lines = resp.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        # Tokens reach the client while the request is still running.
        m = server.metrics()
        assert m["bucketserve_requests_running"] == 1
        assert m["bucketserve_kv_blocks_used"] > 0
    # Leaving the `with` closes the connection mid-stream.
    server.wait_for_metric("bucketserve_kv_blocks_used", lambda v: v == 0)
    m = server.metrics()
    assert m["bucketserve_requests_running"] == 0
    assert m['bucketserve_request_success_total{finish_reason="abort"}'] == aborted + 1
    assert m["bucketserve_useful_tokens_total"] - useful_before < max_tokens


def test_a_stop_string_finishes_the_sequence_in_the_engine_core(server, client, model) -> None:
    """The front end finds the stop; the core finishes the sequence and frees its blocks."""
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    stops = server.metric('bucketserve_request_success_total{finish_reason="stop"}')
    useful_before = server.metric("bucketserve_useful_tokens_total")
    max_tokens = 1500
    texts, reasons, _ = stream_text(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stop=[stop],
        stream=True, extra_body={"ignore_eos": True}))
    assert texts == {0: base[:base.index(stop)]} and reasons == {0: "stop"}
    server.wait_for_metric('bucketserve_request_success_total{finish_reason="stop"}',
                           lambda v: v == stops + 1)
    server.wait_for_metric("bucketserve_kv_blocks_used", lambda v: v == 0)
    assert server.metric("bucketserve_requests_running") == 0
    # the generation stopped a step or so after the stop string, not at max_tokens
    assert server.metric("bucketserve_useful_tokens_total") - useful_before < 100


def test_abandoned_non_streaming_request_is_aborted(server) -> None:
    aborted = server.metric('bucketserve_request_success_total{finish_reason="abort"}')
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        server.wait_for_metric("bucketserve_kv_blocks_used", lambda v: v > 0)
        assert server.metric("bucketserve_requests_running") == 1
    server.wait_for_metric("bucketserve_kv_blocks_used", lambda v: v == 0)
    assert server.metric('bucketserve_request_success_total{finish_reason="abort"}') == aborted + 1
    assert server.metric("bucketserve_requests_running") == 0


def test_metrics_exposes_every_required_series(server, client, model) -> None:
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    names = set(server.metrics())
    text = httpx.get(server.base_url + "/metrics").text
    for gauge in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_total"):
        assert f"bucketserve_{gauge}" in names
    for counter in ("preemptions_total", "computed_tokens_total", "useful_tokens_total"):
        assert f"bucketserve_{counter}" in names
    assert any(n.startswith("bucketserve_bucket_steps_total{") and 'kind="' in n and 'bucket="' in n
               for n in names)
    assert any(n.startswith("bucketserve_request_success_total{finish_reason=") for n in names)
    per_kind = {n: v for n, v in server.metrics().items()
                if n.startswith("bucketserve_step_computed_tokens_total{kind=")}
    assert per_kind and sum(per_kind.values()) == server.metric("bucketserve_computed_tokens_total")
    assert any(n.startswith("bucketserve_step_padding_tokens_total{kind=") for n in names)
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "queue_time_seconds"):
        assert f"# TYPE bucketserve_{hist} histogram" in text
        assert server.metrics()[f"bucketserve_{hist}_count"] >= 1
    assert server.metric("bucketserve_kv_blocks_total") > 0
    assert server.metric("bucketserve_computed_tokens_total") >= server.metric(
        "bucketserve_useful_tokens_total") > 0


def test_server_log_reports_model_load_and_buckets(server) -> None:
    log = server.log()
    assert "loaded in" in log and "buckets prepared" in log and "warm-up done" in log


def test_prompts_are_tokenized_and_templated_as_transformers_does(client, model, hf_tokenizer) -> None:
    """usage.prompt_tokens against transformers' own tokenizer and chat template (the oracle)."""
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens == len(hf_tokenizer(PROMPT)["input_ids"])
    messages = [{"role": "system", "content": "Be brief."}, *CHAT]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                          temperature=0)
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.usage.prompt_tokens == len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_greedy_text_through_the_server_equals_transformers_generate(
        client, model, hf_tokenizer, hf_smollm2) -> None:
    """The whole path (tokenize, engine, detokenize, JSON) against transformers' generate."""
    import torch

    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    ids = hf_tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = hf_smollm2.generate(ids, max_new_tokens=10, do_sample=False)
    expected = hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert resp.choices[0].text == expected
