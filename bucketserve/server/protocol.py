"""OpenAI wire format: request and response models (pydantic v2).

Requests are validated here, field by field, before anything reaches the engine; a bad value
becomes a 400 with OpenAI's error body (see errors.py), whose `param` names the field. Checks
that need the model (context length, vocabulary) live in prompts.py.

Unknown request fields are ignored, as vLLM does, so that clients sending newer OpenAI fields
keep working. Known fields we cannot honour (suffix, best_of != n, functions, echo with
logprobs) are refused by `check()` instead of being silently dropped. Structured output,
logit_bias and tools are checked by server/structured.py and server/tools.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)
from pydantic_core import PydanticCustomError

from bucketserve.server.errors import LONE_SURROGATE, invalid_request

MAX_N = 128  # choices per request; more is almost surely a client bug
MAX_LOGPROBS = 20  # the engine's sampler returns at most 20 alternatives
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # per stop string: the stream holds back up to this much text
MAX_STOP_TOKEN_IDS = 64
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as torch.Generator.manual_seed takes
INT32_MAX = 2**31 - 1  # bound of integer fields that have no natural one (top_k, min_tokens)

# Strict scalars: "5", 5.0 or true are type errors for an integer field, as in OpenAI's API
# (a float field still takes an integer).
Int = StrictInt
Float = StrictFloat
Bool = StrictBool


_ID_TAG = ""  # "w<k>-" in front end k of `serve --api-workers N`: ids unique across them


def set_worker_id_tag(worker: int) -> None:
    global _ID_TAG
    _ID_TAG = f"w{worker}-"


def worker_tag() -> str | None:
    """This front end's tag ("w1") under --api-workers, else None."""
    return _ID_TAG[:-1] or None


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ID_TAG}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def find_lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where in a parsed JSON body a string holds a lone UTF-16 surrogate ("\\ud800" escaped
    in JSON: valid JSON, but no Unicode text, so neither a tokenizer nor UTF-8 takes it);
    None if nowhere. Iterative, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None


def check_text(data: Any) -> Any:
    """A pydantic before-validator of a whole request: refuses lone surrogates anywhere."""
    where = find_lone_surrogate(data)
    if where is not None:
        param = where.split(".")[0].split("[")[0]
        raise PydanticCustomError(
            LONE_SURROGATE, "{where} holds a lone UTF-16 surrogate (such as \\ud800), which is "
            "not valid Unicode text; send well-formed UTF-8 / paired surrogates",
            {"where": where, "param": param})
    return data


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextRequest(_Request):
    """A request whose strings must be Unicode text (no lone surrogates)."""

    @model_validator(mode="before")
    @classmethod
    def refuse_lone_surrogates(cls, data: Any) -> Any:
        return check_text(data)


class StreamOptions(_Request):
    include_usage: Bool = False


class SamplingFields(TextRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: Int = Field(default=-1, ge=-1, le=INT32_MAX)
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: Int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: Bool = False
    stop_token_ids: list[Annotated[Int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: Bool = True
    priority: Int = Field(default=0, ge=SEED_MIN, le=SEED_MAX)  # lower value is admitted first
    # structured output (server/structured.py checks them; docs/structured-output.md)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None

    def check(self) -> None:
        """Cross-field rules; raises APIError(400) naming the field."""
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true",
                                  "stream_options")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise invalid_request(f"stop accepts at most {MAX_STOP_STRINGS} strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop_list):
            raise invalid_request(f"a stop string may have at most {MAX_STOP_CHARS} characters",
                                  "stop")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# A prompt is text, a batch of texts, token ids, or a batch of token-id lists.
PromptInput = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: Int | None = Field(default=16, ge=1)
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise invalid_request("best_of is not supported (only best_of == n); remove it",
                                  "best_of")
        if self.suffix:
            raise invalid_request("suffix is not supported by this server; remove it", "suffix")
        if self.echo and self.logprobs is not None:
            raise invalid_request("echo together with logprobs is not supported (prompt "
                                  "logprobs are not computed); drop one of them", "echo")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)  # OpenAI's newer name
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # tool calling (server/tools.py checks them)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None  # legacy: refused
    function_call: Any = None  # legacy: refused

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs set to true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------------------ responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "bucketserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0, le=INT32_MAX)]]


class DetokenizeResponse(BaseModel):
    prompt: str
