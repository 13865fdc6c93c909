"""Server-sent events for both endpoints.

Framing: each event is one `data: {json}` line followed by a blank line; the stream ends
with `data: [DONE]`. A stream is only started once the engine has produced its first
output: a request refused by the engine (queue full) or one that timed out in the queue
gets a plain HTTP error (503 + Retry-After) rather than a 200 stream holding an error.
A failure after the first token (engine died, server shutdown) is sent as one
`data: {"error": {...}}` event, then `data: [DONE]`, which the openai client raises as
an APIError.

This is the per-token path of the server, so it is lean (bench/frontend_capacity.py
measures it): chunks are encoded straight to bytes (msgspec), everything one engine output
makes is one ASGI send (one HTTP chunk, written to the socket at once: no timer, no
coalescing), and `SSEResponse` is a plain ASGI response rather than sse-starlette's (which
wrapped every send in its own cancel scope).

One event per engine step per choice: AsyncEngine.generate hands over each step's output on
its own, also to a stream that fell behind, so a client's inter-token gaps show the engine's
steps (or the front end's own delay), not a merge. An output whose text is held back (a
partial character, a possible stop-string prefix) makes no event; its tokens go out with the
next. /metrics counts, per endpoint, the events that carried tokens and the tokens they
carried (bucketserve_sse_token_events_total, bucketserve_sse_tokens_total; the ratio is
tokens per event). One background
task per stream watches for the client's disconnect; a timer sends a keep-alive comment
after PING_S idle seconds and ends a stream whose send has been stuck for SEND_TIMEOUT_S.

Disconnects: the stream's task group is cancelled when the client goes away; the event
generator's `finally` closes the engine stream, which aborts every unfinished choice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from bucketserve.engine.outputs import RequestOutput
from bucketserve.server.errors import APIError
from bucketserve.server.generation import ClientGone, InFlight, finish_error, until_disconnect
from bucketserve.server.metrics import ServerMetrics

PING_S = 15  # keep-alive comment lines for proxies; clients ignore them
# A send that the client does not take within this time ends the stream (and, through the
# event generator's cleanup, the engine requests behind it).
SEND_TIMEOUT_S = 30.0


class ChunkFormatter(Protocol):
    """Turns engine outputs into the JSON chunks of one endpoint's stream."""

    def opening(self) -> list[dict[str, Any]]: ...
    def on_output(self, index: int, out: RequestOutput) -> list[dict[str, Any]]: ...
    def closing(self) -> list[dict[str, Any]]: ...


_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    try:
        data = _encode(payload)
    except (UnicodeEncodeError, msgspec.EncodeError):  # e.g. a lone surrogate: JSON escapes it
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return b"data: " + data + b"\n\n"


class SSEResponse(Response):
    """Streams the byte events of `events` as text/event-stream (see the module doc).
    (A starlette Response only so that FastAPI hands it to the server as it is.)"""

    def __init__(self, events: AsyncIterator[bytes], ping_s: float = PING_S,
                 send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.ping_s, self.send_timeout_s = ping_s, send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lock = asyncio.Lock()
        last_sent = time.monotonic()
        sending_since: float | None = None

        async def send_body(data: bytes) -> None:
            nonlocal last_sent, sending_since
            async with lock:
                sending_since = time.monotonic()
                await send({"type": "http.response.body", "body": data, "more_body": True})
                last_sent, sending_since = time.monotonic(), None

        async def watch(scope_: anyio.CancelScope) -> None:
            while True:
                if (await receive())["type"] == "http.disconnect":
                    scope_.cancel()
                    return

        async def timer(scope_: anyio.CancelScope) -> None:
            tick = min(self.ping_s, self.send_timeout_s) / 3
            while True:
                await anyio.sleep(tick)
                now = time.monotonic()
                if sending_since is not None and now - sending_since > self.send_timeout_s:
                    scope_.cancel()  # the client stopped reading
                    return
                if sending_since is None and now - last_sent >= self.ping_s:
                    await send_body(PING)

        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]})
        complete = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                tg.start_soon(timer, tg.cancel_scope)
                async for data in self.events:
                    await send_body(data)
                complete = True
                tg.cancel_scope.cancel()
            if complete:  # (not to a client that left or stopped reading)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()


async def stream_response(
    request: Request,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    formatter: ChunkFormatter,
    inflight: InFlight,
    metrics: ServerMetrics,
    endpoint: str,
) -> Response:
    """Waits for the first output (watching the client), then streams the rest as SSE;
    `endpoint` labels the stream's events in `metrics`."""
    try:
        first = await until_disconnect(request, anext(outputs))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    except APIError as err:
        await outputs.aclose()
        return err.response()
    err = finish_error(first[1], inflight)
    if err is not None:
        await outputs.aclose()
        return err.response()
    return SSEResponse(_events(first, outputs, formatter, inflight, metrics, endpoint))


async def _events(
    first: tuple[int, RequestOutput],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    formatter: ChunkFormatter,
    inflight: InFlight,
    metrics: ServerMetrics,
    endpoint: str,
) -> AsyncIterator[bytes]:
    pending: dict[int, int] = {}  # choice -> tokens not yet sent (text held back)
    events = tokens = 0
    try:
        opening = b"".join(_event(chunk) for chunk in formatter.opening())
        index, out = first
        while True:
            err = finish_error(out, inflight)
            if err is not None:
                yield opening + _event(err.body()) + DONE
                return
            chunks = formatter.on_output(index, out)
            held = pending.get(index, 0) + len(out.new_token_ids)
            if chunks and held:
                events += 1
                tokens += held
                held = 0
            pending[index] = held
            data = opening + b"".join(_event(c) for c in chunks)
            opening = b""
            if data:
                yield data
            try:
                index, out = await anext(outputs)
            except StopAsyncIteration:
                yield b"".join(_event(c) for c in formatter.closing()) + DONE
                return
            except APIError as exc:
                yield _event(exc.body()) + DONE
                return
    finally:
        # Cancellation (client gone) is level-triggered under anyio: shield the cleanup.
        with anyio.CancelScope(shield=True):
            metrics.count_stream(endpoint, events, tokens)
            async with aclosing(outputs):
                pass
