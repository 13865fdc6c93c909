"""Dynamic batcher for the embedding encoder: length buckets, one shape per bucket.

Batching model (the code below follows it):

1. A request is a list of token-id lists. Each input is queued on its own in the bucket of its
   length: the smallest boundary >= len(ids) (boundaries from the [embedding] TOML table).
2. A bucket of length Lb holds at most cap = min(preferred_batch_size, max_batch_tokens // Lb)
   inputs per batch. It is *ready* when it holds cap inputs (batch size or token budget full),
   or when its oldest input has waited max_queue_delay_ms.
3. The worker thread runs, among the ready buckets, the one holding the best input: lowest
   priority value, then earliest arrival (policy "fcfs" ignores priority). It takes up to cap
   inputs in that same order and runs them as one [B, Lb] batch: rows padded to Lb, never more
   (without merging).
   Merging (max_merged_padding > 0): when that bucket holds fewer than cap inputs, the batch is
   topped up with queued inputs of other buckets (ready or not), padded to the largest bucket
   length among them, so the batch still has a bucket shape [B, Lb'] with Lb' a boundary. Step
   by step it adds the k longest queued inputs of one other bucket (any k that fits), choosing
   the bucket and k that leave the least padding, as long as the batch's padding waste
   1 - sum(lengths) / (B * Lb') stays <= max_merged_padding and B stays <= cap of Lb'. Online,
   a few inputs spread over many fine buckets thus run as one batch instead of one small batch
   per bucket; a batch that its own bucket fills (cap inputs) is never topped up.
4. A request's inputs may land in several buckets and batches; each result is stored at its
   input's index, and the request completes when its last input does (input order kept).
5. An input that waited longer than queue_timeout_s fails its whole request (QueueTimeoutError);
   more than max_waiting queued requests makes new ones fail at once (QueueFullError).

The model runs in one background thread; the asyncio front (`embed`) only enqueues and awaits
a future, so the event loop never blocks on the encoder.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bucketserve.buckets import BucketSpec, EmbeddingConfig
from bucketserve.engine.outputs import QueueFullError

log = logging.getLogger("bucketserve.embeddings")

# Upper bounds of the queue-delay histogram (seconds); the last bucket is +Inf.
QUEUE_DELAY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0, 60.0, 300.0, 600.0)

EncodeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class QueueTimeoutError(RuntimeError):
    """An input waited longer than queue_timeout_s; the caller may retry later."""


class EncoderError(RuntimeError):
    """The encoder raised on a batch; every request with an input in it fails with this."""


class BatcherStoppedError(RuntimeError):
    """The batcher was shut down before the request finished."""


@dataclass
class BatcherStats:
    """Running totals since start; read by the /metrics collector (plain ints, GIL-atomic)."""

    batches_per_bucket: dict[int, int] = field(default_factory=dict)  # bucket length -> batches
    batch_size_counts: dict[int, int] = field(default_factory=dict)  # batch size -> batches
    computed_tokens: int = 0  # B * Lb summed over batches (padding included)
    useful_tokens: int = 0  # real input tokens
    num_inputs: int = 0
    num_requests: int = 0
    queue_delay_counts: list[int] = field(  # per QUEUE_DELAY_BUCKETS slot, last one = +Inf
        default_factory=lambda: [0] * (len(QUEUE_DELAY_BUCKETS) + 1))
    queue_delay_sum_s: float = 0.0
    encoder_s: float = 0.0  # wall time spent in encode (batch building excluded)
    merged_batches: int = 0  # batches holding inputs of more than one bucket (merging)

    @property
    def num_batches(self) -> int:
        return sum(self.batches_per_bucket.values())

    @property
    def padding_waste(self) -> float:
        """Fraction of computed tokens that were padding."""
        return 1.0 - self.useful_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def record_batch(self, bucket_len: int, lengths: list[int], delays_s: list[float],
                     merged: bool = False) -> None:
        self.merged_batches += merged
        self.batches_per_bucket[bucket_len] = self.batches_per_bucket.get(bucket_len, 0) + 1
        size = len(lengths)
        self.batch_size_counts[size] = self.batch_size_counts.get(size, 0) + 1
        self.computed_tokens += size * bucket_len
        self.useful_tokens += sum(lengths)
        self.num_inputs += size
        for d in delays_s:
            slot = next((i for i, b in enumerate(QUEUE_DELAY_BUCKETS) if d <= b),
                        len(QUEUE_DELAY_BUCKETS))
            self.queue_delay_counts[slot] += 1
            self.queue_delay_sum_s += d


class _Request:
    __slots__ = ("loop", "future", "results", "remaining", "done")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, n: int) -> None:
        self.loop = loop
        self.future = future
        self.results: list[torch.Tensor | None] = [None] * n
        self.remaining = n
        self.done = False  # finished, failed or cancelled: its queued inputs are skipped

    def resolve(self, result: list[torch.Tensor] | BaseException) -> None:
        """Resolves the future on its own event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, result)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass


