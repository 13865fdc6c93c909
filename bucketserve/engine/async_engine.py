"""The server's front end of the engine: admission, text and streams, in the event loop.

Each request gets an async stream of RequestOutputs. The engine core (engine/core.py) runs
either in its own process (`AsyncEngine.spawn`, the default of `bucketserve serve`) or in
a thread (`AsyncEngine.in_process`); this class is the same for both. Here:
- admission (engine/admission.py): a request is validated and checked against max_waiting
  before it is sent, with the queue depth the core reported after its last step plus the
  requests sent since (the core counts the ones it took in);
- output processing (TextProcessor): the core sends token ids once per step; text,
  stop strings and the client's view of a finish are made here. A stop string ends the
  client's stream at once and tells the core to finish the sequence (its blocks are freed at
  the core's next step boundary);
- EngineStats for /metrics, mirrored from every step's StepStats and queue depths;
- failure: when the core dies, every open stream gets EngineDeadError, `is_alive()` turns
  False (/health answers 503) and the `on_dead` callbacks run (the CLI exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from bucketserve.engine.admission import admit
from bucketserve.engine.core_client import CoreClient, ProcessCore, ThreadCore
from bucketserve.engine.faults import FaultPlan, Seams
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.messages import (
    AbortRequests,
    AddRequest,
    FinishRequests,
    RequestLimits,
    SeqOutput,
    StepOutputs,
)
from bucketserve.engine.options import EngineOptions
from bucketserve.engine.output_processor import TextProcessor
from bucketserve.engine.outputs import QueueFullError, RequestOutput
from bucketserve.engine.sequence import SamplingParams
from bucketserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request (b follows a)."""
    b.new_token_ids = a.new_token_ids + b.new_token_ids
    b.new_text = a.new_text + b.new_text
    if a.new_logprobs:
        b.new_logprobs = a.new_logprobs + b.new_logprobs
    if a.metrics:
        b.metrics = {**a.metrics, **b.metrics}
    return b


class EngineDeadError(RuntimeError):
    """The engine core has stopped; no request can be served."""


class StalledStreamError(RuntimeError):
    """The request's consumer stopped taking its outputs; the request was aborted."""


# More core messages than this waiting when the event loop gets to them (the front end is
# that many engine steps behind): they are handled in one turn, and each stream sends what they
# brought it as one event, so that an overloaded front end catches up instead of falling
# further behind (bucketserve_sse_tokens_total / bucketserve_sse_token_events_total rises
# above 1). Fewer: one message per turn, one event per step per stream.
CATCH_UP_STEPS = 4
# Outputs held for a request whose consumer does not take them (a client that stopped reading
# blocks its sender): past this many the request is aborted and its stream ends in an error.
MAX_QUEUED_OUTPUTS = 1024


