"""POST /v1/embeddings: OpenAI's embeddings API over the length-bucketed EmbeddingBatcher.

Inputs: a string, a list of strings, a list of token ids, or a list of token-id lists. Strings
get the model's special tokens ([CLS] ... [SEP]); token ids are the complete model input.
`truncate_prompt_tokens` (-1: the model's maximum) truncates as sentence-transformers does.
Vectors come back in input order, as floats or base64 of little-endian float32. The header
`X-Request-Deadline-Ms: N` (0 < N <= the queue timeout) is this request's latency budget; it
replaces `[embedding] latency_slo_ms` for its inputs (engine/embedding_queue.py).

The route is a plain ASGI endpoint on the app, behind its middlewares (auth, body limit), not
a FastAPI route: on the 2-core CPU a FastAPI route here served 0.86x the embeddings of this one
(docs/architecture.md, Size). An `application/json` body is validated by pydantic's own JSON
parser into `EmbeddingRequest` (no FastAPI request handling); any other (one that fails, another
content type) goes through a FastAPI route over the same model, so its error body is the one
FastAPI gives. Clients that go away are found by the server's one watcher task
(server/generation.py until_disconnect), not a task per request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import glob
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import torch
from fastapi import APIRouter
from fastapi.routing import APIRoute
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from pydantic import Field, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from bucketserve.buckets import BucketsConfig, load_buckets
from bucketserve.engine.embedding_batcher import (
    QUEUE_DELAY_BUCKETS,
    BatcherStoppedError,
    EmbeddingBatcher,
    EncoderError,
    QueueTimeoutError,
    build_batcher,
    resolve_futures,
)
from bucketserve.engine.embedding_runner import CudaGraphRunner
from bucketserve.engine.faults import FaultPlan
from bucketserve.engine.outputs import QueueFullError
from bucketserve.models.bert_loader import LoadedEncoder, load_embedding_model
from bucketserve.server.errors import APIError, check_model, invalid_request, overloaded
from bucketserve.server.generation import ClientGone, until_disconnect
from bucketserve.server.metrics import size_buckets, slot_buckets
from bucketserve.server.protocol import Int, TextRequest, worker_tag
from bucketserve.server.request_log import RequestLog

log = logging.getLogger("bucketserve.embeddings")

# Requests with more inputs than this are serialised off the event loop.
_INLINE_RENDER_MAX = 64
# Requests with more texts than this are tokenized on their own, in parallel threads
# (asyncio.to_thread); smaller ones together with their neighbours (CoalescingTokenizer).
_COALESCE_MAX_TEXTS = 8

DEADLINE_HEADER = "X-Request-Deadline-Ms"
# The batcher's refusals (503 + Retry-After) and their error codes.
_REFUSALS = {QueueFullError: "queue_full", QueueTimeoutError: "queue_timeout",
             BatcherStoppedError: "shutting_down"}

_INPUT_KINDS = "a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(TextRequest):
    input: Any  # checked by parse_input, for messages that name the offending item
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    priority: Annotated[Int, Field(ge=-(2**63), le=2**63 - 1)] = 0  # lower runs first


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body, already read, given again first."""
    messages: list[Message] = [{"type": "http.request", "body": body}]

    async def replay() -> Message:
        return messages.pop() if messages else await receive()

    return replay


_encode = msgspec.json.encode
_Job = tuple[list[str], "int | None", asyncio.Future]


class CoalescingTokenizer:
    """Tokenizes the texts of concurrent requests together, off the event loop: while one
    `encode_batch` call runs in a helper thread (the tokenizers library encodes a batch on all
    cores, the GIL released), the requests that come join the next call, one per truncation
    length. So 64 clients sending one text each cost one call, and a lone request waits for no
    one. A call fails only for its truncation length (too short: a ValueError), so its
    exception is the answer of every request that asked for that length, and of no other."""

    def __init__(self, encode_batch: Any) -> None:
        self._encode = encode_batch
        self._pending: list[_Job] = []
        self._drainer: asyncio.Future | None = None

    async def encode(self, texts: list[str], max_len: int | None) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        drainer = self._drainer
        if drainer is None or drainer.done() or drainer.get_loop() is not loop:
            # (in-process tests run one event loop after another)
            self._pending = []
            self._drainer = asyncio.ensure_future(self._drain())
        future = loop.create_future()
        self._pending.append((texts, max_len, future))
        return await future

    async def _drain(self) -> None:
        while self._pending:
            jobs = [job for job in self._pending if not job[2].done()]  # cancelled: dropped
            self._pending = []
            results = await asyncio.to_thread(self._run, jobs)
            resolve_futures([(job[2], r) for job, r in zip(jobs, results, strict=True)])

    def _run(self, jobs: list[_Job]) -> list:
        """In the helper thread: per job, its token ids or the exception its call raised."""
        results: list = [None] * len(jobs)
        groups: dict[int | None, list[int]] = {}
        for i, (_, max_len, _) in enumerate(jobs):
            groups.setdefault(max_len, []).append(i)
        for max_len, members in groups.items():
            try:
                ids = iter(self._encode([t for i in members for t in jobs[i][0]], max_len))
                for i in members:
                    results[i] = list(itertools.islice(ids, len(jobs[i][0])))
            except Exception as exc:  # noqa: BLE001 - handed to each request of the group
                for i in members:
                    results[i] = exc
        return results


