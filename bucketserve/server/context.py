"""What every handler needs, built once per app: the engine and what the server reads from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from bucketserve.engine.async_engine import AsyncEngine
from bucketserve.engine.sequence import TokenLogprob
from bucketserve.server.errors import check_model
from bucketserve.server.generation import InFlight
from bucketserve.server.metrics import ServerMetrics
from bucketserve.server.structured import set_backend


@dataclass
class ServerContext:
    engine: AsyncEngine
    shutdown_timeout_s: float = 30.0
    inflight: InFlight = field(default_factory=InFlight)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.engine.stats, lambda: self.engine.info)
        if self.metrics.shared is not None:  # one of several front ends: count across them
            self.engine.stats.on_finished = self.metrics.count_finished
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        # specs are checked by the library the core runs them on
        set_backend(self.engine.info.get("structured_backend", "xgrammar"))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def pool_tokens(self) -> int:
        """Tokens one sequence can hold when it has the whole KV pool to itself."""
        return self.engine.pool_tokens

    def check_model(self, name: str | None) -> None:
        check_model(name, self.model_name)

    def _token_text(self, token_id: int) -> str:
        """One token on its own, special tokens included (the `token` of a logprob entry)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(ctx: ServerContext, lps: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's completions format for a run of tokens whose text starts at `offset`.

    top_logprobs holds the requested alternatives plus the chosen token (as vLLM does), so it
    is never empty; text_offset counts characters of the concatenated token strings."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for lp in lps:
        text = ctx.token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        alternatives = {ctx.token_text(t): v for t, v in lp.top}
        alternatives.setdefault(text, lp.logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(ctx: ServerContext, lps: list[TokenLogprob]) -> list[dict]:
    """OpenAI's chat format: one entry per token with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps]
