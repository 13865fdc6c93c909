"""POST /v1/rerank (Cohere / Jina shape, as vLLM and TEI serve it) and /v1/score (vLLM's
{text_1, text_2}) for a BERT cross-encoder (`serve --rerank-model DIR`).

Each (query, document) pair is one row `[CLS] query [SEP] document [SEP]` of token ids and goes
through the same length-bucketed encoder batcher as embeddings (engine/embedding_batcher.py);
the model (models/bert.BertCrossEncoder) derives the token types from the ids and returns the
relevance score (the sigmoid of a one-label classifier, as sentence-transformers'
CrossEncoder.predict reports it). A pair longer than the model's limit is a 400 naming the
field (no silent truncation).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from bucketserve.buckets import BucketsConfig
from bucketserve.models.bert_loader import LoadedEncoder, load_cross_encoder
from bucketserve.server.embeddings import EncoderService
from bucketserve.server.errors import check_model, invalid_request
from bucketserve.server.protocol import Bool, Int, _Request, new_id, now

MAX_DOCUMENTS = 1024


class RerankRequest(_Request):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: Int | None = Field(default=None, ge=1)
    return_documents: Bool = False


class ScoreRequest(_Request):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankService(EncoderService):
    """The rerank / score add-on: a cross-encoder behind a batcher."""

    def __init__(self, loaded: LoadedEncoder, buckets: BucketsConfig) -> None:
        super().__init__(loaded, buckets)
        self.router.add_api_route("/v1/rerank", self.rerank, methods=["POST"])
        self.router.add_api_route("/v1/score", self.score, methods=["POST"])

    async def pair_scores(self, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
        """(score per pair, tokens in all) through the batcher."""
        texts = sorted({t for p in pairs for t in p})
        ids = dict(zip(texts, await asyncio.to_thread(self.loaded.tokenizer.encode_batch, texts),
                       strict=True))
        rows = [ids[a] + ids[b][1:] for a, b in pairs]  # [CLS] a [SEP] + b [SEP]
        for i, row in enumerate(rows):
            if len(row) > self.max_input_tokens:
                raise invalid_request(f"pair {i} has {len(row)} tokens; the rerank model takes "
                                      f"at most {self.max_input_tokens}", param)
        out = await self.encode(rows)
        return [float(v[0]) for v in out], sum(map(len, rows))

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        check_model(body.model, self.model_name, "/v1/rerank")
        scores, tokens = await self.pair_scores([(body.query, d) for d in body.documents],
                                                "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
        results = []
        for i in order:
            r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                r["document"] = {"text": body.documents[i]}
            results.append(r)
        return {"id": new_id("rerank"), "model": self.model_name, "results": results,
                "usage": {"total_tokens": tokens}}

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        check_model(body.model, self.model_name, "/v1/score")
        a = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        b = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not a or not b or not all(a) or not all(b):
            raise invalid_request("text_1 and text_2 must be non-empty texts", "text_1")
        if len(a) == 1:
            a = a * len(b)
        if len(a) != len(b):
            raise invalid_request(f"text_1 has {len(a)} texts and text_2 {len(b)}: send one "
                                  "text_1, or as many as text_2", "text_2")
        if len(a) > MAX_DOCUMENTS:
            raise invalid_request(f"at most {MAX_DOCUMENTS} pairs per request", "text_2")
        scores, tokens = await self.pair_scores(list(zip(a, b, strict=True)), "text_2")
        return {"id": new_id("score"), "object": "list", "created": now(),
                "model": self.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def build_add_on(path: str, device: str, dtype, buckets: BucketsConfig) -> RerankService:
    return RerankService(load_cross_encoder(path, device=device, dtype=dtype), buckets)
