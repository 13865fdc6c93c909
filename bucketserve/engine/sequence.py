"""Per-request state. One `Sequence` owns everything the engine knows about a request."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GuidedDecoding:
    """What a request's output must match (engine/structured.py compiles it with xgrammar).
    kind: "json" (spec: a JSON schema as JSON text), "json_object" (any JSON object; spec
    ""), "regex", "choice" (spec: a JSON list of strings), "grammar" (spec: EBNF, xgrammar's
    GBNF dialect, root rule `root`)."""

    kind: str
    spec: str = ""


# logit_bias values are clamped to this range by OpenAI; here a value outside it is an error
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k alternatives
    skip_special_tokens: bool = True
    # False: token ids only, no text (no detokenizer work per token; stop strings need text)
    detokenize: bool = True
    # token id -> value added to its logit before sampling (min_tokens, penalties follow)
    logit_bias: dict[int, float] | None = None
    guided: GuidedDecoding | None = None  # grammar-constrained decoding

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def need(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise SamplingError(param, msg)

        need(self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        need(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(0.0 <= self.temperature <= 2.0, "temperature",
             f"temperature must be in [0, 2], got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             f"logprobs must be between 0 and 20, got {self.logprobs}")
        need(not self.logit_bias or all(-LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT
                                        for v in self.logit_bias.values()), "logit_bias",
             f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        need(self.detokenize or not self.stop, "stop",
             "stop strings need the output text: drop `stop` or keep detokenize on")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached (or the model's context is full)
    ABORT = "abort"  # cancelled by the client
    TIMEOUT = "timeout"  # waited in the queue past the queue timeout
    ERROR = "error"  # the engine failed while running it (the output carries the error)


_ids = itertools.count()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the top-n alternatives, best first


class Sequence:
    """One generation request: token ids, progress, KV blocks, sampling state.

    token_ids = prompt + generated so far. `num_computed_tokens` of them have their K/V
    in the pool. After a preemption it falls back to 0 and the whole sequence (prompt and
    generated tokens) is recomputed; generated tokens are never thrown away.

    With overlapped scheduling a sampled token reaches the host one step after the step
    that sampled it: `num_pending` counts tokens sampled on the device and not yet appended
    to token_ids (placeholders; the next step reads their ids on the device).
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> None:
        self.request_id = request_id if request_id is not None else f"seq-{next(_ids)}"
        self.seq_no = next(_ids)  # arrival tie-breaker
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = None if queue_timeout_s is None else self.arrival_time + queue_timeout_s
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0  # sampled on the device, not yet in token_ids
        # the most tokens ever computed: recomputation after a preemption is not useful work
        self.num_ever_computed = 0
        self.block_table: list[int] = []
        # prefix cache (block_manager.py): hashes of the full blocks of token_ids, computed
        # once each; leading blocks of block_table already registered or taken from the
        # cache; prompt tokens served from the cache at the last admission
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.prefill_bucket: int | None = None  # length bucket of its first scheduled step
        self.logprobs: list[TokenLogprob] = []
        # What the sampler does for this row, read from `params` once here (the params of a
        # sequence never change) rather than from several fields of every row every step:
        # sample_argmax: greedy or top_k 1 (no draw); argmax_only: greedy with no logprobs,
        # bias or penalty (min_tokens and a grammar, which change over the sequence, are
        # checked per step); sample_plain: argmax_only without min_tokens or guided decoding
        # (the sampler's fast path); min_tokens_end: the length below which min_tokens is
        # active (0: never); logit_processing: a bias, min_tokens or a penalty; penalised: a
        # penalty, which reads the token history (LLMEngine._needs_host_tokens).
        p = params
        self.sample_argmax = p.greedy or p.top_k == 1
        self.penalised = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                          or p.frequency_penalty != 0.0)
        self.min_tokens_end = self.num_prompt_tokens + p.min_tokens if p.min_tokens else 0
        self.logit_processing = bool(p.logit_bias) or p.min_tokens > 0 or self.penalised
        self.argmax_only = (p.greedy and p.logprobs is None and not p.logit_bias
                            and not self.penalised)
        self.sample_plain = self.argmax_only and not p.min_tokens and p.guided is None
        self.generator: torch.Generator | None = None
        # guided decoding: engine/structured.GrammarState, set by the engine that queues it
        self.grammar = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Admission order: lower priority value first, then arrival."""
        return (self.priority, self.arrival_time, self.seq_no)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
