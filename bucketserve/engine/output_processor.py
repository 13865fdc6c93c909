"""Turns sampled tokens into what a client sees: incremental text, stop strings, logprobs.

Two users, one `RequestState` (detokenizer + stop-string matcher) per request:
- `OutputProcessor`, inside LLMEngine.step, for the offline API (`LLMEngine.generate`). The
  server's engine core sends `detokenize=False` requests, for which it only collects ids.
- `TextProcessor`, in the server's front end (engine/async_engine.py): it turns the core's
  per-step token ids (`SeqOutput`) into text deltas, finds stop strings, and tells the caller
  when one ended a request (the core is then told to finish it; tokens the core produced
  after the stop are dropped here, so no text past a stop string reaches a client).

This runs once per generated token, so the per-token path stays lean: requests with
`detokenize=False` skip the detokenizer altogether, and the timing metrics of an output are
only gathered with its first tokens and when its request finishes.
"""

from __future__ import annotations

import logging
import time

from bucketserve.engine.detokenizer import StopStringMatcher, make_detokenizer
from bucketserve.engine.faults import FaultPlan
from bucketserve.engine.messages import SeqOutput
from bucketserve.engine.outputs import RequestOutput
from bucketserve.engine.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)

log = logging.getLogger(__name__)

_FINISHED = SequenceStatus.FINISHED
TIMEOUT_ERROR = "the request waited in the queue longer than the queue timeout"


