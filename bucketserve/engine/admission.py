"""Admission: the one place that decides whether a request may enter the engine's queue.

`admit` runs every check: a request that can never run (empty prompt, a token id outside
the vocabulary, prompt + max_tokens over the context length or over the whole KV pool) is
a RequestError; a full waiting queue (`max_waiting`) is a QueueFullError. LLMEngine.add_request
(offline API) and AsyncEngine.generate (the server, either engine mode) both call it, each with
its own view of the queue depth; neither repeats a check.
"""

from __future__ import annotations

from bucketserve.engine.messages import RequestLimits
from bucketserve.engine.outputs import QueueFullError
from bucketserve.engine.sequence import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take; `param` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def validate(limits: RequestLimits, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raises RequestError for a request that can never run."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("prompt", "the prompt is empty: send at least one token")
    vocab = limits.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
    if bad:
        raise RequestError("logit_bias",
                           f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    total = n + params.max_tokens
    if total > limits.max_model_len:
        raise RequestError(
            "max_tokens",
            f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has "
            f"{n} tokens and max_tokens is {params.max_tokens} ({total} in all). "
            "Shorten the prompt or lower max_tokens.")
    need = -(-total // limits.block_size)
    if need > limits.num_kv_blocks:
        raise RequestError(
            "max_tokens",
            f"the request needs {need} KV blocks but the pool holds {limits.num_kv_blocks}; "
            "lower max_tokens or raise the KV budget (kv_cache.cpu_memory_gib / gpu_memory_fraction)")


def admit(limits: RequestLimits, prompt_token_ids: list[int], params: SamplingParams,
          num_waiting: int) -> None:
    """Every admission check; `num_waiting`: requests queued ahead of this one."""
    validate(limits, prompt_token_ids, params)
    if num_waiting >= limits.max_waiting:
        raise QueueFullError(f"{num_waiting} requests are already waiting")
