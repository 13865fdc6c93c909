"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from bucketserve.server.context import ServerContext, chat_logprobs
from bucketserve.server.generation import ClientGone, collect_choices, run_choices, until_disconnect
from bucketserve.server.prompts import chat_jobs, chat_prompt, check_queue_room, is_long_text
from bucketserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    UsageInfo,
    new_id,
    now,
)
from bucketserve.server.streaming import stream_response


async def create_chat_completion(req: ChatCompletionRequest, request: Request,
                                 ctx: ServerContext) -> Any:
    req.check()
    ctx.check_model(req.model)
    if is_long_text(req):  # keep the event loop serving others meanwhile
        prompt = await asyncio.to_thread(chat_prompt, req, ctx.tokenizer, ctx.max_model_len)
    else:
        prompt = chat_prompt(req, ctx.tokenizer, ctx.max_model_len)
    check_queue_room(1, req.n, ctx.engine.max_waiting)
    jobs = chat_jobs(req, prompt, ctx.max_model_len, ctx.pool_tokens)
    request_id = new_id("chatcmpl")
    outputs = run_choices(ctx.engine, jobs, request_id, req.priority, ctx.inflight, ctx.metrics)
    n_prompt = len(prompt.token_ids)
    if req.stream:
        formatter = _StreamFormatter(ctx, req, n_prompt, request_id)
        return await stream_response(request, outputs, formatter, ctx.inflight, ctx.metrics,
                                     "chat")
    try:
        return await until_disconnect(request, _collect(ctx, req, n_prompt, request_id, outputs))
    except ClientGone:
        return Response(status_code=499)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


async def _collect(ctx: ServerContext, req: ChatCompletionRequest, n_prompt: int,
                   request_id: str, outputs) -> ChatCompletionResponse:
    got = await collect_choices(outputs, req.n, ctx.inflight)
    choices = [
        ChatChoice(index=i, message=ChatResponseMessage(content=got.texts[i]),
                   logprobs=(ChatLogprobs(content=chat_logprobs(ctx, got.logprobs[i]))
                             if req.logprobs else None),
                   finish_reason=got.finish_reasons[i])
        for i in range(req.n)
    ]
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=_usage(n_prompt, got.completion_tokens))


class _StreamFormatter:
    """Chunks of a chat stream: a role chunk per choice first, then content deltas."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, n_prompt: int,
                 request_id: str) -> None:
        self.ctx, self.req, self.n_prompt, self.id = ctx, req, n_prompt, request_id
        self.created = now()
        self.completion_tokens = 0

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.ctx.model_name,
                                 "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = usage
        return chunk

    def opening(self) -> list[dict]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(self.req.n)]

    def on_output(self, index: int, out) -> list[dict]:
        if out.finished:
            self.completion_tokens += out.num_output_tokens
        if not out.new_text and not out.new_logprobs and not out.finished:
            return []  # a token held back (stop-string prefix, partial character)
        delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        logprobs = None
        if self.req.logprobs:
            logprobs = {"content": chat_logprobs(self.ctx, out.new_logprobs)}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        return [self._chunk([choice])]

    def closing(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [self._chunk([], _usage(self.n_prompt, self.completion_tokens).model_dump())]