class RequestState:
    """Text-side state of one request: its detokenizer, stop matcher and emitted text."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer) -> None:
        self.detok = (make_detokenizer(tokenizer, prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens)
                      if params.detokenize else None)
        self.stops = StopStringMatcher(params.stop) if params.stop else None
        self.text = ""
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.stop_matched = False

    def new_text(self, token_id: int) -> str:
        """Text that the new token completes, with any stop string held back or cut."""
        if self.detok is None:
            return ""
        text = self.detok.step([token_id])
        if self.stops is None or self.stop_matched:
            return text
        emit, matched = self.stops.feed(text)
        self.stop_matched = matched
        return emit

    def flush(self) -> str:
        """At the end of a sequence: text the detokenizer held back (a truncated character)
        and text held back as a possible stop-string prefix."""
        if self.detok is None:
            return ""
        tail = self.detok.flush()
        if self.stops is None:
            return tail
        if self.stop_matched:
            return ""
        emit, self.stop_matched = self.stops.feed(tail)
        return emit if self.stop_matched else emit + self.stops.flush()


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        self.states[seq.request_id] = RequestState(seq.prompt_token_ids, seq.params, self.tokenizer)

    def on_text(self, seq: Sequence, token_id: int) -> bool:
        """The text of one sampled token (LLMEngine records the token, its time and
        logprob); True when a stop string ends the sequence."""
        state = self.states[seq.request_id]
        state.text += state.new_text(token_id)
        return state.stop_matched

    def drop_text(self, seq: Sequence) -> None:
        """Forgets text held back for a sequence that failed: its final output flushes nothing."""
        state = self.states.get(seq.request_id)
        if state is not None:
            state.detok = None

    def seq_output(self, seq: Sequence, error: str | None = None) -> SeqOutput:
        """`output`'s delta as the engine core sends it (token ids, no text): the new ids, the
        finish reason, logprobs if asked, and the timing metrics with the first tokens and at
        the end. Slices only the new tokens (the engine core runs this for every sequence
        every step)."""
        rid = seq.request_id
        state = self.states[rid]
        if state.detok is not None:  # (text is the front end's: not the core's requests)
            out = self.output(seq, error)
            return SeqOutput(rid, out.new_token_ids, out.finish_reason, out.new_logprobs or None,
                             out.metrics or None, error if out.finish_reason == "error" else None)
        n_prompt = seq.num_prompt_tokens
        sent = state.num_sent_tokens
        toks = seq.token_ids
        num_output = len(toks) - n_prompt
        state.num_sent_tokens = num_output
        new = toks[n_prompt + sent:] if num_output - sent != 1 else [toks[-1]]
        lps = seq.logprobs[sent:num_output] or None if seq.params.logprobs is not None else None
        if seq.status is _FINISHED:
            del self.states[rid]
            reason = seq.finish_reason.value
            return SeqOutput(rid, new, reason, lps, self._final_metrics(seq),
                             error if reason == "error" else None)
        if sent == 0 and num_output:  # the first tokens: when it started (for the front end)
            return SeqOutput(rid, new, None, lps, {
                "first_scheduled": seq.first_scheduled_time or 0.0,
                "first_token": seq.first_token_time or 0.0})
        return SeqOutput(rid, new, None, lps)

    def add_news(self, news: list[tuple[Sequence, str | None]], outputs: list[SeqOutput],
                 request_ids: list[str], tokens: list[int]) -> None:
        """The engine core's StepOutputs for a step's news (LLMEngine.step_news): a plain new
        token (not the first, not the last, no logprobs) goes to the columns `request_ids` /
        `tokens`, anything else to `outputs` as a `seq_output`."""
        states = self.states
        for seq, error in news:
            state = states[seq.request_id]
            sent = state.num_sent_tokens
            if (sent and state.detok is None and seq.status is not _FINISHED
                    and seq.params.logprobs is None
                    and len(seq.token_ids) - seq.num_prompt_tokens == sent + 1):
                state.num_sent_tokens = sent + 1
                request_ids.append(seq.request_id)
                tokens.append(seq.token_ids[-1])
            else:
                outputs.append(self.seq_output(seq, error))

    @staticmethod
    def _final_metrics(seq: Sequence) -> dict[str, float]:
        metrics = {"arrival": seq.arrival_time}
        for key, value in (("first_scheduled", seq.first_scheduled_time),
                           ("first_token", seq.first_token_time),
                           ("bucket", seq.prefill_bucket),
                           ("finished", time.monotonic())):
            if value is not None:
                metrics[key] = value
        return metrics

    def output(self, seq: Sequence, error: str | None = None) -> RequestOutput:
        """The delta since the last output of this request; drops the state once finished."""
        state = self.states[seq.request_id]
        finished = seq.is_finished
        if finished:
            state.text += state.flush()
            del self.states[seq.request_id]
        old_len = state.num_sent_chars
        sent = state.num_sent_tokens
        n_prompt = seq.num_prompt_tokens
        output_ids = seq.token_ids[n_prompt:]
        num_output = len(output_ids)
        new_lps = seq.logprobs[sent:] if seq.params.logprobs is not None else []
        state.num_sent_tokens = num_output
        state.num_sent_chars = len(state.text)
        reason = None
        metrics: dict[str, float] = {}
        if finished:
            reason = seq.finish_reason.value
            if error is None and seq.finish_reason is FinishReason.TIMEOUT:
                error = TIMEOUT_ERROR
            metrics = self._final_metrics(seq)
        elif sent == 0 and num_output:  # the first tokens: when it started (for the front end)
            metrics["first_scheduled"] = seq.first_scheduled_time or 0.0
            metrics["first_token"] = seq.first_token_time or 0.0
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=output_ids[sent:],
            new_text=state.text[old_len:],
            text=state.text,
            token_ids=output_ids,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=n_prompt,
            num_output_tokens=num_output,
            new_logprobs=new_lps,
            error=error,
            metrics=metrics,
        )


class _Stream:
    """Front-end state of one request."""

    __slots__ = ("state", "params", "num_prompt", "first_token", "token_ids", "text", "metrics")

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 arrival_time: float) -> None:
        self.state = RequestState(prompt_token_ids, params, tokenizer)
        self.params = params
        self.num_prompt = len(prompt_token_ids)
        self.first_token = prompt_token_ids[0] if prompt_token_ids else -1  # (fault markers)
        self.token_ids: list[int] = []
        self.text = ""
        self.metrics: dict[str, float] = {"arrival": arrival_time}


class TextProcessor:
    """The front end's output processing: the core's token ids -> RequestOutput with text.

    `add` a request with its real parameters (stop strings included) before its first
    output; `process` each of its SeqOutputs in order; the state goes once it finished."""

    def __init__(self, tokenizer, faults: FaultPlan | None = None) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}
        self.faults = faults  # test-only hook (engine/faults.py): "detok" rules fire here

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float) -> None:
        self.streams[request_id] = _Stream(prompt_token_ids, params, self.tokenizer, arrival_time)

    def drop(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def process(self, out: SeqOutput) -> tuple[RequestOutput | None, bool]:
        """(the client's output, True when the request ended here: a stop string, or its text
        could not be made, which fails it with finish_reason "error"); (None, False) for a
        request that is not (or no longer) here."""
        st = self.streams.get(out.request_id)
        if st is None:
            return None, False
        state = st.state
        ids = out.new_token_ids
        stopped = False
        old_len = len(st.text)
        try:
            if self.faults is not None and ids:
                self.faults.fire("detok", (st.first_token,))
            for k, token in enumerate(ids):
                st.text += state.new_text(token)
                if state.stop_matched:  # the tokens after this one never happened for the client
                    stopped = True
                    ids = ids[:k + 1]
                    break
        except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
            log.exception("output processing failed for %s", out.request_id)
            return self._failed(out, st, old_len, exc), True
        st.token_ids.extend(ids)
        if out.metrics:
            st.metrics.update(out.metrics)
        reason = "stop" if stopped else out.finish_reason
        finished = reason is not None
        new_lps: list[TokenLogprob] = []
        if out.logprobs and st.params.logprobs is not None:
            new_lps = out.logprobs[:len(ids)]
        error = None
        metrics: dict[str, float] = {}
        if finished:
            st.text += state.flush()
            del self.streams[out.request_id]
            error = out.error
            if reason == FinishReason.TIMEOUT.value:
                error = TIMEOUT_ERROR
            metrics = st.metrics
            metrics.setdefault("finished", time.monotonic())
        num_output = len(st.token_ids)
        return RequestOutput(
            request_id=out.request_id,
            new_token_ids=list(ids),
            new_text=st.text[old_len:],
            text=st.text,
            token_ids=list(st.token_ids) if finished else [],
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=st.num_prompt,
            num_output_tokens=num_output,
            new_logprobs=new_lps,
            error=error,
            metrics=metrics,
        ), stopped

    def _failed(self, out: SeqOutput, st: _Stream, old_len: int, exc: Exception) -> RequestOutput:
        del self.streams[out.request_id]
        metrics = st.metrics
        metrics.setdefault("finished", time.monotonic())
        return RequestOutput(
            request_id=out.request_id, new_token_ids=[], new_text=st.text[old_len:],
            text=st.text, token_ids=list(st.token_ids), finished=True,
            finish_reason=FinishReason.ERROR.value, num_prompt_tokens=st.num_prompt,
            num_output_tokens=len(st.token_ids),
            error=f"turning the output into text failed: {type(exc).__name__}: {exc}",
            metrics=metrics)
