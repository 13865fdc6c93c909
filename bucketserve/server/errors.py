"""OpenAI-style error bodies and the handlers that guarantee every failure gets one.

Body: {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}.
Client mistakes are 4xx with type "invalid_request_error"; overload is 503 with Retry-After;
anything unexpected is logged with its traceback and answered 500, the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("bucketserve.server")

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before retrying
LONE_SURROGATE = "lone_surrogate"  # pydantic error type raised by protocol.check_text


class APIError(Exception):
    """Raised anywhere in a handler; turned into an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message that quotes the client's input renders even
    when that input holds characters UTF-8 cannot encode (lone surrogates)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_body(message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def check_model(name: str | None, served: str, where: str = "this server") -> None:
    """404 model_not_found unless the request named no model or the one `where` serves."""
    if name is not None and name != served:
        raise APIError(404, f"the model {name!r} does not exist here; {where} serves {served!r} "
                       "(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")


def overloaded(message: str, code: str) -> APIError:
    return APIError(503, message, "server_overloaded", None, code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the offending top-level field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == LONE_SURROGATE:
        return first["msg"], first.get("ctx", {}).get("param")
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"request body is not valid JSON ({detail})", None
    if first.get("type") == "missing" and not loc:
        return "request body is missing; send a JSON object", None
    if loc and loc[0] == "prompt":  # a union: pydantic's per-member errors read poorly
        return ("prompt must be a string, a list of strings, a list of token ids, or a list "
                "of token-id lists"), "prompt"
    if len(loc) >= 3 and loc[0] == "messages" and loc[2] == "content":
        return (f"messages[{loc[1]}].content must be a string or a list of text parts "
                '({"type": "text", "text": ...}); only text is supported'), "messages"
    where = ".".join(loc)
    msg = first.get("msg", "invalid value")
    if where:
        msg = f"{where}: {msg}"
    if "input" in first and first.get("type") != "missing":
        shown = json.dumps(first["input"], default=str)
        if len(shown) <= 80:
            msg += f" (got {shown})"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s))"
    return msg, (loc[0] if loc else None)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return invalid_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        err = APIError(exc.status_code, message, "invalid_request_error",
                       code=exc.status_code, headers=dict(exc.headers or {}))
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # the last resort, for a failure outside UnexpectedErrorMiddleware (which answers
        # everything raised by the routes)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error(exc)

    # The innermost of the user middlewares: added first.
    app.add_middleware(UnexpectedErrorMiddleware)


def internal_error(exc: BaseException) -> JSONResponse:
    return ErrorResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                    "internal_server_error", None, 500), status_code=500)


class UnexpectedErrorMiddleware:
    """Answers an exception no handler took with a 500 error body, and keeps the connection.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then drops the
    keep-alive connection without `Connection: close`: the client's next request on it fails.
    Here the exception ends with its response. If the response had already started (a
    stream), nothing can be sent: the exception goes on and the connection is closed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await internal_error(exc)(scope, receive, send)


MAX_HEADER_BYTES = 32 * 1024  # names + values of all request headers together
DEFAULT_BODY_TIMEOUT_S = 60.0  # the whole request body must arrive within this time


class BodySizeLimitMiddleware:
    """Answers 413 to any request whose body is over `max_bytes`, 431 to one whose headers
    together are over `max_header_bytes`.

    Checks Content-Length up front, then reads the body itself (counting bytes, so chunked
    bodies without the header are caught too) and replays it to the app in one message.
    Later receive() calls go straight through, so disconnect detection still works."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 max_header_bytes: int = MAX_HEADER_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) for k, v in scope.get("headers", []))
        if header_bytes > self.max_header_bytes:
            body = error_body(f"the request headers hold {header_bytes} bytes, over the limit "
                              f"of {self.max_header_bytes} bytes", "invalid_request_error",
                              None, "headers_too_large")
            await ErrorResponse(body, status_code=431)(scope, _no_receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(scope, send, int(value))
                return

        body = bytearray()
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        try:
            state = await _read_body(receive, body, self.max_bytes, deadline)
        except asyncio.TimeoutError:  # a client sending its body slowly, or not at all
            await self._reject_slow(scope, send, len(body))
            return
        if state == "gone":  # the client left before sending it all
            return
        if state == "too_large":
            await self._reject(scope, send, len(body))
            return

        replayed = False

        async def replay_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay_receive, send)

    async def _reject_slow(self, scope: Scope, send: Send, size: int) -> None:
        body = error_body(f"the request body did not arrive within {self.body_timeout_s:g} s "
                          f"({size} bytes received); send it at once", "invalid_request_error",
                          None, "body_timeout")
        await ErrorResponse(body, status_code=408, headers={"Connection": "close"})(
            scope, _no_receive, send)

    async def _reject(self, scope: Scope, send: Send, size: int) -> None:
        body = error_body(f"request body is at least {size} bytes, over the limit of "
                          f"{self.max_bytes} bytes (--max-body-bytes)",
                          "invalid_request_error", None, "request_too_large")
        await ErrorResponse(body, status_code=413)(scope, _no_receive, send)


async def _read_body(receive: Receive, body: bytearray, max_bytes: int, deadline: float) -> str:
    """Appends the request's body messages to `body` until the last one ("done"), more than
    max_bytes ("too_large") or a disconnect ("gone"); asyncio.TimeoutError at `deadline`
    (loop time). One timeout scope for the whole body, not a wait_for (a task) per message."""
    timeout_at = getattr(asyncio, "timeout_at", None)  # Python >= 3.11
    loop = asyncio.get_running_loop()
    while True:
        if timeout_at is not None:
            async with timeout_at(deadline):
                message = await receive()
        else:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        if message["type"] != "http.request":
            return "gone"
        body += message.get("body", b"")
        if len(body) > max_bytes:
            return "too_large"
        if not message.get("more_body", False):
            return "done"


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