class AsyncEngine:
    def __init__(self, core: CoreClient, faults: FaultPlan | None = None) -> None:
        """`faults`: a test's injected detokenizer failures (engine/faults.py)."""
        self.core = core
        self.limits: RequestLimits = core.limits
        self.stats = EngineStats()
        self.stats.kv_blocks_total = core.kv_blocks_total
        self.on_dead: list[Callable[[], None]] = []
        self._text = TextProcessor(core.tokenizer, faults)
        self._streams: dict[str, asyncio.Queue] = {}
        # finished here (a stop string: "stop"; text processing failed: "error"), not yet by
        # the core: the reason to count once the core reports the finish
        self._ended: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # what the core client delivers (StepOutputs, or why it died), in order; `_taking`:
        # a `_take` is scheduled on the loop
        self._inbox: deque[StepOutputs | str] = deque()
        self._inbox_lock = threading.Lock()
        self._taking = False
        self._started = False
        self._accepting = True
        self._dead_reason: str | None = None
        self._num_sent = 0  # AddRequests sent to the core
        self._num_added = 0  # ... of which the core has taken in (per its latest message)
        self._num_waiting = 0  # the core's waiting queue after its latest step

    @classmethod
    def in_process(cls, engine: LLMEngine) -> AsyncEngine:
        """The core loop in a thread of this process, over `engine`."""
        return cls(ThreadCore(engine), engine.faults)

    @classmethod
    def spawn(cls, options: EngineOptions, seams: Seams | None = None) -> AsyncEngine:
        """Starts the core process, which loads and warms up the model; returns once it is
        ready (raises CoreStartError if it fails). `options`: the model and the CLI's
        overrides of the TOML (core.build_engine); `seams`: a test's (engine/faults.py)."""
        return cls(ProcessCore(options, seams), seams.faults if seams else None)

    # ---- what the server reads ---------------------------------------------------------

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def info(self) -> dict[str, str]:
        """What the core runs: model, device, dtype, quantization, kv_cache_dtype."""
        return self.core.info

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def max_waiting(self) -> int:
        """Most engine requests that may wait for admission (scheduler.max_waiting)."""
        return self.limits.max_waiting

    @property
    def pool_tokens(self) -> int:
        """Tokens one sequence can hold when it has the whole KV pool to itself."""
        return self.limits.pool_tokens

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core died; None while it lives (or after a normal stop)."""
        return self._dead_reason

    def is_alive(self) -> bool:
        return self._started and self._dead_reason is None and self.core.is_alive()

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Call from the event loop that will serve the requests."""
        self._loop = asyncio.get_running_loop()
        self.core.start(self._deliver, self._deliver)
        self._started = True

    def _deliver(self, msg: StepOutputs | str) -> None:
        """From the core client's thread: a step's outputs, or (a str) why the core died."""
        with self._inbox_lock:
            self._inbox.append(msg)
            if self._taking:
                return
            self._taking = True
        self._loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        """Handles one message of the inbox per turn of the event loop. The streams that a
        step's outputs woke run (and write their events to their sockets) before the next
        step is handled, so when the loop is a few steps behind each client still gets one
        event per step, spaced by the front end's work on a step, not all of them at once.
        More than CATCH_UP_STEPS behind: all of them in this turn (merged per stream)."""
        with self._inbox_lock:
            if len(self._inbox) > CATCH_UP_STEPS:
                msgs = list(self._inbox)
                self._inbox.clear()
            else:
                msgs = [self._inbox.popleft()]
        try:
            for msg in msgs:
                try:
                    if isinstance(msg, StepOutputs):
                        self._on_step(msg)
                    else:
                        self._on_dead(msg)
                except Exception:  # noqa: BLE001 - as the loop would: logged, the rest go on
                    log.exception("handling the engine core's message failed")
        finally:
            with self._inbox_lock:
                more = self._taking = bool(self._inbox)
            if more:
                self._loop.call_soon(self._take)  # after the stream tasks this message woke

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops accepting, lets running requests finish for up to `timeout_s`, aborts the
        rest, then stops the core."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.is_alive():
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        while self._streams and time.monotonic() < deadline + 2.0 and self.is_alive():
            await asyncio.sleep(0.02)
        if self._started:
            await asyncio.to_thread(self.core.stop, 5.0)

    # ---- requests ----------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request. Closing the iterator early (a client gone)
        aborts the request; its blocks are back in the pool after the core's next step."""
        if not self.is_alive():
            raise EngineDeadError(self._dead_reason or "the engine core is not running")
        if not self._accepting:
            raise QueueFullError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        admit(self.limits, prompt_token_ids, params,
              self._num_waiting + self._num_sent - self._num_added)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = time.monotonic()
        self._text.add(request_id, prompt_token_ids, params, arrival)
        core_params = replace(params, stop=[], detokenize=False)
        self._num_sent += 1
        self.core.send(AddRequest(request_id, list(prompt_token_ids), core_params, priority,
                                  arrival))
        finished = False
        try:
            while True:
                item = await stream.get()
                while not isinstance(item, BaseException) and not stream.empty():
                    # several steps' outputs queued (the loop caught up on a backlog, see
                    # _take, or the consumer was stuck on a slow client): one output for all
                    nxt = stream.get_nowait()
                    if isinstance(nxt, BaseException):
                        stream.put_nowait(nxt)  # (nothing follows an error)
                        break
                    item = merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)
            self._text.drop(request_id)

    def abort(self, request_id: str) -> None:
        if self._dead_reason is None and self._started:
            self.core.send(AbortRequests([request_id]))

    # ---- what the core sends (on the event loop) ---------------------------------------

    def _on_step(self, msg: StepOutputs) -> None:
        self._num_waiting, self._num_added = msg.num_waiting, msg.num_added
        stats = self.stats
        if msg.stats is not None:
            stats.record(msg.stats)
        else:
            stats.set_queue(msg.num_waiting, msg.num_running, msg.kv_blocks_used)
        stats.set_prefix_cache(msg.prefix_queries_total, msg.prefix_hits_total,
                               msg.prefix_cached_blocks)
        to_finish: list[str] = []
        streams, text, ended = self._streams, self._text, self._ended
        news = msg.outputs
        if msg.token_request_ids:  # the plain one-token news (only the live streams')
            news = news + [SeqOutput(rid, [tok]) for rid, tok in
                           zip(msg.token_request_ids, msg.tokens, strict=True) if rid in streams]
        for o in news:
            rid = o.request_id
            stream = streams.get(rid)
            out, ended_here = text.process(o) if stream is not None else (None, False)
            if o.finish_reason is not None:
                # the client's view of the finish: one decided here (stop string, failed
                # text) wins over the core's
                reason = out.finish_reason if ended_here else ended.pop(rid, o.finish_reason)
                stats.record_finished(reason)
            elif ended_here:
                ended[rid] = out.finish_reason
                to_finish.append(rid)
            if out is not None:
                stream.put_nowait(out)
                if stream.qsize() > MAX_QUEUED_OUTPUTS and o.finish_reason is None:
                    del streams[rid]  # nothing more for it: its consumer is gone or stuck
                    stream.put_nowait(StalledStreamError(
                        f"the client did not read its stream ({stream.qsize()} outputs waiting)"))
                    self.abort(rid)
        if to_finish:
            self.core.send(FinishRequests(to_finish))

    def _on_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        if self._accepting or self._streams:
            log.error("engine core died: %s", reason)
        self._dead_reason = reason
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(f"the engine core died: {reason}"))
        for callback in self.on_dead:
            callback()
