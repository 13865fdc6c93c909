"""/v1/rerank and /v1/score (server/rerank.py) against sentence-transformers' CrossEncoder on
the same weights. No PyPI package ships a BERT cross-encoder's weights (searched the package
list for cross-encoder / rerank / ms-marco models), so the model is a BertForSequenceClassification
(num_labels 1) with random weights and all-MiniLM-L6-v2's tokenizer, saved to a temp dir."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from bucketserve.buckets import load_buckets
from bucketserve.server.errors import install_exception_handlers
from bucketserve.server.rerank import build_add_on

QUERY = "how do plants make food"
DOCS = ["Photosynthesis turns light, water and carbon dioxide into sugar.",
        "The stock market fell sharply on Monday.",
        "Plants", "Chlorophyll absorbs light in the leaves of green plants, which use it to "
        "make glucose; " * 3, "a b c"]


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory):
    from conftest import minilm_dir
    from transformers import BertConfig, BertForSequenceClassification

    d = tmp_path_factory.mktemp("cross")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, num_labels=1)
    model = BertForSequenceClassification(cfg)
    for p in model.parameters():  # wider than the init's 0.02 so the scores spread out
        p.data.normal_(0, 0.2)
    model.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir() / f).is_file():
            shutil.copy(minilm_dir() / f, d / f)
    return d


@pytest.fixture(scope="module")
def reference(cross_dir):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(cross_dir), device="cpu")
    return {
        "rerank": ce.predict([(QUERY, d) for d in DOCS]),
        "score": ce.predict([("a cat", "a dog"), ("one", "two three")]),
    }


@pytest.fixture(scope="module")
def client(cross_dir):
    service = build_add_on(str(cross_dir), "cpu", torch.float32, load_buckets(None))
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(service.router)

    @app.on_event("startup")
    async def start() -> None:
        await service.start()

    with TestClient(app) as c:
        yield c


def test_rerank_matches_cross_encoder(client, reference):
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                        "return_documents": True})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    ref = reference["rerank"]
    assert len(set(np.round(ref, 3))) == len(DOCS)  # distinct scores: the order means something
    assert [x["index"] for x in results] == list(np.argsort(-ref))
    for x in results:
        assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-4
        assert x["document"] == {"text": DOCS[x["index"]]}
    top = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [x["index"] for x in top["results"]] == list(np.argsort(-ref)[:2])
    assert "document" not in top["results"][0]


def test_score_matches_cross_encoder(client, reference):
    r = client.post("/v1/score", json={"text_1": ["a cat", "one"], "text_2": ["a dog", "two three"]})
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    assert np.allclose(got, reference["score"], atol=1e-4)
    one = client.post("/v1/score", json={"text_1": "a cat", "text_2": "a dog"}).json()
    assert abs(one["data"][0]["score"] - reference["score"][0]) < 1e-4


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["x " * 300]}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["x"], "top_n": 0}, 400, "top_n"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2"),
    # another model: 404 model_not_found, as on every other route
    ("/v1/score", {"text_1": "a", "text_2": "b", "model": "nope"}, 404, "model"),
    ("/v1/rerank", {"query": "q", "documents": ["x"], "model": "nope"}, 404, "model"),
])
def test_bad_requests(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    if status == 404:
        assert r.json()["error"]["code"] == "model_not_found"
