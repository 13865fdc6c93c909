"""/v1/embeddings on a bare FastAPI app (the router and the server's error handlers, real
MiniLM model, in process): input forms, formats, usage, errors, and request merging."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import minilm_dir
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bucketserve.buckets import load_buckets
from bucketserve.models.bert_loader import load_embedding_model
from bucketserve.server.embeddings import EmbeddingService
from bucketserve.server.errors import install_exception_handlers

MIN_COSINE = 0.9999
TEXTS = ["The cat sat on the mat.", "Ein kleiner Test.", "🚀 launch", "東京タワー",
         "a", "Another sentence entirely.", "x y z", "bonjour"]


@pytest.fixture(scope="module")
def loaded():
    return load_embedding_model("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")


def make_app(loaded, tmp_path, toml: str = "") -> tuple[FastAPI, EmbeddingService]:
    path = tmp_path / "buckets.toml"
    path.write_text(toml)
    service = EmbeddingService(loaded, load_buckets(path))
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(service.router)
    return app, service


async def _with_client(app, service, fn):
    await service.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await fn(client)
    finally:
        await service.shutdown(10.0)


def call(app, service, fn):
    return asyncio.run(_with_client(app, service, fn))


def vectors(body: dict) -> torch.Tensor:
    out = []
    for i, item in enumerate(body["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        emb = item["embedding"]
        if isinstance(emb, str):
            out.append(torch.from_numpy(np.frombuffer(base64.b64decode(emb), dtype="<f4").copy()))
        else:
            out.append(torch.tensor(emb))
    return torch.stack(out)


def assert_close_to(got: torch.Tensor, ref: torch.Tensor) -> None:
    cos = F.cosine_similarity(got, ref, dim=1)
    assert bool((cos >= MIN_COSINE).all()), cos


@pytest.fixture(scope="module")
def default_app(loaded, tmp_path_factory):
    return make_app(loaded, tmp_path_factory.mktemp("emb"))


def test_input_forms_formats_and_usage(default_app, loaded, st_model):
    app, service = default_app
    ref = torch.from_numpy(st_model.encode(TEXTS))
    ids = loaded.tokenizer.encode_batch(TEXTS)

    async def fn(client):
        post = lambda body: client.post("/v1/embeddings", json=body)  # noqa: E731
        return await asyncio.gather(
            post({"input": TEXTS, "model": "all-minilm-l6-v2", "user": "u1"}),
            post({"input": TEXTS, "encoding_format": "base64"}),
            post({"input": TEXTS[2]}),
            post({"input": ids}),
            post({"input": ids[0], "encoding_format": "base64"}),
        )

    many, b64, one, tokens, one_tokens = call(app, service, fn)
    for r in (many, b64, one, tokens, one_tokens):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "all-minilm-l6-v2"
    assert_close_to(vectors(many.json()), ref)
    assert_close_to(vectors(b64.json()), ref)
    assert_close_to(vectors(tokens.json()), ref)
    assert_close_to(vectors(one.json()), ref[2:3])
    assert_close_to(vectors(one_tokens.json()), ref[0:1])
    # base64 carries exactly the float32 values of the float response.
    assert torch.equal(vectors(b64.json()), vectors(many.json()).float())
    n_tokens = sum(map(len, ids))
    assert many.json()["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    assert one_tokens.json()["usage"]["prompt_tokens"] == len(ids[0])


def test_truncation(default_app, loaded, st_model):
    app, service = default_app
    long_text = "many words " * 200
    ids = loaded.tokenizer.encode(long_text)

    async def fn(client):
        post = lambda body: client.post("/v1/embeddings", json=body)  # noqa: E731
        return await asyncio.gather(
            post({"input": [long_text], "truncate_prompt_tokens": -1}),
            post({"input": [long_text], "truncate_prompt_tokens": 20}),
            post({"input": [ids], "truncate_prompt_tokens": 30}),
        )

    full, short, tok = call(app, service, fn)
    assert full.json()["usage"]["prompt_tokens"] == 256
    assert short.json()["usage"]["prompt_tokens"] == 20
    assert tok.json()["usage"]["prompt_tokens"] == 30
    assert_close_to(vectors(full.json()), torch.from_numpy(st_model.encode([long_text])))
    st_model.max_seq_length = 20
    try:
        ref20 = torch.from_numpy(st_model.encode([long_text]))
    finally:
        st_model.max_seq_length = 256
    assert_close_to(vectors(short.json()), ref20)


@pytest.mark.parametrize("body, status, needle", [
    ({"input": []}, 400, "input is empty"),
    ({"input": ""}, 400, "input[0] is empty"),
    ({"input": ["ok", ""]}, 400, "input[1] is empty"),
    ({"input": [[101, 102], []]}, 400, "input[1] is empty"),
    ({"input": ["ok", 5]}, 400, "input[1] must be a string"),
    ({"input": [1, "a"]}, 400, "input[0] must be a list"),
    ({"input": [[1, 2], [3, -4]]}, 400, "input[1] must be a list of non-negative"),
    ({"input": [1.5]}, 400, "input must be"),
    ({"input": True}, 400, "input must be"),
    ({"input": {"a": 1}}, 400, "input must be"),
    ({}, 400, "input"),
    ({"input": [[101, 40000]]}, 400, "input[0] has token id 40000"),
    ({"input": ["short", "word " * 300]}, 400, "input[1] has 302 tokens, over the model's "
                                               "maximum input length of 256"),
    ({"input": [[1] * 257]}, 400, "input[0] has 257 tokens"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 1000}, 400, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 2}, 400, "truncation length 2"),
    ({"input": "x", "dimensions": 10}, 400, "dimensions"),
    ({"input": ["x"] * 2049}, 413, "2049 items, over the limit of 2048"),
    ({"input": "x", "model": "gpt-4"}, 404, "does not exist"),
])
def test_errors(default_app, body, status, needle):
    app, service = default_app

    async def fn(client):
        return await client.post("/v1/embeddings", json=body)

    r = call(app, service, fn)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"


def _scrape(service) -> dict:
    registry = CollectorRegistry()
    registry.register(service.metrics_collector)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_concurrent_single_requests_share_batches(loaded, st_model, tmp_path):
    # A full bucket runs at once; the huge delay means nothing runs before 4 inputs share a
    # bucket, so the 12 single-input requests below must form exactly three batches of 4.
    app, service = make_app(loaded, tmp_path, "[embedding]\npreferred_batch_size = 4\n"
                                              "max_queue_delay_ms = 600000.0\n"
                                              "boundaries = [16, 32, 64, 128, 256]\n")
    short = ["one", "two words", "three words here", "four", "5", "six six", "seven", "8 8 8"]
    longer = ["a considerably longer sentence that needs more than sixteen tokens in total, "
              f"variant number {i} of this text" for i in range(4)]
    texts = short + longer

    async def fn(client):
        rs = await asyncio.gather(*[client.post("/v1/embeddings", json={"input": t})
                                    for t in texts])
        return rs, _scrape(service)

    responses, metrics = call(app, service, fn)
    got = torch.cat([vectors(r.json()) for r in responses])
    assert_close_to(got, torch.from_numpy(st_model.encode(texts)))
    hist = lambda le: metrics[("bucketserve_embedding_batch_size_bucket", (("le", le),))]  # noqa: E731
    assert hist("2") == 0 and hist("4") == 3  # three batches, each of 4 inputs
    assert metrics[("bucketserve_embedding_batch_size_count", ())] == 3
    assert metrics[("bucketserve_embedding_batches_total", (("bucket", "16"),))] == 2
    assert metrics[("bucketserve_embedding_batches_total", (("bucket", "32"),))] == 1
    useful = sum(len(ids) for ids in loaded.tokenizer.encode_batch(texts))
    assert metrics[("bucketserve_embedding_useful_tokens_total", ())] == useful
    # the served CPU batcher computes each batch at its longest row, not at its bucket
    # length (FunctionRunner trim): the 4 long texts at their longest; the 8 short ones in two
    # batches of 4, one holding the longest short text (s1), the other's longest between the
    # 5th and 2nd longest (s5..s2)
    s = sorted((len(ids) for ids in loaded.tokenizer.encode_batch(short)), reverse=True)
    long_len = max(len(ids) for ids in loaded.tokenizer.encode_batch(longer))
    computed = metrics[("bucketserve_embedding_computed_tokens_total", ())]
    assert 4 * long_len + 4 * (s[0] + s[4]) <= computed <= 4 * long_len + 4 * (s[0] + s[1])
    assert computed < 8 * 16 + 4 * 32  # less than the bucket shapes would have computed
    assert metrics[("bucketserve_embedding_queue_delay_seconds_count", ())] == 12
    assert metrics[("bucketserve_embedding_encoder_seconds_total", ())] > 0


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_large_request_keeps_input_order(default_app, st_model, fmt):
    # Over the inline limits: tokenized and serialised off the event loop, spread over buckets.
    texts = [f"sentence {i} " + "word " * (i % 40) for i in range(100)]
    app, service = default_app

    async def fn(client):
        return await client.post("/v1/embeddings", json={"input": texts, "encoding_format": fmt})

    r = call(app, service, fn)
    assert r.status_code == 200, r.text
    assert_close_to(vectors(r.json()), torch.from_numpy(st_model.encode(texts)))


# ------------------------------------------------------------------ deadlines (issue 15)
@pytest.mark.parametrize("value", ["abc", "", "0", "-5", "nan", "inf", "1e12", "10ms"])
def test_bad_deadline_header_is_refused_before_any_work(default_app, value):
    app, service = default_app
    inputs_before = service.batcher.stats.num_inputs

    async def fn(client):
        bad = await client.post("/v1/embeddings", json={"input": "hello"},
                                headers={"X-Request-Deadline-Ms": value})
        good = await client.post("/v1/embeddings", json={"input": "hello"},
                                 headers={"X-Request-Deadline-Ms": "250.5"})
        return bad, good

    bad, good = call(app, service, fn)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_deadline"
    assert err["param"] == "X-Request-Deadline-Ms" and "X-Request-Deadline-Ms" in err["message"]
    assert good.status_code == 200, good.text
    assert service.batcher.stats.num_inputs == inputs_before + 1  # the bad one never queued


def test_deadline_header_runs_a_bucket_before_the_fixed_delay(loaded, st_model, tmp_path):
    # An incomplete bucket waits 10 minutes (fixed delay, no SLO); a request that says it
    # needs its answer within 300 ms runs at its deadline, its neighbour without one waits.
    app, service = make_app(loaded, tmp_path, "[embedding]\npreferred_batch_size = 4\n"
                                              "max_queue_delay_ms = 600000.0\n")

    async def fn(client):
        patient = asyncio.ensure_future(client.post("/v1/embeddings", json={  # another bucket
            "input": "this request has no deadline and is a good deal longer, so that it "
                     "waits in a bucket of its own: " + "word " * 20}))
        r = await asyncio.wait_for(client.post(
            "/v1/embeddings", json={"input": "a sentence with a deadline"},
            headers={"X-Request-Deadline-Ms": "300"}), 120)
        waiting = not patient.done()
        patient.cancel()
        return r, waiting

    r, patient_waited = call(app, service, fn)
    assert r.status_code == 200, r.text
    assert_close_to(vectors(r.json()), torch.from_numpy(st_model.encode(
        ["a sentence with a deadline"])))
    assert patient_waited
    assert service.batcher.stats.num_batches == 1


def test_latency_slo_measures_costs_at_start_and_learns_from_batches(loaded, tmp_path):
    app, service = make_app(loaded, tmp_path, "[embedding]\nlatency_slo_ms = 200\n")
    table = service.batcher.queue.cost
    assert service.batcher.queue.latency_slo_s == 0.2
    warm = table.version  # observations so far
    assert warm and warm == len(table.cells)  # the start-up shapes, one batch each
    texts = ["slo one", "slo two"]

    async def fn(client):
        rs = await asyncio.gather(*[client.post("/v1/embeddings", json={"input": t})
                                    for t in texts])
        return rs, _scrape(service)

    responses, metrics = call(app, service, fn)
    assert all(r.status_code == 200 for r in responses)
    assert table.version == warm + service.batcher.stats.num_batches
    assert ("bucketserve_embedding_deadline_misses_total", ()) in metrics
