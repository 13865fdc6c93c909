"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from bucketserve.server.context import ServerContext, chat_logprobs
from bucketserve.server.errors import invalid_request
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
from bucketserve.server.structured import check_built, guided_decoding, logit_bias
from bucketserve.server.tools import (
    CallStreamer,
    ToolPlan,
    calls_schema,
    might_be_call,
    parse_constrained,
    parse_tool_calls,
    tool_plan,
)


async def create_chat_completion(req: ChatCompletionRequest, request: Request,
                                 ctx: ServerContext) -> Any:
    req.check()
    ctx.check_model(req.model)
    plan = tool_plan(req)
    guided = guided_decoding(req)
    if plan.constrained:
        if guided is not None:
            raise invalid_request(f"tool_choice {plan.choice!r} constrains the reply already; "
                                  "drop the structured-output field", "tool_choice")
        guided = calls_schema(plan)
        check_built(guided, "tools")
    if is_long_text(req):  # keep the event loop serving others meanwhile
        prompt = await asyncio.to_thread(chat_prompt, req, ctx.tokenizer, ctx.max_model_len, plan)
    else:
        prompt = chat_prompt(req, ctx.tokenizer, ctx.max_model_len, plan)
    check_queue_room(1, req.n, ctx.engine.max_waiting)
    jobs = chat_jobs(req, prompt, ctx.max_model_len, ctx.pool_tokens, guided,
                     logit_bias(req.logit_bias, ctx.tokenizer.vocab_size))
    request_id = new_id("chatcmpl")
    outputs = run_choices(ctx.engine, jobs, request_id, req.priority, ctx.inflight, ctx.metrics)
    n_prompt = len(prompt.token_ids)
    if req.stream:
        formatter = _StreamFormatter(ctx, req, n_prompt, request_id, plan)
        return await stream_response(request, outputs, formatter, ctx.inflight, ctx.metrics,
                                     "chat")
    try:
        return await until_disconnect(request, _collect(ctx, req, n_prompt, request_id, outputs,
                                                        plan))
    except ClientGone:
        return Response(status_code=499)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def reply_message(text: str, finish_reason: str | None,
                  plan: ToolPlan) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of a finished choice, its tool calls parsed out of the text
    (finish_reason then "tool_calls")."""
    calls: list[dict] = []
    content: str | None = text
    if plan.constrained and finish_reason == "stop":
        calls, content = parse_constrained(text), None
    elif plan.choice == "auto" and plan.tools:
        content, calls = parse_tool_calls(text, {t.name for t in plan.tools})
    if calls:
        return ChatResponseMessage(content=content, tool_calls=calls), "tool_calls"
    return ChatResponseMessage(content=text), finish_reason


async def _collect(ctx: ServerContext, req: ChatCompletionRequest, n_prompt: int,
                   request_id: str, outputs, plan: ToolPlan) -> ChatCompletionResponse:
    got = await collect_choices(outputs, req.n, ctx.inflight)
    choices = []
    for i in range(req.n):
        message, finish = reply_message(got.texts[i], got.finish_reasons[i], plan)
        choices.append(ChatChoice(
            index=i, message=message,
            logprobs=(ChatLogprobs(content=chat_logprobs(ctx, got.logprobs[i]))
                      if req.logprobs else None),
            finish_reason=finish))
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=_usage(n_prompt, got.completion_tokens))


class _StreamFormatter:
    """Chunks of a chat stream: a role chunk per choice first, then content deltas."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, n_prompt: int,
                 request_id: str, plan: ToolPlan) -> None:
        self.ctx, self.req, self.n_prompt, self.id = ctx, req, n_prompt, request_id
        self.plan = plan
        self.created = now()
        self.completion_tokens = 0
        # tool calls: a constrained reply streams its calls as they are written; an "auto"
        # reply that may start with a call is held back until it is known (then parsed)
        self.callers = [CallStreamer() for _ in range(req.n)] if plan.constrained else None
        self.held: list[str | None] = [""] * req.n if plan.choice == "auto" and plan.tools \
            else [None] * req.n
        self.called = [False] * req.n

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
        finish = out.finish_reason if out.finished else None
        text = out.new_text
        if self.callers is not None:
            calls = self.callers[index].feed(text)
            self.called[index] |= bool(calls)
            delta: dict = {"tool_calls": calls} if calls else {}
            if finish == "stop" and self.called[index]:
                finish = "tool_calls"
        elif self.held[index] is not None:
            held = self.held[index] + text
            if might_be_call(held) and not out.finished:
                self.held[index] = held
                return []
            self.held[index] = None
            delta = {"content": held} if held else {}
            if out.finished and might_be_call(held):
                content, calls = parse_tool_calls(held, {t.name for t in self.plan.tools})
                if calls:
                    delta = {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}
                    if content:
                        delta["content"] = content
                    finish = "tool_calls"
        else:
            delta = {"content": text} if text or not out.finished else {}
        logprobs = None
        if self.req.logprobs:
            logprobs = {"content": chat_logprobs(self.ctx, out.new_logprobs)}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish}
        return [self._chunk([choice])]

    def closing(self) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [self._chunk([], _usage(self.n_prompt, self.completion_tokens).model_dump())]