def _resolve(future: asyncio.Future, result: list[torch.Tensor] | BaseException) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


@dataclass
class _Item:
    ids: list[int]
    request: _Request
    index: int  # position of this input in its request
    priority: int
    arrival: float  # time.monotonic()
    seq: int  # global arrival counter: ties in priority keep arrival order

    def sort_key(self, use_priority: bool) -> tuple[int, int]:
        return (self.priority, self.seq) if use_priority else (0, self.seq)


class EmbeddingBatcher:
    """Queues token-id inputs per length bucket and runs ready buckets on `encode`.

    encode(input_ids [B, Lb] long, attention_mask [B, Lb] bool) -> embeddings [B, D] float;
    padding is on the right with pad_token_id. max_merged_padding: the merge bound of point 3
    in the module docstring (0 = no merging; the shipped TOML default is 0.1).
    """

    def __init__(
        self,
        encode: EncodeFn,
        boundaries: tuple[int, ...],
        preferred_batch_size: int,
        max_batch_tokens: int,
        max_queue_delay_ms: float,
        queue_timeout_s: float = 600.0,
        max_waiting: int = 1024,
        policy: str = "priority",
        pad_token_id: int = 0,
        max_merged_padding: float = 0.0,
    ) -> None:
        self.encode = encode
        self.spec = BucketSpec(boundaries)
        if max_batch_tokens < self.spec.max_len:
            raise ValueError(f"max_batch_tokens {max_batch_tokens} is below the last boundary "
                             f"{self.spec.max_len}; raise it to at least {self.spec.max_len}")
        self.preferred_batch_size = preferred_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_s = max_queue_delay_ms / 1000.0
        self.queue_timeout_s = queue_timeout_s
        self.max_waiting = max_waiting
        self.use_priority = policy == "priority"
        self.pad_token_id = pad_token_id
        if not 0.0 <= max_merged_padding <= 1.0:
            raise ValueError(f"max_merged_padding {max_merged_padding} is not a fraction in "
                             "[0, 1]; 0 turns bucket merging off")
        self.max_merged_padding = max_merged_padding
        self.stats = BatcherStats()

        self._queues: dict[int, list[_Item]] = {b: [] for b in self.spec.boundaries}
        self._num_waiting_requests = 0
        self._seq = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, encode: EncodeFn, cfg: EmbeddingConfig, queue_timeout_s: float = 600.0,
                    max_waiting: int = 1024, policy: str = "priority",
                    pad_token_id: int = 0) -> EmbeddingBatcher:
        return cls(encode, cfg.boundaries, cfg.preferred_batch_size, cfg.max_batch_tokens,
                   cfg.max_queue_delay_ms, queue_timeout_s, max_waiting, policy, pad_token_id,
                   cfg.max_merged_padding)

    @property
    def max_len(self) -> int:
        """The longest input the batcher accepts (its last boundary)."""
        return self.spec.max_len

    @property
    def num_waiting_requests(self) -> int:
        """Requests accepted and not yet finished (queued or in a running batch)."""
        return self._num_waiting_requests

    def capacity(self, bucket_len: int) -> int:
        """Most inputs in one batch of this bucket."""
        return max(1, min(self.preferred_batch_size, self.max_batch_tokens // bucket_len))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run_loop, name="embedding-batcher",
                                        daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop taking new batches, fail what is still queued, wait for the worker thread."""
        with self._cond:
            self._stopping = True
            for q in self._queues.values():
                for item in q:
                    self._finish(item.request, BatcherStoppedError("the server is shutting down"))
                q.clear()
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)

    # ------------------------------------------------------------------ asyncio front
    async def embed(self, token_id_lists: list[list[int]], priority: int = 0) -> list[torch.Tensor]:
        """Embeddings [D] for each input, in input order. Lengths must be 1..max_len."""
        if not token_id_lists:
            return []
        for i, ids in enumerate(token_id_lists):
            if not 1 <= len(ids) <= self.max_len:
                raise ValueError(f"input {i} has {len(ids)} tokens; the batcher takes 1 to "
                                 f"{self.max_len}")
        loop = asyncio.get_running_loop()
        request = _Request(loop, loop.create_future(), len(token_id_lists))
        self._submit(request, token_id_lists, priority)
        try:
            return await request.future
        except asyncio.CancelledError:
            with self._cond:  # the worker drops this request's inputs that are still queued
                self._finish(request, None)
            raise

    def _finish(self, request: _Request, result: list[torch.Tensor] | BaseException | None) -> None:
        """Under the lock: the one place a request leaves the waiting set (result None: the
        caller is gone, nothing to resolve)."""
        if request.done:
            return
        request.done = True
        self._num_waiting_requests -= 1
        if result is not None:
            request.resolve(result)

    def _submit(self, request: _Request, token_id_lists: list[list[int]], priority: int) -> None:
        with self._cond:
            if self._stopping or not self.is_alive():
                raise BatcherStoppedError("the embedding batcher is not running")
            if self._num_waiting_requests >= self.max_waiting:
                raise QueueFullError(f"{self._num_waiting_requests} embedding requests are "
                                     "waiting (max_waiting); retry later")
            now = time.monotonic()
            for index, ids in enumerate(token_id_lists):
                bucket = self.spec.lookup(len(ids))
                self._queues[bucket].append(
                    _Item(ids, request, index, priority, now, self._seq))
                self._seq += 1
            self._num_waiting_requests += 1
            self.stats.num_requests += 1
            self._cond.notify()

    # ------------------------------------------------------------------ worker thread
    def _run_loop(self) -> None:
        while True:
            with self._cond:
                picked = self._wait_for_batch()
                if picked is None:
                    return
            bucket_len, items = picked
            self._run_batch(bucket_len, items)

    def _wait_for_batch(self) -> tuple[int, list[_Item]] | None:
        """Under the lock: block until some bucket is ready, take its batch. None = stop."""
        while not self._stopping:
            now = time.monotonic()
            self._drop_dead(now)
            best: tuple[tuple[int, int], int] | None = None
            wake_at = None
            for bucket_len, q in self._queues.items():
                if not q:
                    continue
                ready_at = q[0].arrival + self.max_queue_delay_s
                if len(q) >= self.capacity(bucket_len) or ready_at <= now:
                    key = min(item.sort_key(self.use_priority) for item in q)
                    if best is None or key < best[0]:
                        best = (key, bucket_len)
                else:
                    wake_at = ready_at if wake_at is None else min(wake_at, ready_at)
            if best is not None:
                bucket_len = best[1]
                items = self._take(bucket_len)
                if len(items) < self.capacity(bucket_len) and self.max_merged_padding > 0:
                    bucket_len = self._merge(bucket_len, items)
                return bucket_len, items
            self._cond.wait(None if wake_at is None else max(wake_at - now, 0.0))
        return None

    def _drop_dead(self, now: float) -> None:
        """Remove inputs of finished/cancelled requests; time out inputs waited too long."""
        for q in self._queues.values():
            if q and (any(item.request.done for item in q)
                      or now - q[0].arrival > self.queue_timeout_s):
                for item in q:
                    if not item.request.done and now - item.arrival > self.queue_timeout_s:
                        self._finish(item.request, QueueTimeoutError(
                            f"an input waited over queue_timeout_s={self.queue_timeout_s:g} s "
                            "in the embedding queue; retry later"))
                q[:] = [item for item in q if not item.request.done]

    def _take(self, bucket_len: int) -> list[_Item]:
        q = self._queues[bucket_len]
        cap = self.capacity(bucket_len)
        if len(q) <= cap:
            taken, self._queues[bucket_len] = q, []
        else:
            order = sorted(range(len(q)), key=lambda i: q[i].sort_key(self.use_priority))
            chosen = set(order[:cap])
            taken = [q[i] for i in sorted(chosen)]
            self._queues[bucket_len] = [q[i] for i in range(len(q)) if i not in chosen]
        return taken

    def _merge(self, bucket_len: int, items: list[_Item]) -> int:
        """Under the lock: tops `items` (taken from bucket_len) up with inputs of other buckets
        while the batch's padding waste stays <= max_merged_padding (docstring point 3); moves
        them out of their queues into `items`. Returns the batch's length, a boundary."""
        # Candidates of each other bucket, longest first (least padding at a given length),
        # ties by priority / arrival. cursor[b]: how many of them are already taken.
        candidates = {
            b: sorted(q, key=lambda it: (-len(it.ids), it.sort_key(self.use_priority)))
            for b, q in self._queues.items() if q and b != bucket_len}
        cursor = dict.fromkeys(candidates, 0)
        useful = sum(len(item.ids) for item in items)
        length = bucket_len
        while True:
            # (waste after adding, -k, bucket, k): the least padding, then the most inputs.
            best: tuple[float, int, int, int] | None = None
            for b, cands in candidates.items():
                new_len = max(length, b)
                added = 0
                # Adding k > 1 at once matters when b is larger than the batch: one long
                # input alone may not dilute the padding of the short ones enough, a few do.
                for k in range(1, min(len(cands) - cursor[b],
                                      self.capacity(new_len) - len(items)) + 1):
                    added += len(cands[cursor[b] + k - 1].ids)
                    waste = 1.0 - (useful + added) / ((len(items) + k) * new_len)
                    option = (waste, -k, b, k)
                    if waste <= self.max_merged_padding and (best is None or option < best):
                        best = option
            if best is None:
                break
            _, _, b, k = best
            for item in candidates[b][cursor[b]:cursor[b] + k]:
                items.append(item)
                useful += len(item.ids)
            cursor[b] += k
            length = max(length, b)
        for b, n in cursor.items():
            if n:
                taken = {id(item) for item in candidates[b][:n]}
                self._queues[b] = [item for item in self._queues[b] if id(item) not in taken]
        return length

    def _run_batch(self, bucket_len: int, items: list[_Item]) -> None:
        # input_ids / mask [B, Lb]: row r holds items[r].ids then padding.
        B = len(items)
        input_ids = torch.full((B, bucket_len), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, bucket_len), dtype=torch.bool)
        for r, item in enumerate(items):
            n = len(item.ids)
            input_ids[r, :n] = torch.tensor(item.ids, dtype=torch.long)
            mask[r, :n] = True
        start = time.monotonic()
        try:
            out = self.encode(input_ids, mask)  # [B, D]
        except Exception as exc:  # a model failure fails this batch's requests, not the server
            log.exception("embedding batch of %d x %d failed", B, bucket_len)
            error = EncoderError(f"the embedding model failed on the batch holding this "
                                 f"request: {type(exc).__name__}: {exc}")
            with self._cond:
                for item in items:
                    self._finish(item.request, error)
            return
        out = out.cpu()
        self.stats.encoder_s += time.monotonic() - start
        lengths = [len(item.ids) for item in items]
        merged = any(self.spec.lookup(n) != bucket_len for n in lengths)
        self.stats.record_batch(bucket_len, lengths, [start - item.arrival for item in items],
                                merged)
        with self._cond:
            for r, item in enumerate(items):
                req = item.request
                if req.done:
                    continue
                req.results[item.index] = out[r]
                req.remaining -= 1
                if req.remaining == 0:
                    self._finish(req, req.results)  # type: ignore[arg-type]
