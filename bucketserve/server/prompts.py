"""From a validated OpenAI request to engine jobs: token ids and sampling parameters.

Checks that need the model happen here, before anything is queued: empty prompts, token
ids outside the vocabulary, and prompt + max_tokens over the context length (400 with
both numbers). Choice i of a seeded request uses seed + i, so the n choices differ from
each other but each one is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bucketserve.engine.sequence import GuidedDecoding, SamplingError, SamplingParams
from bucketserve.server.errors import invalid_request
from bucketserve.server.generation import Job
from bucketserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from bucketserve.server.tools import ToolPlan, render_messages


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


INLINE_TOKENIZE_CHARS = 2048  # longer request texts are tokenized in a worker thread


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # for echo; the decoded ids when the prompt came as ids


def check_text_fits(text: str, tok: TokenizerLike, max_model_len: int, param: str) -> None:
    """Refuses, before tokenizing it, a text that certainly has more tokens than the context
    (tokenizing megabytes takes seconds of CPU): a text of more than max_model_len x the
    longest token's bytes cannot fit (characters <= UTF-8 bytes)."""
    per_token = getattr(tok, "max_token_bytes", None)
    if per_token and len(text) > max_model_len * per_token:
        raise invalid_request(
            f"this model's maximum context length is {max_model_len} tokens, and a text of "
            f"{len(text)} characters has more tokens than that (a token covers at most "
            f"{per_token} bytes); shorten the prompt", param, "context_length_exceeded")


def is_long_text(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request's text is long enough to tokenize it off the event loop."""
    if isinstance(req, CompletionRequest):
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        return sum(len(t) for t in texts if isinstance(t, str)) > INLINE_TOKENIZE_CHARS
    return sum(len(m.text()) for m in req.messages) > INLINE_TOKENIZE_CHARS


def completion_prompts(req: CompletionRequest, tok: TokenizerLike,
                       max_model_len: int) -> list[Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        items: Sequence[str | list[int]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = raw  # type: ignore[assignment]
    if not items:
        raise invalid_request("prompt is empty: send a string, a list of strings, or token ids",
                              "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise invalid_request("prompt is an empty string: send some text", "prompt")
            check_text_fits(item, tok, max_model_len, "prompt")
            prompts.append(Prompt(tok.encode(item), item))
        else:
            check_token_ids(item, tok.vocab_size)
            prompts.append(Prompt(list(item), tok.decode(item, skip_special_tokens=False)))
    return prompts


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise invalid_request("prompt is an empty list of token ids", "prompt")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise invalid_request(f"prompt token id {t} is outside the vocabulary [0, {vocab_size})",
                                  "prompt")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template takes them (developer -> system; tool fields kept)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": m.text()}
        if m.tool_calls is not None:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def chat_prompt(req: ChatCompletionRequest, tok: TokenizerLike, max_model_len: int,
                plan: ToolPlan | None = None, add_generation_prompt: bool = True) -> Prompt:
    messages = message_dicts(req.messages)
    kwargs: dict[str, Any] = {}
    if plan is not None:
        messages, kwargs = render_messages(messages, plan, getattr(tok, "chat_template", None))
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template refusing the messages is a client error
        raise invalid_request(f"the chat template cannot render these messages: {exc}",
                              "messages") from exc
    check_text_fits(text, tok, max_model_len, "messages")
    # The template already holds any BOS token; adding special tokens would double it.
    return Prompt(tok.encode(text, add_special_tokens=False), text)


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, param: str) -> None:
    if prompt_len + max_tokens > max_model_len:
        raise invalid_request(
            f"this model's maximum context length is {max_model_len} tokens, but you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion); shorten the prompt or lower max_tokens", param,
            "context_length_exceeded")


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    choice: int, guided: GuidedDecoding | None = None,
                    logit_bias: dict[int, float] | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=None if req.seed is None else req.seed + choice,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias,
            guided=guided,
        )
    except SamplingError as exc:
        raise invalid_request(str(exc), exc.param) from exc


def check_queue_room(num_prompts: int, n: int, max_waiting: int) -> None:
    """A request of more engine requests (prompts x n) than the queue can ever hold would get
    503 + Retry-After forever: refuse it as the client error it is."""
    if num_prompts * n > max_waiting:
        what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise invalid_request(
            f"this request asks for {num_prompts * n} sequences ({what}), more than the "
            f"server can ever queue at once (scheduler.max_waiting = {max_waiting}); send "
            "fewer prompts or a smaller n per request", "n" if num_prompts == 1 else "prompt",
            "too_many_sequences")


def completion_jobs(req: CompletionRequest, prompts: list[Prompt], max_model_len: int,
                    guided: GuidedDecoding | None = None,
                    logit_bias: dict[int, float] | None = None) -> list[Job]:
    """n jobs per prompt, prompt-major: job index = prompt index * n + choice."""
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    jobs = []
    for p in prompts:
        check_context(len(p.token_ids), max_tokens, max_model_len, "max_tokens")
        for i in range(req.n):
            jobs.append(Job(p.token_ids, sampling_params(req, max_tokens, req.logprobs, i,
                                                         guided, logit_bias)))
    return jobs


def chat_jobs(req: ChatCompletionRequest, prompt: Prompt, max_model_len: int,
              pool_tokens: int, guided: GuidedDecoding | None = None,
              logit_bias: dict[int, float] | None = None) -> list[Job]:
    """`pool_tokens`: how many tokens one sequence can hold in the KV pool."""
    n_prompt = len(prompt.token_ids)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:  # OpenAI's default: whatever room the context (and pool) leaves
        check_context(n_prompt, 1, max_model_len, "messages")
        max_tokens = max(1, min(max_model_len, pool_tokens) - n_prompt)
    check_context(n_prompt, max_tokens, max_model_len, "max_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return [Job(prompt.token_ids, sampling_params(req, max_tokens, logprobs, i, guided, logit_bias))
            for i in range(req.n)]
