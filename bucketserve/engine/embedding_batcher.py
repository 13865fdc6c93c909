"""Dynamic batcher for the embedding encoder: length buckets, one shape per bucket.

Which bucket runs next, how batches are merged and when inputs time out is the BucketQueue's
business (embedding_queue.py, no threads: its docstring states the batching model). This module
adds the threads around it:

- the asyncio front (`embed`) validates, enqueues and awaits a future, so the event loop never
  blocks on the encoder;
- one worker thread takes ready batches from the queue and runs them on a runner
  (embedding_runner.py): it launches batch k+1 before collecting batch k, so on a GPU the
  host builds the next batch while the device runs the current one. A CPU encoder with two
  or more torch threads and no latency SLO gets two workers instead: two batches run at once,
  each on half of the threads (a forward while the other worker is idle takes them all), so
  one's host work (filling, pooling, answering) overlaps the other's GEMMs, and small GEMMs
  run on fewer threads, which they use better. Deadlines keep one worker: they plan one
  queue order (embedding_queue point 7). torch's thread count is per thread (OpenMP's, MKL's),
  so each worker sets its own before a forward;
- the cost table the queue's deadlines plan with (embedding_cost.py): `measure_costs` times a
  few shapes at start-up, and every batch's launch-to-vectors time updates it.

A request's inputs may run in several batches; each vector (a float32 numpy row) is stored at
its input's index, and the request completes when its last input does (input order kept). An
input that waited longer than queue_timeout_s fails its whole request (QueueTimeoutError); more
than max_waiting queued requests make new ones fail at once (QueueFullError).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bucketserve.buckets import BucketsConfig
from bucketserve.engine.embedding_queue import Batch, BucketQueue, batch_capacity, finish_by
from bucketserve.engine.embedding_runner import CudaGraphRunner, FunctionRunner, Runner, Ticket
from bucketserve.engine.faults import FaultPlan
from bucketserve.engine.outputs import QueueFullError

log = logging.getLogger("bucketserve.embeddings")

# Upper bounds of the queue-delay histogram (seconds); the last bucket is +Inf.
QUEUE_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, 60.0, 300.0, 600.0)

# Start-up measurement of the cost table (measure_costs): at most this long, these many
# bucket lengths (spread over the boundaries) and batch sizes (1, a quarter and all of cap(L)).
WARMUP_BUDGET_S = 2.0
WARMUP_LENGTHS = 4


class QueueTimeoutError(RuntimeError):
    """An input waited longer than queue_timeout_s; the caller may retry later."""


class EncoderError(RuntimeError):
    """The encoder raised on a batch; every request with an input in it fails with this."""


class BatcherStoppedError(RuntimeError):
    """The batcher was shut down before the request finished."""


@dataclass
class BatcherStats:
    """Running totals since start, written under the batcher's lock; read by the /metrics
    collector (plain ints, GIL-atomic)."""

    batches_per_bucket: dict[int, int] = field(default_factory=dict)  # bucket length -> batches
    batch_size_counts: dict[int, int] = field(default_factory=dict)  # batch size -> batches
    computed_tokens: int = 0  # B * Lb summed over batches (padding included)
    useful_tokens: int = 0  # real input tokens
    num_inputs: int = 0
    num_requests: int = 0
    queue_delay_counts: list[int] = field(  # per QUEUE_DELAY_BUCKETS slot, last one = +Inf
        default_factory=lambda: [0] * (len(QUEUE_DELAY_BUCKETS) + 1))
    queue_delay_sum_s: float = 0.0
    encoder_s: float = 0.0  # per batch: launch to vectors on the host (batches may overlap)
    merged_batches: int = 0  # batches holding inputs of more than one bucket (merging)
    deadline_misses: int = 0  # inputs whose batch finished after their deadline

    @property
    def num_batches(self) -> int:
        return sum(self.batches_per_bucket.values())

    @property
    def padding_waste(self) -> float:
        """Fraction of computed tokens that were padding."""
        return 1.0 - self.useful_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def record_batch(self, bucket_len: int, lengths: list[int], delays_s: list[float],
                     merged: bool, ticket: Ticket) -> None:
        """The ticket's rows (a compiled shape's padding rows included) at its length (a
        trimming runner's longest row) count as computed tokens; `lengths` as useful ones."""
        self.merged_batches += merged
        self.batches_per_bucket[bucket_len] = self.batches_per_bucket.get(bucket_len, 0) + 1
        size = len(lengths)
        self.batch_size_counts[size] = self.batch_size_counts.get(size, 0) + 1
        self.computed_tokens += ticket.padded_rows * ticket.length
        self.useful_tokens += sum(lengths)
        self.num_inputs += size
        for d in delays_s:  # slot: the first bucket with d <= its bound, else +Inf
            self.queue_delay_counts[bisect_left(QUEUE_DELAY_BUCKETS, d)] += 1
            self.queue_delay_sum_s += d


class _Request:
    __slots__ = ("loop", "future", "results", "remaining", "done")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, n: int) -> None:
        self.loop = loop
        self.future = future
        self.results: list[np.ndarray | None] = [None] * n
        self.remaining = n
        self.done = False  # finished, failed or cancelled: its queued inputs are skipped


