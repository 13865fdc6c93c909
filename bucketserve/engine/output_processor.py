"""Turns sampled tokens into what a client sees: incremental text, stop strings, logprobs.

This runs once per generated token, so the per-token path stays lean: requests with
`detokenize=False` skip the detokenizer altogether, and the timing metrics of an output are
only gathered when its request finishes (the only place they are read).
"""

from __future__ import annotations

import time

from bucketserve.engine.detokenizer import StopStringMatcher, make_detokenizer
from bucketserve.engine.outputs import RequestOutput
from bucketserve.engine.sequence import FinishReason, Sequence, TokenLogprob


class RequestState:
    """Text-side state of one request: its detokenizer, stop matcher and emitted text."""

    def __init__(self, seq: Sequence, tokenizer) -> None:
        self.seq = seq
        self.detok = (make_detokenizer(tokenizer, seq.prompt_token_ids,
                                       skip_special_tokens=seq.params.skip_special_tokens)
                      if seq.params.detokenize else None)
        self.stops = StopStringMatcher(seq.params.stop) if seq.params.stop else None
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
        self.states[seq.request_id] = RequestState(seq, self.tokenizer)

    def on_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Records one sampled token; True when a stop string ends the sequence."""
        state = self.states[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if logprob is not None:
            seq.logprobs.append(logprob)
        state.text += state.new_text(token_id)
        return state.stop_matched

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
                error = "the request waited in the queue longer than the queue timeout"
            metrics["arrival"] = seq.arrival_time
            for key, value in (("first_scheduled", seq.first_scheduled_time),
                               ("first_token", seq.first_token_time),
                               ("bucket", seq.prefill_bucket),
                               ("finished", time.monotonic())):
                if value is not None:
                    metrics[key] = value
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
