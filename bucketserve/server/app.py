"""The FastAPI app: routes, auth, body limit, lifespan (engine start / bounded shutdown)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bucketserve.server.chat import create_chat_completion
from bucketserve.server.completions import create_completion
from bucketserve.server.context import ServerContext
from bucketserve.server.errors import (
    DEFAULT_BODY_TIMEOUT_S,
    APIError,
    BodySizeLimitMiddleware,
    install_exception_handlers,
    invalid_request,
    overloaded,
)
from bucketserve.server.prompts import chat_prompt, check_text_fits
from bucketserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

log = logging.getLogger("bucketserve.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
ENGINE_STOP_S = 5.0  # what engine.shutdown gets once the HTTP side has drained
WATCH_S = 0.5  # how often the watchdog checks that the engine loop still runs


class AddOn(Protocol):
    """A router served next to the generation API (the embeddings service implements it).

    Optional: a `metrics_collector` attribute (a prometheus Collector) is exported on /metrics."""

    router: APIRouter
    model_name: str

    async def start(self) -> None: ...
    async def shutdown(self, timeout_s: float) -> None: ...


class ApiKeyMiddleware:
    """Every /v1 route and the API schema need `Authorization: Bearer <key>` when a key is
    configured. The key is compared in constant time; a request with more than one
    Authorization header is refused (which one counts would depend on the proxy in front)."""

    PROTECTED_PATHS = ("/openapi.json", "/docs", "/redoc")

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    def protects(self, path: str) -> bool:
        return path.startswith("/v1") or path.startswith(self.PROTECTED_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protects(scope["path"]):
            given = [v for k, v in scope.get("headers", []) if k == b"authorization"]
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                why = ("send exactly one Authorization header" if len(given) > 1
                       else "send 'Authorization: Bearer <key>'")
                err = APIError(401, f"missing or wrong API key: {why}",
                               "authentication_error", None, "invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def begin_drain(ctx: ServerContext) -> None:
    """Called on SIGTERM/SIGINT: refuse new work, abort what is still running after the
    shutdown timeout (those clients get a 503 / an error event, not silence)."""
    if ctx.inflight.draining:
        return
    ctx.inflight.draining = True
    log.info("shutting down: %d engine request(s) in flight get %.1f s to finish",
             len(ctx.inflight.request_ids), ctx.shutdown_timeout_s)
    asyncio.get_running_loop().call_later(ctx.shutdown_timeout_s, ctx.inflight.abort_all, ctx.engine)


async def watch_engine(ctx: ServerContext, add_ons: list[AddOn],
                       on_dead: Callable[[], None]) -> None:
    """Calls `on_dead` once when the engine loop (or an add-on's worker) has stopped by itself:
    a part that failed for good. The server then exits non-zero instead of staying up with
    /health at 503 (a supervisor restarts it)."""
    while True:
        await asyncio.sleep(WATCH_S)
        if not ctx.inflight.draining and not parts_alive(ctx, add_ons):
            log.critical("the engine stopped by itself: failing the requests in flight and "
                         "shutting down (exit status 1)")
            on_dead()
            return


def parts_alive(ctx: ServerContext, add_ons: list[AddOn]) -> bool:
    return ctx.engine.is_alive() and all(getattr(a, "is_alive", lambda: True)() for a in add_ons)


def create_app(ctx: ServerContext, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               add_ons: list[AddOn] | None = None,
               on_engine_dead: Callable[[], None] | None = None,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """`on_engine_dead`: called if the engine stops by itself (cli.py makes the process exit
    non-zero); None only logs it (in-process tests)."""
    add_ons = add_ons or []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not ctx.engine.is_alive():
            ctx.engine.start()
        for add_on in add_ons:
            await add_on.start()
        watchdog = None
        if on_engine_dead is not None:
            watchdog = asyncio.create_task(watch_engine(ctx, add_ons, on_engine_dead))
        yield
        if watchdog is not None:
            watchdog.cancel()
        for add_on in add_ons:
            await add_on.shutdown(ENGINE_STOP_S)
        await ctx.engine.shutdown(ENGINE_STOP_S)
        log.info("engine stopped")

    app = FastAPI(title="bucketserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_exception_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    def refuse_while_draining() -> None:
        if ctx.inflight.draining:
            raise overloaded("the server is shutting down; retry later", "shutting_down")

    @app.get("/health")
    async def health() -> JSONResponse:
        if parts_alive(ctx, add_ons) and not ctx.inflight.draining:
            return JSONResponse({"status": "ok"})
        state = "draining" if ctx.inflight.draining else "engine loop not running"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)]
        cards += [ModelCard(id=a.model_name) for a in add_ons]
        return ModelList(data=cards)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        refuse_while_draining()
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        refuse_while_draining()
        return await create_chat_completion(body, request, ctx)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        tok = ctx.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise invalid_request("send either prompt or messages", "prompt")
        if body.messages is not None:
            ids = chat_prompt(body, tok, ctx.max_model_len,
                              add_generation_prompt=body.add_generation_prompt).token_ids
        else:
            check_text_fits(body.prompt, tok, ctx.max_model_len, "prompt")
            ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise invalid_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                  "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens,
                                                               skip_special_tokens=False))

    for add_on in add_ons:
        app.include_router(add_on.router)
        collector = getattr(add_on, "metrics_collector", None)
        if collector is not None:
            ctx.metrics.registry.register(collector)
    return app