def resolve_all(done: list[tuple[_Request, list[np.ndarray] | BaseException]]) -> None:
    """Resolves these requests' futures (from the worker thread): one call_soon_threadsafe,
    one wake-up of the event loop, per loop, not per request."""
    loops: dict[asyncio.AbstractEventLoop, list] = {}
    for request, result in done:
        loops.setdefault(request.loop, []).append((request.future, result))
    for loop, items in loops.items():
        try:
            loop.call_soon_threadsafe(resolve_futures, items)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass


def resolve_futures(items: list[tuple[asyncio.Future, Any]]) -> None:
    """In the futures' loop: each one's result, or its exception when the result is one."""
    for future, result in items:
        if future.done():  # the awaiting task was cancelled
            pass
        elif isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


@dataclass
class _Running:
    batch: Batch
    ticket: Ticket
    start: float


class EmbeddingBatcher:
    """Queues token-id inputs per length bucket and runs ready buckets on a runner (launch /
    collect, see embedding_runner.py). max_merged_padding: the merge bound (0 = no merging).
    """

    def __init__(self, runner: Runner, boundaries: tuple[int, ...], preferred_batch_size: int,
                 max_batch_tokens: int, max_queue_delay_ms: float, queue_timeout_s: float = 600.0,
                 max_waiting: int = 1024, policy: str = "priority",
                 max_merged_padding: float = 0.0, latency_slo_ms: float = 0.0,
                 workers: int = 1) -> None:
        self.runner = runner
        # A runner with compiled batch sizes (CudaGraphRunner.sizes): batches fit them.
        self.queue = BucketQueue(boundaries, preferred_batch_size, max_batch_tokens,
                                 max_queue_delay_ms / 1000.0, policy == "priority",
                                 max_merged_padding, queue_timeout_s,
                                 graph_sizes=getattr(runner, "sizes", None),
                                 latency_slo_s=latency_slo_ms / 1000.0)
        self.spec = self.queue.spec
        self.max_waiting = max_waiting
        self.stats = BatcherStats()
        self.faults: FaultPlan | None = None  # a test's injected failures ("encode" rules)

        self.num_waiting_requests = 0  # accepted, not yet finished (queued or running)
        self._cond = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        # workers > 1 (synchronous runners only): a forward's torch threads, all of them
        # alone, or its share while the other workers run one (_forward_threads)
        self.workers = 1 if getattr(runner, "asynchronous", False) else max(1, workers)
        self.torch_threads = torch.get_num_threads()
        self._running = 0  # forwards in progress

    def measure_costs(self, budget_s: float = WARMUP_BUDGET_S) -> int:
        """Start-up (before `start`): time a few shapes into the cost table, smallest first,
        until budget_s is spent; each shape runs twice and the second run counts (the first
        pays one-off allocations). Returns the number of shapes measured."""
        bounds = self.spec.boundaries
        picks = sorted({bounds[round(i * (len(bounds) - 1) / max(WARMUP_LENGTHS - 1, 1))]
                        for i in range(WARMUP_LENGTHS)})
        shapes = sorted({(rows, length) for length in picks
                         for cap in [self.queue.capacity(length)]
                         for rows in (1, max(1, cap // 4), cap)}, key=lambda s: s[0] * s[1])
        t0 = time.monotonic()
        measured = 0
        for rows, length in shapes:
            if time.monotonic() - t0 > budget_s:
                break
            ids = [[1] * length] * rows
            for _ in range(2):
                start = time.monotonic()
                ticket = self.runner.launch(ids, length)
                self.runner.collect(ticket)
                took = time.monotonic() - start
            self.queue.cost.observe(length, ticket.padded_rows, took)
            measured += 1
        log.info("embedding cost table: %d of %d shapes timed in %.2f s", measured, len(shapes),
                 time.monotonic() - t0)
        return measured

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.is_alive():
            return
        self._stopping = False
        self._threads = [threading.Thread(target=self._run_loop, name=f"embedding-batcher-{i}",
                                          daemon=True) for i in range(self.workers)]
        for thread in self._threads:
            thread.start()

    def is_alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop taking new batches, fail what is still queued, wait for the worker threads."""
        with self._cond:
            self._stopping = True
            for item in self.queue.drain():
                self._finish(item.request, BatcherStoppedError("the server is shutting down"))
            self._cond.notify_all()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, timeout_s)

    # ------------------------------------------------------------------ asyncio front
    async def embed(self, token_id_lists: Sequence[Sequence[int]], priority: int = 0,
                    budget_s: float | None = None, arrival: float | None = None
                    ) -> list[np.ndarray]:
        """Embeddings (float32 [D] rows) for each input, in input order. Lengths must be
        1..max_len. budget_s: this request's latency budget from `arrival` (time.monotonic();
        default now), replacing latency_slo_ms for its inputs (embedding_queue point 7)."""
        if not token_id_lists:
            return []
        max_len = self.spec.max_len
        for i, ids in enumerate(token_id_lists):
            if not 1 <= len(ids) <= max_len:
                raise ValueError(f"input {i} has {len(ids)} tokens; the batcher takes 1 to "
                                 f"{max_len}")
        loop = asyncio.get_running_loop()
        request = _Request(loop, loop.create_future(), len(token_id_lists))
        deadline = None
        budget = budget_s if budget_s is not None else self.queue.latency_slo_s
        if budget:  # else the queue's own rule (the SLO from now, or no deadline)
            deadline = finish_by(time.monotonic() if arrival is None else arrival, budget)
        with self._cond:
            if self._stopping or not self.is_alive():
                raise BatcherStoppedError("the embedding batcher is not running")
            if self.num_waiting_requests >= self.max_waiting:
                raise QueueFullError(f"{self.num_waiting_requests} embedding requests are "
                                     "waiting (max_waiting); retry later")
            moved = self.queue.add(request, token_id_lists, priority, time.monotonic(),
                                   deadline)
            self.num_waiting_requests += 1
            self.stats.num_requests += 1
            if moved:  # else the worker's wake-up time stands: no thread switch per request
                self._cond.notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            with self._cond:  # the worker drops this request's inputs that are still queued
                self._finish(request, None)
            raise

    def _finish(self, request: _Request, result: list[np.ndarray] | BaseException | None,
                resolved: list | None = None) -> None:
        """Under the lock: the one place a request leaves the waiting set (result None: the
        caller is gone, nothing to resolve). resolved: collects (request, result) for one
        resolve_all later instead of resolving now."""
        if request.done:
            return
        request.done = True
        self.num_waiting_requests -= 1
        if request.remaining and not isinstance(result, list):
            self.queue.mark_dead()  # sweep its queued inputs out
        if result is not None:
            if resolved is not None:
                resolved.append((request, result))
            else:
                resolve_all([(request, result)])

    # ------------------------------------------------------------------ worker thread
    def _run_loop(self) -> None:
        # An asynchronous runner (CUDA) overlaps: batch k+1 is built and launched while the
        # device still runs batch k, then k is collected. A synchronous one (CPU) computes in
        # launch, so its batch is collected at once: holding it back until the next batch
        # ran would only delay its answers.
        overlap = getattr(self.runner, "asynchronous", False)
        running: _Running | None = None  # launched, not yet collected
        while True:
            with self._cond:
                batch = self._next_batch(wait=running is None)
            launched = self._launch(batch) if batch is not None else None
            if running is not None:
                self._complete(running)
            running = launched
            if running is not None and not overlap:
                self._complete(running)
                running = None
            if batch is None and running is None and self._stopping:
                return

    def _next_batch(self, wait: bool) -> Batch | None:
        """Under the lock: the next ready batch; with wait, blocks until there is one (None:
        stopping). Without wait, None when no bucket is ready now."""
        while not self._stopping:
            now = time.monotonic()
            for request in self.queue.expired(now):
                self._finish(request, QueueTimeoutError(
                    f"an input waited over queue_timeout_s={self.queue.queue_timeout_s:g} s in the "
                    "embedding queue; retry later"))
            batch = self.queue.pop_batch(now)
            if batch is not None and self.workers > 1:
                self._cond.notify()  # another worker may take the next ready batch
            if batch is not None or not wait:
                return batch
            wake = self.queue.next_wake(now)
            self._cond.wait(None if wake is None else max(wake - now, 0.0))
        return None

    def _fail(self, batch: Batch, exc: BaseException) -> None:
        log.error("embedding batch of %d x %d failed: %r", batch.size, batch.length, exc,
                  exc_info=exc)
        error = EncoderError(f"the embedding model failed on the batch holding this request: "
                             f"{type(exc).__name__}: {exc}")
        with self._cond:
            self.queue.batch_failed(batch)
            for item in batch.items:
                self._finish(item.request, error)

    def _forward_threads(self, delta: int) -> int:
        """Counts a forward in (delta 1) or out (-1); in: the torch threads it runs on, all
        when no other worker runs one, else an equal share."""
        with self._cond:
            self._running += delta
            share = self.torch_threads // (self.workers if self._running > 1 else 1)
        return max(1, share)

    def _launch(self, batch: Batch) -> _Running | None:
        start = time.monotonic()
        if self.workers > 1 and (threads := self._forward_threads(1)) != torch.get_num_threads():
            torch.set_num_threads(threads)  # this thread's (OpenMP's and MKL's are per thread)
        try:
            if self.faults is not None:
                self.faults.fire("encode", (item.ids[0] for item in batch.items))
            ticket = self.runner.launch([item.ids for item in batch.items], batch.length)
        except Exception as exc:  # a model failure fails this batch's requests, not the server
            self._fail(batch, exc)
            return None
        finally:
            if self.workers > 1:
                self._forward_threads(-1)
        return _Running(batch, ticket, start)

    def _complete(self, running: _Running) -> None:
        batch = running.batch
        try:
            out = self.runner.collect(running.ticket)  # [B, D] float32, ours
        except Exception as exc:
            self._fail(batch, exc)
            return
        end = time.monotonic()
        resolved: list = []
        with self._cond:  # the stats (workers may finish together), the cost table and guard
            self.stats.encoder_s += end - running.start
            self.stats.deadline_misses += self.queue.batch_done(  # (embedding_queue point 8)
                batch, running.ticket.padded_rows, end - running.start, end)
            self.stats.record_batch(batch.length, [item.length for item in batch.items],
                                    [running.start - item.arrival for item in batch.items],
                                    batch.merged, running.ticket)
            for r, item in enumerate(batch.items):
                req = item.request
                if req.done:
                    continue
                req.results[item.index] = out[r]
                req.remaining -= 1
                if req.remaining == 0:
                    self._finish(req, req.results, resolved)  # type: ignore[arg-type]
        resolve_all(resolved)


def build_batcher(model: torch.nn.Module, pad_token_id: int, buckets: BucketsConfig
                  ) -> EmbeddingBatcher:
    """The batcher for a loaded BertEmbeddingModel, as the server builds it (not started): on
    CUDA a CudaGraphRunner whose graphs are captured here (start-up; logged), with the fused
    kernels `[embedding] fused_kernels` asks for, else the model called directly. `buckets`
    must already fit the model (check_model)."""
    device = next(model.parameters()).device
    emb, kind = buckets.embedding, device.type
    size, tokens = emb.batch_size(kind), emb.batch_tokens(kind)
    runner: Runner
    if kind == "cuda":
        if emb.fused_kernels != "off" and hasattr(model, "use_fused_kernels"):
            model.use_fused_kernels(gelu_epilogue=True if emb.fused_kernels == "tanh-gelu" else None)
        runner = CudaGraphRunner(model, emb.spec, emb.batch_sizes,
                                 lambda length: batch_capacity(length, size, tokens),
                                 pad_token_id, device)
        runner.capture()
    else:
        runner = FunctionRunner(model, pad_token_id, trim=True)  # eager: no bucket padding
    # CPU: two workers on half of the threads each (module docstring), one under an SLO
    workers = 2 if kind == "cpu" and torch.get_num_threads() >= 2 and not emb.latency_slo_ms else 1
    batcher = EmbeddingBatcher(runner, emb.boundaries, size, tokens, emb.max_queue_delay_ms,
                               buckets.queue_timeout_s, buckets.max_waiting, buckets.policy,
                               emb.merged_padding(kind), emb.latency_slo_ms, workers)
    if emb.latency_slo_ms:  # deadlines plan with the table from the first request on
        with torch.inference_mode():
            batcher.measure_costs()
    return batcher