STATS_PUBLISH_S = 0.05  # how often a front end writes its batcher totals for the others


def _stats_snapshot(batcher: EmbeddingBatcher) -> dict[str, Any]:
    """The batcher's running totals (and its waiting requests) as plain JSON-able values."""
    s = batcher.stats
    return {"batches_per_bucket": dict(s.batches_per_bucket),
            "batch_size_counts": dict(s.batch_size_counts),
            "computed_tokens": s.computed_tokens, "useful_tokens": s.useful_tokens,
            "num_inputs": s.num_inputs, "num_requests": s.num_requests,
            "queue_delay_counts": list(s.queue_delay_counts),
            "queue_delay_sum_s": s.queue_delay_sum_s, "encoder_s": s.encoder_s,
            "merged_batches": s.merged_batches, "deadline_misses": s.deadline_misses,
            "waiting": batcher.num_waiting_requests}


def _add_snapshot(total: dict[str, Any], other: dict[str, Any]) -> None:
    """Adds `other` (read back from JSON: its dicts' keys are strings) into `total`."""
    for key, value in other.items():
        if isinstance(value, dict):
            into = total[key]
            for k, v in value.items():
                into[int(k)] = into.get(int(k), 0) + v
        elif isinstance(value, list):
            total[key] = [a + b for a, b in zip(total[key], value, strict=True)]
        else:
            total[key] += value


