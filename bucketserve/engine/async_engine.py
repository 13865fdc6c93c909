"""asyncio front of the engine: the engine loop runs in a background thread so that model
work never blocks the event loop; each request gets an async stream of its outputs."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.outputs import QueueFullError, RequestOutput
from bucketserve.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accepting = True
        self._error: BaseException | None = None
        self._num_pending = 0  # added by callers, not yet seen by the engine thread
        self._pending_lock = threading.Lock()

    # ---- what the server reads ---------------------------------------------------------

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
    def stats(self):
        return self.engine.stats

    @property
    def max_waiting(self) -> int:
        """Most engine requests that may wait for admission (scheduler.max_waiting)."""
        return self.engine.buckets.max_waiting

    @property
    def pool_tokens(self) -> int:
        """Tokens one sequence can hold when it has the whole KV pool to itself."""
        bm = self.engine.block_manager
        return bm.num_usable_blocks * bm.block_size

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="bucketserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops accepting, lets running requests finish for up to `timeout_s`, aborts the
        rest, then stops the loop."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.is_alive():
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        while self._streams and time.monotonic() < deadline + 2.0 and self.is_alive():
            await asyncio.sleep(0.02)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---- requests ----------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of one request. Closing the iterator early (a client gone)
        aborts the request; its blocks are back in the pool after the next step."""
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        if not self._accepting:
            raise QueueFullError("the server is shutting down")
        self.engine.validate(prompt_token_ids, params)
        waiting = self.engine.scheduler.num_waiting + self._num_pending
        if waiting >= self.engine.buckets.max_waiting:
            raise QueueFullError(f"{waiting} requests are already waiting")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        seq = Sequence(prompt_token_ids, params, request_id=request_id, priority=priority,
                       queue_timeout_s=self.engine.buckets.queue_timeout_s)
        with self._pending_lock:
            self._num_pending += 1
        self._inbox.put(("add", seq))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
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

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                seq: Sequence = payload  # type: ignore[assignment]
                with self._pending_lock:
                    self._num_pending -= 1
                if seq.request_id not in self._streams:
                    continue  # abandoned before the engine saw it
                self.engine.add_sequence(seq)
            else:
                self.engine.abort(payload)  # type: ignore[arg-type]

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()  # before draining: a later put sets it again
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.1)
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting client
            log.exception("engine loop died")
            self._error = exc
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop died: {exc}"))
