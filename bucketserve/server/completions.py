"""POST /v1/completions."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from bucketserve.server.context import ServerContext, completion_logprobs
from bucketserve.server.generation import ClientGone, collect_choices, run_choices, until_disconnect
from bucketserve.server.prompts import (
    Prompt,
    check_queue_room,
    completion_jobs,
    completion_prompts,
    is_long_text,
)
from bucketserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    new_id,
    now,
)
from bucketserve.server.streaming import stream_response
from bucketserve.server.structured import guided_decoding, logit_bias


async def create_completion(req: CompletionRequest, request: Request, ctx: ServerContext) -> Any:
    req.check()
    ctx.check_model(req.model)
    if is_long_text(req):  # keep the event loop serving others meanwhile
        prompts = await asyncio.to_thread(completion_prompts, req, ctx.tokenizer, ctx.max_model_len)
    else:
        prompts = completion_prompts(req, ctx.tokenizer, ctx.max_model_len)
    check_queue_room(len(prompts), req.n, ctx.engine.max_waiting)
    jobs = completion_jobs(req, prompts, ctx.max_model_len, guided_decoding(req),
                           logit_bias(req.logit_bias, ctx.tokenizer.vocab_size))
    request_id = new_id("cmpl")
    outputs = run_choices(ctx.engine, jobs, request_id, req.priority, ctx.inflight, ctx.metrics)
    if req.stream:
        formatter = _StreamFormatter(ctx, req, prompts, request_id)
        return await stream_response(request, outputs, formatter, ctx.inflight, ctx.metrics,
                                     "completions")
    try:
        return await until_disconnect(request, _collect(ctx, req, prompts, request_id, outputs))
    except ClientGone:
        return Response(status_code=499)


def _usage(prompts: list[Prompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


async def _collect(ctx: ServerContext, req: CompletionRequest, prompts: list[Prompt],
                   request_id: str, outputs) -> CompletionResponse:
    n_jobs = len(prompts) * req.n
    got = await collect_choices(outputs, n_jobs, ctx.inflight)
    choices = []
    for i in range(n_jobs):
        echo = prompts[i // req.n].text if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs(**completion_logprobs(ctx, got.logprobs[i], len(echo)))
        choices.append(CompletionChoice(index=i, text=echo + got.texts[i], logprobs=logprobs,
                                        finish_reason=got.finish_reasons[i]))
    return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                              usage=_usage(prompts, got.completion_tokens))


class _StreamFormatter:
    """Chunks of a completions stream: `text` deltas, per-chunk logprobs, optional usage."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest, prompts: list[Prompt],
                 request_id: str) -> None:
        self.ctx, self.req, self.prompts, self.id = ctx, req, prompts, request_id
        self.created = now()
        n_jobs = len(prompts) * req.n
        self.started = [False] * n_jobs
        self.offsets = [0] * n_jobs  # characters sent so far per choice (for text_offset)
        self.completion_tokens = 0

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk: dict[str, Any] = {"id": self.id, "object": "text_completion",
                                 "created": self.created, "model": self.ctx.model_name,
                                 "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = usage
        return chunk

    def opening(self) -> list[dict]:
        return []

    def on_output(self, index: int, out) -> list[dict]:
        text = out.new_text
        if not self.started[index]:
            self.started[index] = True
            if self.req.echo:
                text = self.prompts[index // self.req.n].text + text
        if out.finished:
            self.completion_tokens += out.num_output_tokens
        if not text and not out.new_logprobs and not out.finished:
            return []  # a token held back (stop-string prefix, partial character)
        logprobs = None
        if self.req.logprobs is not None:
            start = self.offsets[index]
            logprobs = completion_logprobs(self.ctx, out.new_logprobs, start)
        self.offsets[index] += len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        return [self._chunk([choice])]

    def closing(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [self._chunk([], _usage(self.prompts, self.completion_tokens).model_dump())]
