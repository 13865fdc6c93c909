"""What crosses the boundary between the front end and the engine core, as typed records.

The front end sends requests in (`AddRequest`, `AbortRequests`, `FinishRequests`,
`Shutdown`); the core sends one `CoreReady` after start-up, then one `StepOutputs` per
engine step (every sequence's new token ids of that step, its finish reason, the step's
`StepStats` and the queue depths), and `CoreFailed` if its loop dies.

Across processes they are encoded with msgspec's MessagePack: typed decoding straight into
these Structs (no dict-then-object pass), array-like Structs (field names are not sent), no
pickle (nothing executable crosses the socket). bench/ipc_microbench.py measures it against
pickle and JSON. In-process (the engine thread) the same objects are handed over unencoded.
"""

from __future__ import annotations

import msgspec

from bucketserve.engine.sequence import SamplingParams, TokenLogprob
from bucketserve.engine.stats import StepStats


class RequestLimits(msgspec.Struct, frozen=True):
    """What admission needs to know about the engine, without the engine."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int  # usable blocks in the KV pool
    block_size: int
    max_waiting: int
    queue_timeout_s: float

    @property
    def pool_tokens(self) -> int:
        """Tokens one sequence can hold when it has the whole KV pool to itself."""
        return self.num_kv_blocks * self.block_size


class TokenizerSpec(msgspec.Struct, frozen=True):
    """Enough to rebuild the core's tokenizer in the front end without reading the model."""

    backend_json: str  # tokenizers.Tokenizer.to_str()
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    chat_template: str | None


# ---- front end -> core ---------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the core's copy: no stop strings, no detokenizing
    priority: int
    arrival_time: float  # time.monotonic() in the front end (one clock for the whole host)
    client: int = 0  # which front-end process sent it (--api-workers): its outputs go there


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """The clients are gone: finish with reason "abort" at the next step boundary."""

    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """The front end found a stop string: finish now (reason "stop"), free the blocks."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """This front end is done; the core exits once every front end has said so."""


CoreInput = AddRequest | AbortRequests | FinishRequests | Shutdown


# ---- core -> front end ---------------------------------------------------------------------


class SeqOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's news from one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" | "error"
    logprobs: list[TokenLogprob] | None = None  # only for requests that asked
    # monotonic seconds: first_scheduled / first_token with the first tokens, and at the end
    metrics: dict[str, float] | None = None
    error: str | None = None  # with finish_reason "error": what failed (a failed model step)


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[SeqOutput]
    stats: StepStats | None  # None when no model step ran (only finished requests to report)
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    # AddRequests the core has taken in so far from the front end this message goes to
    # (front end: sent - added = pending)
    num_added: int
    # prefix cache (block_manager.py), running totals: prompt tokens looked up, of those found
    # cached, and blocks held by the cache now
    prefix_queries_total: int = 0
    prefix_hits_total: int = 0
    prefix_cached_blocks: int = 0
    # The step's plain news as two columns (most of a step: no struct per sequence to build,
    # encode or decode): request token_request_ids[i] got the one token tokens[i], and is not
    # finished, asked for no logprobs and has no metrics to report. All else is in `outputs`;
    # a request is in one of the two, once.
    token_request_ids: list[str] = msgspec.field(default_factory=list)
    tokens: list[int] = msgspec.field(default_factory=list)

    def news(self) -> list[SeqOutput]:
        """Every sequence's news as SeqOutputs, the columns expanded (tests, slow paths)."""
        return self.outputs + [SeqOutput(r, [t]) for r, t in
                               zip(self.token_request_ids, self.tokens, strict=True)]


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    limits: RequestLimits
    kv_blocks_total: int
    tokenizer: TokenizerSpec
    pid: int
    info: dict[str, str] = {}  # LLMEngine.info(): model, device, dtype, quantization, KV dtype


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


CoreOutput = StepOutputs | CoreReady | CoreFailed


def input_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreInput)


def output_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreOutput)
