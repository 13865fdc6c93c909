"""The real `bucketserve serve` (subprocess) with MiniLM embeddings, driven by the official
`openai` client: float and base64 vectors equal sentence-transformers', concurrent single-input
requests merge into shared batches (seen in /metrics), errors in OpenAI's body."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from conftest import minilm_dir

from bucketserve.bench.launch import RAY_API_KEY, LiveServer, start_server

MIN_COSINE = 0.9999
API_KEY = "emb-key"
# Tiny KV pool for the (unused) LLM. Batches of 4; an incomplete bucket waits up to 1 s for
# more inputs, which lets the concurrent requests below meet in shared batches.
BUCKETS = ("[kv_cache]\ncpu_memory_gib = 0.1\n"
           "[embedding]\npreferred_batch_size = 4\nmax_queue_delay_ms = 1000.0\n")
TEXTS = ["The quick brown fox.", "Schnelle braune Füchse springen.", "🚀🎉 emoji",
         "東京は日本の首都です。", "one", "a rather longer sentence about embeddings and batching"]


@pytest.fixture(scope="module", params=["single", "ray", "ray-haproxy"])
def server(request, tmp_path_factory) -> LiveServer:
    """The single server, and the Ray Serve endpoint (2 replicas, the same [embedding] keys;
    tests/conftest.py ray_server and ray_haproxy_server)."""
    if request.param in ("ray", "ray-haproxy"):
        yield request.getfixturevalue(request.param.replace("-", "_") + "_server")
        return
    srv = start_server(tmp_path_factory.mktemp("emb-live"), "emb", BUCKETS, "--api-key",
                       API_KEY, "--embedding-model", "all-minilm-l6-v2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client(RAY_API_KEY if server.metrics_lag_s else API_KEY)


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")


def cosines(got, ref) -> np.ndarray:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))


def test_models_lists_the_embedding_model(client):
    assert "all-minilm-l6-v2" in [m.id for m in client.models.list().data]


@pytest.mark.parametrize("fmt", ["float", "base64", None])
def test_openai_client_float_and_base64(client, st_model, fmt):
    # fmt None: the client's default, which asks for base64 and decodes it itself.
    kw = {} if fmt is None else {"encoding_format": fmt}
    resp = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS, **kw)
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    assert resp.model == "all-minilm-l6-v2"
    if fmt == "base64":  # the client hands the raw string through
        vecs = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                for d in resp.data]
    else:
        vecs = [d.embedding for d in resp.data]
    assert all(len(v) == 384 for v in vecs)
    assert cosines(vecs, st_model.encode(TEXTS)).min() >= MIN_COSINE
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS)


def test_concurrent_single_requests_share_batches(server, client, st_model):
    before = server.metric("bucketserve_embedding_batch_size_count")
    inputs_before = server.metric("bucketserve_embedding_inputs_total")
    texts = [f"concurrent request number {i}" for i in range(8)]

    def one(text: str) -> list[float]:
        return client.embeddings.create(model="all-minilm-l6-v2", input=text,
                                        encoding_format="float").data[0].embedding

    with ThreadPoolExecutor(len(texts)) as pool:
        vecs = list(pool.map(one, texts))
    assert cosines(vecs, st_model.encode(texts)).min() >= MIN_COSINE
    assert server.metric("bucketserve_embedding_inputs_total") - inputs_before == len(texts)
    batches = server.metric("bucketserve_embedding_batch_size_count") - before
    assert batches < len(texts), "no two requests shared a batch"


def test_errors_in_openai_body(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="all-minilm-l6-v2", input=["fine", "word " * 300],
                                 encoding_format="float")
    assert "input[1] has 302 tokens" in e.value.body["message"]
    assert "256" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-minilm-l6-v2", input=[], encoding_format="float")
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model="all-minilm-l6-v2", input=["x"] * 2049,
                                 encoding_format="float")
    assert e.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x", encoding_format="float")
    bad_key = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.embeddings.create(model="all-minilm-l6-v2", input="x")


def test_deadline_header(client):
    resp = client.embeddings.create(model="all-minilm-l6-v2", input="on time",
                                    encoding_format="float",
                                    extra_headers={"X-Request-Deadline-Ms": "5000"})
    assert len(resp.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="all-minilm-l6-v2", input="x", encoding_format="float",
                                 extra_headers={"X-Request-Deadline-Ms": "soon"})
    assert e.value.body["code"] == "invalid_deadline"
    assert "X-Request-Deadline-Ms" in e.value.body["message"]