class BatcherStatsCollector(Collector):
    """The batcher's running totals as Prometheus metrics, read on every scrape.

    With several front ends (`serve --api-workers N`, prometheus multiprocess mode) each has
    its own batcher; then each also writes its totals to `shared_dir` (every
    STATS_PUBLISH_S while they change, on a daemon thread) and a scrape sums its own live
    totals with the other front ends' latest files, so any worker's /metrics shows the
    whole server's embeddings (the others' as of at most STATS_PUBLISH_S ago)."""

    def __init__(self, batcher: EmbeddingBatcher, shared_dir: str | None = None) -> None:
        self.batcher = batcher
        self.shared_dir = shared_dir
        self._path = (os.path.join(shared_dir, f"embedding-stats-{os.getpid()}.json")
                      if shared_dir else None)
        self._published: dict[str, Any] | None = None
        if shared_dir:
            self.publish()
            threading.Thread(target=self._publish_loop, name="embedding-stats",
                             daemon=True).start()

    def publish(self) -> None:
        """Writes this front end's totals for the others, when they changed (atomically)."""
        snap = _stats_snapshot(self.batcher)
        if snap == self._published or self._path is None:
            return
        tmp = self._path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, self._path)
        self._published = snap

    def _publish_loop(self) -> None:
        while True:
            time.sleep(STATS_PUBLISH_S)
            try:
                self.publish()
            except OSError as exc:  # the directory is gone: the server is stopping
                log.debug("embedding stats not published: %s", exc)
                return

    def totals(self) -> dict[str, Any]:
        """This front end's totals, plus every other front end's latest (multiprocess)."""
        total = _stats_snapshot(self.batcher)
        if self.shared_dir:
            for path in glob.glob(os.path.join(self.shared_dir, "embedding-stats-*.json")):
                if path == self._path:
                    continue
                try:
                    with open(path) as f:
                        _add_snapshot(total, json.load(f))
                except (OSError, ValueError) as exc:  # a worker's file mid-replace: skip it
                    log.debug("embedding stats of %s not read: %s", path, exc)
        return total

    def collect(self) -> Iterator[Any]:
        b = self.batcher
        t = self.totals()
        per_bucket = t["batches_per_bucket"]
        batches = CounterMetricFamily("bucketserve_embedding_batches",
                                      "Encoder batches run, per bucket length.", labels=["bucket"])
        for bucket in b.spec.boundaries:
            batches.add_metric([str(bucket)], per_bucket.get(bucket, 0))
        yield batches

        sizes = t["batch_size_counts"]
        yield HistogramMetricFamily("bucketserve_embedding_batch_size",
                                    "Inputs per encoder batch.",
                                    buckets=size_buckets(sizes, b.queue.preferred_batch_size),
                                    sum_value=sum(n * c for n, c in sizes.items()))
        yield HistogramMetricFamily("bucketserve_embedding_queue_delay_seconds",
                                    "Time an input waited in its bucket before its batch ran.",
                                    buckets=slot_buckets(QUEUE_DELAY_BUCKETS,
                                                         t["queue_delay_counts"]),
                                    sum_value=t["queue_delay_sum_s"])
        for name, value, doc in (
            ("bucketserve_embedding_computed_tokens", t["computed_tokens"],
             "Tokens run through the encoder, bucket padding included."),
            ("bucketserve_embedding_useful_tokens", t["useful_tokens"],
             "Real input tokens encoded."),
            ("bucketserve_embedding_inputs", t["num_inputs"], "Inputs encoded."),
            ("bucketserve_embedding_requests", t["num_requests"],
             "Embedding requests accepted."),
            ("bucketserve_embedding_encoder_seconds", t["encoder_s"],
             "Wall time the encoder spent running batches."),
            ("bucketserve_embedding_merged_batches", t["merged_batches"],
             "Batches merged from several buckets (embedding.max_merged_padding)."),
            ("bucketserve_embedding_deadline_misses", t["deadline_misses"],
             "Inputs whose batch finished after their deadline (latency_slo_ms or the "
             "X-Request-Deadline-Ms header)."),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("bucketserve_embedding_requests_waiting",
                                "Embedding requests queued or running.", value=t["waiting"])


class EncoderService:
    """What the embeddings and the rerank add-ons (server/app.py AddOn) share: a loaded BERT
    model behind its batcher, the router, and the batcher's errors as API errors."""

    def __init__(self, loaded: LoadedEncoder,
                 buckets: BucketsConfig) -> None:
        buckets = buckets.check_model(embedding_max_len=loaded.max_seq_length)
        self.loaded = loaded
        self.model_name = loaded.name
        self.batcher = build_batcher(loaded.model, loaded.config.pad_token_id, buckets)
        # Longest input served: the model's limit, or a smaller last bucket from the user's file.
        self.max_input_tokens = min(loaded.max_seq_length, self.batcher.spec.max_len)
        self.router = APIRouter()

    async def start(self) -> None:
        self.batcher.start()

    async def shutdown(self, timeout_s: float) -> None:
        await self.batcher.shutdown(timeout_s)

    def is_alive(self) -> bool:
        return self.batcher.is_alive()

    async def encode(self, rows: list[Any], **kw: Any) -> list[np.ndarray]:
        """batcher.embed, its refusals and failures as the API errors they answer."""
        try:
            return await self.batcher.embed(rows, **kw)
        except tuple(_REFUSALS) as exc:
            raise overloaded(str(exc), _REFUSALS[type(exc)]) from exc
        except EncoderError as exc:
            raise APIError(500, str(exc), "server_error", None, "encoder_error") from exc


class EmbeddingService(EncoderService):
    """The /v1/embeddings add-on."""

    def __init__(self, loaded: LoadedEncoder, buckets: BucketsConfig,
                 faults: FaultPlan | None = None) -> None:
        """`faults`: a test's injected encoder failures (engine/faults.py)."""
        super().__init__(loaded, buckets)
        self.batcher.faults = faults
        self.max_inputs = buckets.embedding.max_inputs_per_request
        # several front ends: each publishes its totals, any /metrics sums them
        self.metrics_collector = BatcherStatsCollector(
            self.batcher, os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None)
        self.tokenizer = CoalescingTokenizer(loaded.tokenizer.encode_batch)
        # the service as a plain ASGI app (a class instance: starlette's Route calls it as it
        # is, without its request/response wrapping), and FastAPI's route for the other bodies
        self.router.add_route("/v1/embeddings", self, methods=["POST"])
        self.fastapi_route = APIRoute("/v1/embeddings", self._answer, methods=["POST"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/embeddings: one request, from its ASGI messages to its response."""
        request = Request(scope, receive)
        try:
            body = await request.body()
        except ClientDisconnect:  # the client left before sending its body
            return
        decoded = None
        if body and request.headers.get("content-type") == "application/json":
            with contextlib.suppress(ValidationError):
                decoded = EmbeddingRequest.model_validate_json(body)
        if decoded is None:  # FastAPI finds the error and words it, or reads the body
            await self.fastapi_route.handle(scope, _replay(body, receive), send)
        else:
            await (await self._answer(decoded, request))(scope, receive, send)

    async def _answer(self, body: EmbeddingRequest, request: Request) -> Response:
        """The response to one decoded request (APIError when it cannot be served)."""
        ctx = getattr(request.app.state, "ctx", None)
        if ctx is not None and ctx.inflight.draining:
            raise overloaded("the server is shutting down; retry later", "shutting_down")
        request_log = getattr(getattr(ctx, "metrics", None), "request_log", None)
        try:  # a client gone drops its inputs that are still queued (batcher.embed)
            content = await until_disconnect(
                request, self.create(body, request_log, request.headers.get(DEADLINE_HEADER)))
        except ClientGone:  # nobody reads it; nginx's "client closed request"
            return Response(status_code=499)
        tag = worker_tag()  # --api-workers: which front end answered
        return Response(content, media_type="application/json",
                        headers=None if tag is None else {"x-bucketserve-worker": tag})

    async def create(self, body: EmbeddingRequest,
                     request_log: RequestLog | None = None,
                     deadline_header: str | None = None) -> bytes:
        """The response body for one decoded request (APIError when it cannot be served)."""
        arrival = time.monotonic()
        budget_s = parse_deadline_ms(deadline_header, self.batcher.queue.queue_timeout_s)
        self._check_fields(body)
        token_ids = await self._token_ids(body)
        vectors = await self.encode(token_ids, priority=body.priority, budget_s=budget_s,
                                    arrival=arrival)
        lengths = [len(ids) for ids in token_ids]
        used = sum(lengths)
        if request_log is not None:
            lookup = self.batcher.spec.lookup
            request_log.record_embeddings(arrival, lengths, [lookup(n) for n in lengths])
        args = (vectors, body.encoding_format, self.model_name, used)
        if len(vectors) <= _INLINE_RENDER_MAX:
            return _render(*args)
        # a large float body takes long to serialise: keep the event loop free
        return await asyncio.to_thread(_render, *args)

    def _check_fields(self, body: EmbeddingRequest) -> None:
        check_model(body.model, self.model_name, "/v1/embeddings")
        dim = self.loaded.model.embedding_dim
        if body.dimensions is not None and body.dimensions != dim:
            raise invalid_request(f"{self.model_name} returns {dim}-dimensional vectors and "
                                  f"cannot shorten them; omit dimensions or set it to {dim}",
                                  "dimensions")
        limit, trunc = self.max_input_tokens, body.truncate_prompt_tokens
        if trunc is not None and not (trunc == -1 or 1 <= trunc <= limit):
            raise invalid_request(f"truncate_prompt_tokens must be 1 to {limit} (the model's "
                                  f"maximum input length) or -1 for the maximum; got {trunc}",
                                  "truncate_prompt_tokens")

    async def _token_ids(self, body: EmbeddingRequest) -> list[list[int]]:
        """Token ids per input (truncated when asked); refuses empty, too many, too long
        inputs and token ids outside the vocabulary."""
        inputs = parse_input(body.input)
        if len(inputs) > self.max_inputs:
            raise APIError(413, f"input has {len(inputs)} items, over the limit of "
                           f"{self.max_inputs} per request (embedding.max_inputs_per_request); "
                           "split it into several requests", "invalid_request_error", "input",
                           "too_many_inputs")
        limit = self.max_input_tokens
        max_len = limit if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        if isinstance(inputs[0], str):
            texts: list[str] = inputs  # type: ignore[assignment]
            try:
                if len(texts) <= _COALESCE_MAX_TEXTS:
                    token_ids = await self.tokenizer.encode(texts, max_len)
                else:
                    token_ids = await asyncio.to_thread(self.loaded.tokenizer.encode_batch,
                                                        texts, max_len)
            except ValueError as exc:
                raise invalid_request(str(exc), "truncate_prompt_tokens") from exc
        else:
            token_ids = [ids[:max_len] for ids in inputs]  # type: ignore[misc]
        vocab = self.loaded.config.vocab_size
        for i, ids in enumerate(token_ids):
            if len(ids) > limit:
                raise invalid_request(
                    f"input[{i}] has {len(ids)} tokens, over the model's maximum input length "
                    f"of {limit} tokens; shorten it or set truncate_prompt_tokens (-1 truncates "
                    "to the maximum)", "input", "input_too_long")
            if max(ids) >= vocab:
                raise invalid_request(f"input[{i}] has token id {max(ids)}, outside the "
                                      f"vocabulary (0..{vocab - 1})", "input")
        return token_ids


def parse_deadline_ms(value: str | None, max_s: float) -> float | None:
    """The X-Request-Deadline-Ms header as a budget in seconds (None: not sent)."""
    if value is None:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= max_s * 1000.0):
        raise invalid_request(f"header {DEADLINE_HEADER} must be a number of milliseconds > 0 "
                              f"and at most {max_s * 1000.0:g} (the queue timeout); got "
                              f"{value[:40]!r}", DEADLINE_HEADER, "invalid_deadline")
    return ms / 1000.0


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse_input(inp: Any) -> list[str] | list[list[int]]:
    """The request's `input` as a non-empty list of strings or of token-id lists."""
    if isinstance(inp, str) or (isinstance(inp, list) and inp and _is_token_id(inp[0])):
        inp = [inp]
    if not isinstance(inp, list):
        raise invalid_request(f"input must be {_INPUT_KINDS}; got {type(inp).__name__}", "input")
    if not inp:
        raise invalid_request(f"input is empty; send {_INPUT_KINDS}", "input")
    strings = isinstance(inp[0], str)
    for i, item in enumerate(inp):
        if not (isinstance(item, str) if strings
                else isinstance(item, list) and all(map(_is_token_id, item))):
            kind = "a string" if strings else "a list of non-negative integer token ids"
            raise invalid_request(f"input[{i}] must be {kind} like input[0] (input must be "
                                  f"{_INPUT_KINDS}); got {json.dumps(item)[:60]}", "input")
        if len(item) == 0:
            raise invalid_request(f"input[{i}] is empty; every input needs at least one "
                                  "character or token", "input")
    return inp


def base64_rows_bytes(mat: np.ndarray) -> list[bytes]:
    """OpenAI's base64 encoding of each row of mat [N, D] (the row's little-endian float32
    bytes), as ASCII bytes. When a row is a multiple of 3 bytes (D % 3 == 0: 384, 768, ...),
    base64 of the whole matrix splits exactly at row boundaries: one encode for the batch,
    then slices."""
    mat = np.ascontiguousarray(mat, dtype="<f4")
    row_bytes = mat.shape[1] * 4
    if row_bytes % 3:
        return [base64.b64encode(row.tobytes()) for row in mat]
    text = base64.b64encode(mat.tobytes())
    step = row_bytes // 3 * 4
    return [text[i:i + step] for i in range(0, len(text), step)]


def _render(vectors: list[np.ndarray], encoding_format: str, model: str, used: int) -> bytes:
    """OpenAI's response body, vectors in input order, written as bytes: floats are each
    float32's value as a JSON number that reads back to it (msgspec writes the shortest
    decimal of the double), base64 strings need no escaping."""
    mat = np.stack(vectors)  # [N, D] float32
    if encoding_format == "base64":
        items = [b'"' + row + b'"' for row in base64_rows_bytes(mat)]
    else:
        items = [_encode(row) for row in mat.tolist()]
    data = b",".join([b'{"object":"embedding","index":%d,"embedding":%s}' % (i, e)
                      for i, e in enumerate(items)])
    return (b'{"object":"list","data":[' + data + b'],"model":' + _encode(model)
            + b',"usage":{"prompt_tokens":%d,"total_tokens":%d}}' % (used, used))


def build_add_on(model: str = "all-minilm-l6-v2", device: str = "cpu",
                 dtype: torch.dtype = torch.float32,
                 buckets: BucketsConfig | None = None,
                 faults: FaultPlan | None = None) -> EmbeddingService:
    """Load the embedding model and build its service (cli.py calls this for --embedding-model);
    on CUDA this captures the encoder's graphs (logged: how many, how long, how much memory)."""
    loaded = load_embedding_model(model, device=device, dtype=dtype)
    service = EmbeddingService(loaded, buckets if buckets is not None else load_buckets(), faults)
    if not isinstance(service.batcher.runner, CudaGraphRunner):  # one tiny forward: the
        # first request pays no lazy set-up
        ids = torch.zeros((1, service.batcher.spec.boundaries[0]), dtype=torch.long,
                          device=device)
        loaded.model(ids, torch.ones_like(ids, dtype=torch.bool))
    return service
