"""The lean /v1/embeddings route validates JSON bodies with pydantic's JSON parser and hands
the rest to a FastAPI route over the same EmbeddingRequest (server/embeddings.py,
EmbeddingService): every body must come out as FastAPI's handling of EmbeddingRequest made it,
the same fields for a valid one, the same status and error body for a bad one. The reference
here is a FastAPI route over EmbeddingRequest, in the same process; the service's `create` is
replaced by one that answers the fields it was given."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from bucketserve.buckets import load_buckets
from bucketserve.models.bert_loader import load_embedding_model
from bucketserve.server.embeddings import EmbeddingRequest, EmbeddingService, _render
from bucketserve.server.errors import install_exception_handlers

FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
          "priority")
JSON = "application/json"
DEEP = b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b', "input": "a"}'

CASES: list[tuple[bytes, str | None]] = [
    (b'{"input": "hello"}', JSON),
    (b'{"input": ["a", "b"], "model": "m", "encoding_format": "base64", "user": "u"}', JSON),
    (b'{"input": [[101, 102]], "truncate_prompt_tokens": -1, "priority": -5}', JSON),
    (b'{"input": "x", "dimensions": 384, "extra": {"nested": [1, 2]}}', JSON),
    (b'{"input": "x", "input": "y"}', JSON),  # duplicate key: the last wins
    (b'{"input": null}', JSON),
    (b'{"input": "x", "extra": NaN}', JSON),  # Python's json takes NaN; msgspec does not
    (b'{"input": [NaN]}', JSON),
    (b'{"input": "\\ud83d\\ude00"}', JSON),  # a surrogate pair is text
    (b'{"input": "x", "priority": 9223372036854775807}', JSON),
    (b'{"input": [1, 2, 123456789012345678901234567890]}', JSON),
    (b'{"input": "hello"}', "application/vnd.api+json"),
    (b'{"input": "hello"}', "application/json; charset=utf-8"),
    # refused
    (b'{"input": "\\ud800"}', JSON),
    (b'{"input": ["fine", "\\udc00x"]}', JSON),
    (b'{"input": "x", "extra": "\\ud800"}', JSON),
    (b'{"input": "x", "dimensions": true}', JSON),
    (b'{"input": "x", "dimensions": 1.0}', JSON),
    (b'{"input": "x", "dimensions": "3"}', JSON),
    (b'{"input": "x", "priority": 9223372036854775808}', JSON),
    (b'{"input": "x", "truncate_prompt_tokens": -2}', JSON),
    (b'{"input": "x", "encoding_format": "int8"}', JSON),
    (b'{"input": "x", "model": 5}', JSON),
    (b'{"input": "x", "user": ["u"]}', JSON),
    (b'{"model": "m"}', JSON),
    (b"{}", JSON),
    (b"[]", JSON),
    (b"null", JSON),
    (b"0", JSON),
    (b'"input"', JSON),
    (b'{"input": "x"', JSON),
    (b"\xff{}", JSON),
    (b"", JSON),
    (b'{"input": "hello"}', None),  # no content type: FastAPI does not read it as JSON
    (b'{"input": "hello"}', "text/plain"),
    (b'{"input": "hello"}', "application/x-www-form-urlencoded"),
    (DEEP, JSON),
]


def reference_app() -> FastAPI:
    app = FastAPI()
    install_exception_handlers(app)

    @app.post("/v1/embeddings")
    async def ref(body: EmbeddingRequest) -> dict:
        return {"fields": repr([getattr(body, f) for f in FIELDS])}

    return app


@pytest.fixture(scope="module")
def service_app() -> tuple[FastAPI, list[str]]:
    """The service's route with `create` answering the fields; the path ("lean" or
    "fastapi") each body that reached `create` took."""
    service = EmbeddingService(load_embedding_model("all-minilm-l6-v2"), load_buckets())
    paths: list[str] = []
    in_fastapi = False

    async def create(body, request_log=None, deadline_header=None) -> bytes:
        paths.append("fastapi" if in_fastapi else "lean")
        return json.dumps({"fields": repr([getattr(body, f) for f in FIELDS])}).encode()

    async def handle(scope, receive, send) -> None:
        nonlocal in_fastapi
        in_fastapi = True
        try:
            await fastapi_handle(scope, receive, send)
        finally:
            in_fastapi = False

    service.create = create
    fastapi_handle, service.fastapi_route.handle = service.fastapi_route.handle, handle
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(service.router)
    return app, paths


def post_all(app: FastAPI, bodies: list[tuple[bytes, str | None]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out = []
            for body, ctype in bodies:
                headers = {} if ctype is None else {"content-type": ctype}
                out.append(await client.post("/v1/embeddings", content=body, headers=headers))
            return out

    return asyncio.run(go())


def test_the_route_decodes_as_fastapi_does_on_every_case(service_app):
    app, paths = service_app
    paths.clear()
    for (body, ctype), ref, got in zip(CASES, post_all(reference_app(), CASES),
                                       post_all(app, CASES), strict=True):
        assert got.status_code == ref.status_code, (body[:80], ctype, ref.text, got.text)
        assert got.json() == ref.json(), (body[:80], ctype)
    # the plain requests took the lean path, the valid others (a +json content type, ...)
    # FastAPI's route
    assert paths.count("lean") >= 8 and "fastapi" in paths


def test_surrogate_and_type_errors_name_their_field(service_app):
    app, _ = service_app
    surrogate, fmt = post_all(app, [(b'{"input": ["fine", "\\ud800"]}', JSON),
                                    (b'{"input": "x", "encoding_format": "int8"}', JSON)])
    err = surrogate.json()["error"]
    assert surrogate.status_code == 400 and err["param"] == "input"
    assert "surrogate" in err["message"]
    assert fmt.json()["error"]["param"] == "encoding_format"


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_render_matches_the_json_of_the_vectors(fmt):
    rng = np.random.default_rng(0)
    mat = rng.standard_normal((5, 384)).astype(np.float32)
    mat[0, :4] = [0.0, -0.0, 1e-30, 3.4e38]
    body = json.loads(_render(list(mat), fmt, "a \"model\" ☃", 17))
    assert body["object"] == "list" and body["model"] == "a \"model\" ☃"
    assert body["usage"] == {"prompt_tokens": 17, "total_tokens": 17}
    assert [d["index"] for d in body["data"]] == list(range(5))
    assert all(d["object"] == "embedding" for d in body["data"])
    if fmt == "float":
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float64)
        assert np.array_equal(got.astype(np.float32), mat)  # every float32 reads back exactly
        assert np.array_equal(got, mat.astype(np.float64))
    else:
        import base64

        got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                        for d in body["data"]])
        assert np.array_equal(got, mat)
