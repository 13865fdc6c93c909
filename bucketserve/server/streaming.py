"""Server-sent events for both endpoints (sse-starlette).

Framing: each event is one `data: {json}` line followed by a blank line; the stream ends
with `data: [DONE]`. A stream is only started once the engine has produced its first
output: a request refused by the engine (queue full) or one that timed out in the queue
gets a plain HTTP error (503 + Retry-After) rather than a 200 stream holding an error.
A failure after the first token (engine died, server shutdown) is sent as one
`data: {"error": {...}}` event, then `data: [DONE]`, which the openai client raises as
an APIError.

Disconnects: sse-starlette cancels the event generator when the client goes away; its
`finally` closes the engine stream, which aborts every unfinished choice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response

from bucketserve.engine.outputs import RequestOutput
from bucketserve.server.errors import APIError
from bucketserve.server.generation import ClientGone, InFlight, finish_error, until_disconnect

PING_S = 15  # keep-alive comment lines for proxies; clients ignore them
# A send that the client does not take within this time ends the stream (and, through the
# event generator's cleanup, the engine requests behind it).
SEND_TIMEOUT_S = 30.0


class ChunkFormatter(Protocol):
    """Turns engine outputs into the JSON chunks of one endpoint's stream."""

    def opening(self) -> list[dict[str, Any]]: ...
    def on_output(self, index: int, out: RequestOutput) -> list[dict[str, Any]]: ...
    def closing(self) -> list[dict[str, Any]]: ...


def _event(payload: dict[str, Any] | str) -> ServerSentEvent:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return ServerSentEvent(data=data, sep="\n")


async def stream_response(
    request: Request,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    formatter: ChunkFormatter,
    inflight: InFlight,
) -> Response:
    """Waits for the first output (watching the client), then streams the rest as SSE."""
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
    return EventSourceResponse(_events(first, outputs, formatter, inflight), sep="\n", ping=PING_S,
                               send_timeout=SEND_TIMEOUT_S)


async def _events(
    first: tuple[int, RequestOutput],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    formatter: ChunkFormatter,
    inflight: InFlight,
) -> AsyncIterator[ServerSentEvent]:
    try:
        for chunk in formatter.opening():
            yield _event(chunk)
        index, out = first
        while True:
            err = finish_error(out, inflight)
            if err is not None:
                yield _event(err.body())
                break
            for chunk in formatter.on_output(index, out):
                yield _event(chunk)
            try:
                index, out = await anext(outputs)
            except StopAsyncIteration:
                for chunk in formatter.closing():
                    yield _event(chunk)
                break
            except APIError as exc:
                yield _event(exc.body())
                break
        yield _event("[DONE]")
    finally:
        # Cancellation (client gone) is level-triggered under anyio: shield the cleanup.
        with anyio.CancelScope(shield=True):
            async with aclosing(outputs):
                pass
