"""What the engine hands back each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.engine.sequence import TokenLogprob


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: the caller should retry later."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str  # all text emitted so far
    token_ids: list[int]  # all output token ids so far (the server's outputs: in the final one only)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout"
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    # in the final output: arrival, first_scheduled, first_token, finished (monotonic s),
    # bucket (the prefill length bucket of the request's first step); the engine's first
    # output with tokens carries first_scheduled and first_token too
    metrics: dict[str, float] = field(default_factory=dict)
