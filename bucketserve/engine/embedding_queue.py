"""The embedding batcher's queue: which bucket runs next, merging, deadlines. No threads, no
clock: every method takes `now`, so the tests step time by hand. EmbeddingBatcher's worker calls
`pop_batch` / `next_wake` under its lock. docs/architecture.md explains the design and its
measurements; the numbered points below are what the code refers to.

1. An input waits in the bucket of its length (the smallest boundary >= len(ids)), in one FIFO
   per priority value (policy "fcfs": one FIFO).
2. A bucket of length L takes at most cap(L) = min(preferred_batch_size, max_batch_tokens // L)
   inputs. It is ready when full, or when its wait is over: the fixed delay (latency_slo_s ==
   0: its oldest input waited max_queue_delay_s) or its latest start (deadlines, point 7). A
   request's own deadline (header) can only make its bucket run before the fixed delay.
3. Among ready buckets: lowest priority value, then earliest deadline, then earliest arrival.
4. Merging (max_merged_padding > 0): a batch under cap(L) is topped up with other buckets'
   inputs (longest buckets first) padded to the largest length T among them, while the waste
   1 - sum(lengths) / (B * T) stays <= max_merged_padding and B <= cap(T); the T giving the
   most inputs wins (then the least waste, then the shorter T).
5. Compiled sizes (graph_sizes): a batch of n runs at the smallest size >= n; when the padding
   rows would push the waste over max_merged_padding it is cut to the largest size <= n and
   the cut inputs wait again. Above the largest size it runs eagerly at its own size.
6. Inputs of finished requests are skipped at the heads of FIFOs or swept by `mark_dead`;
   `expired(now)` names the requests with an input older than queue_timeout_s.
7. Deadlines: arrival + budget x (1 - SLO_RESERVE). Each bucket with deadlines is a job: its
   earliest deadline and the predicted cost of what it holds (cost table, embedding_cost.py)
   x (1 + COST_MARGIN) + WAKE_SLACK_S. In deadline order on one worker the latest start is
   start_k = min(d_k, start_{k+1}) - c_k, less the longest recent batch and the guard
   (point 8). A bucket waits at all only where a full batch costs per input at most
   1 / WAIT_GAIN of what it holds now, and only while the worker is busy (busy_share >=
   WAIT_MIN_BUSY, decayed over BUSY_TAU_S); a busy worker gone idle waits at most the longest
   recent batch for company.
8. Guard (`batch_done`): a batch that ended s late raises it by s; an on-time one lowers it by
   GUARD_DECAY x min(slack, guard); it never exceeds the largest budget seen.
9. Overload: some input can no longer be on time and the queued work exceeds the largest
   budget. Then the fullest ready bucket runs first (min(live, target) / target), except that
   an input older than STARVE_SHARE x queue_timeout_s goes first.
10. Under overload a batch takes target(L) <= cap(L) inputs: the largest candidate size (graph
   sizes, or powers of two, below cap(L), and cap(L)) whose predicted cost per input is within
   TARGET_TOLERANCE of the least.

Per batch the work is O(buckets x priorities + B), not O(inputs queued).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bucketserve.buckets import BucketSpec, round_up_batch_size
from bucketserve.engine.embedding_cost import CostTable

# Share of a deadline's budget kept for the path outside the encoder batch (point 7).
SLO_RESERVE = 0.1
# Predicted batch costs are planned with this margin (an EWMA follows a drifting device with
# a lag) ...
COST_MARGIN = 0.25
# ... plus this much per job (seconds): a timed wait returns late by a scheduler tick or so.
WAKE_SLACK_S = 0.001
# Share of an on-time batch's slack (at most the guard) the guard gives back (point 8).
GUARD_DECAY = 0.05
# A bucket with deadlines waits for more inputs only if a full batch would cost per input at
# most 1 / WAIT_GAIN of what its inputs cost per input now (point 7).
WAIT_GAIN = 1.25
# Under overload (point 9), an input that waited this share of queue_timeout_s runs oldest-first.
STARVE_SHARE = 0.5
# Point 7: buckets wait for fuller batches only while the worker spent at least this share of
# its recent time (decayed with time constant BUSY_TAU_S) running batches.
WAIT_MIN_BUSY = 0.8
BUSY_TAU_S = 0.5
# Point 10: a batch with deadlines takes the largest candidate size whose predicted cost per
# input is within this share of the least; recomputed after this many cost table updates.
TARGET_TOLERANCE = 0.03
TARGET_REFRESH = 16


def finish_by(arrival: float, budget_s: float) -> float:
    """The deadline of an input that arrived at `arrival` with a latency budget (point 7)."""
    return arrival + budget_s * (1.0 - SLO_RESERVE)


def batch_capacity(length: int, preferred_batch_size: int, max_batch_tokens: int) -> int:
    """Most inputs in one batch of bucket length `length` (docstring point 2)."""
    return max(1, min(preferred_batch_size, max_batch_tokens // length))


@dataclass(slots=True)
class QueuedInput:
    ids: Any  # a sequence of token ids (list or 1-D int array)
    request: Any  # the owner; anything with a boolean `done` attribute
    index: int  # position of this input in its request
    priority: int
    arrival: float
    seq: int  # global arrival counter
    length: int  # len(ids)
    bucket: int  # the bucket it waits in: the smallest boundary >= length
    deadline: float = math.inf  # when its batch must have finished (point 7); inf: none
    queued: bool = True  # still in its bucket (False once taken into a batch)


@dataclass(slots=True)
class Batch:
    length: int  # the bucket length every row is padded to
    items: list[QueuedInput]
    merged: bool = False  # holds inputs of more than one bucket
    overload: bool = False  # popped under overload (point 9: the fullest ready bucket)

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass
class _Bucket:
    # priority -> FIFO; taken (not queued) and dead inputs leave lazily from the front
    fifos: dict[int, deque[QueuedInput]] = field(default_factory=dict)
    live: int = 0  # queued inputs (dead ones included until they are dropped)
    # (deadline, seq, input) of inputs with a finite deadline, dropped lazily as above
    deadlines: list[tuple[float, int, QueuedInput]] = field(default_factory=list)

    def earliest_deadline(self) -> float:
        heap = self.deadlines
        while heap and not _waiting(heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def heads(self) -> Iterator[QueuedInput]:
        """The first waiting input of every non-empty FIFO (others at the front dropped)."""
        for prio in list(self.fifos):
            fifo = self.fifos[prio]
            while fifo and not _waiting(fifo[0]):
                item = fifo.popleft()
                if item.queued:  # dead: it still counted
                    item.queued = False
                    self.live -= 1
            if fifo:
                yield fifo[0]
            else:
                del self.fifos[prio]

    def in_order(self) -> Iterator[QueuedInput]:
        """Waiting inputs, best first (priority, then arrival)."""
        for prio in sorted(self.fifos):
            yield from filter(_waiting, self.fifos[prio])

    def take(self, items: Iterable[QueuedInput]) -> list[QueuedInput]:
        items = list(items)
        for item in items:
            item.queued = False
        self.live -= len(items)
        return items


def _waiting(item: QueuedInput) -> bool:
    return item.queued and not item.request.done


class BucketQueue:
    def __init__(self, boundaries: Iterable[int], preferred_batch_size: int,
                 max_batch_tokens: int, max_queue_delay_s: float, use_priority: bool = True,
                 max_merged_padding: float = 0.0, queue_timeout_s: float = 600.0,
                 graph_sizes: Iterable[int] | None = None, latency_slo_s: float = 0.0,
                 cost: CostTable | None = None) -> None:
        self.spec = BucketSpec(boundaries)
        if max_batch_tokens < self.spec.max_len:
            raise ValueError(f"max_batch_tokens {max_batch_tokens} is below the last boundary "
                             f"{self.spec.max_len}; raise it to at least {self.spec.max_len}")
        if not 0.0 <= max_merged_padding <= 1.0:
            raise ValueError(f"max_merged_padding {max_merged_padding} is not a fraction in "
                             "[0, 1]; 0 turns bucket merging off")
        self.preferred_batch_size = preferred_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_s = max_queue_delay_s
        self.use_priority = use_priority
        self.max_merged_padding = max_merged_padding
        self.queue_timeout_s = queue_timeout_s
        self.graph_sizes = sorted(set(graph_sizes)) if graph_sizes else None
        if not (math.isfinite(latency_slo_s) and latency_slo_s >= 0):
            raise ValueError(f"latency_slo_s {latency_slo_s} is not a finite number >= 0")
        self.latency_slo_s = latency_slo_s  # 0: fixed delay, deadlines only from requests
        self.cost = cost if cost is not None else CostTable()
        self.guard_s = 0.0  # point 8
        # point 7: decayed seconds spent in batches and seconds elapsed, at the last batch end
        self._busy_s = 0.0
        self._span_s = 0.0
        self._last_end: float | None = None
        self._in_flight = 0  # batches popped and not yet done (batch_done / batch_failed)
        self._max_budget_s = latency_slo_s
        self._buckets = {b: _Bucket() for b in self.spec.boundaries}
        self._seq = 0
        self._targets: dict[int, tuple[int, int]] = {}  # L -> (target, cost table version)

    def capacity(self, bucket_len: int) -> int:
        """Most inputs in one batch of this bucket."""
        return batch_capacity(bucket_len, self.preferred_batch_size, self.max_batch_tokens)

    def batch_limit(self, bucket_len: int, overload: bool) -> int:
        """Most inputs a batch of this bucket takes now: target(L) under overload, else
        cap(L) (point 10)."""
        return self.target(bucket_len) if overload else self.capacity(bucket_len)

    def target(self, bucket_len: int) -> int:
        """Inputs one batch of this bucket takes under overload (point 10): cap(L) with a
        fixed delay; with deadlines the size of least predicted cost per input, <= cap(L)."""
        cap = self.capacity(bucket_len)
        if not self.latency_slo_s:
            return cap
        cached = self._targets.get(bucket_len)
        version = self.cost.version
        if cached is not None and version - cached[1] < TARGET_REFRESH:
            return cached[0]
        if self.graph_sizes:
            sizes = {b for b in self.graph_sizes if b < cap}
        else:
            sizes = {1 << k for k in range(cap.bit_length()) if 1 << k < cap}
        predict = self.cost.predict
        per = [(predict(bucket_len, self.padded_size(b), b) / b, b) for b in sorted(sizes | {cap})]
        least = min(p for p, _ in per)
        best = cap if least <= 0 else max(b for p, b in per if p <= (1 + TARGET_TOLERANCE) * least)
        self._targets[bucket_len] = (best, version)
        return best

    # ------------------------------------------------------------------ adding / removing
    def add(self, request: Any, id_lists: Iterable[Any], priority: int, now: float,
            deadline: float | None = None) -> bool:
        """Queue every input of `request` (lengths must be 1..spec.max_len). deadline: when
        its batches must have finished (finish_by); None: the SLO's, or none without one.
        Returns whether next_wake may have moved earlier (a bucket that was empty, one that
        is now full, or inputs with a deadline): else a worker asleep until next_wake need
        not wake for these inputs."""
        prio = priority if self.use_priority else 0
        if deadline is None or deadline == math.inf:
            deadline = finish_by(now, self.latency_slo_s) if self.latency_slo_s else math.inf
        elif deadline - now > self._max_budget_s:
            self._max_budget_s = deadline - now
        moved = deadline < math.inf
        lookup = self.spec.lookup
        for index, ids in enumerate(id_lists):
            n = len(ids)
            length = lookup(n)
            bucket = self._buckets[length]
            item = QueuedInput(ids, request, index, prio, now, self._seq, n, length, deadline)
            bucket.fifos.setdefault(prio, deque()).append(item)
            if deadline < math.inf:
                heapq.heappush(bucket.deadlines, (deadline, self._seq, item))
            bucket.live += 1
            if bucket.live == 1 or bucket.live >= self.capacity(length):
                moved = True
            self._seq += 1
        return moved

    def mark_dead(self) -> None:
        """A queued request finished early: sweep its inputs out of every bucket."""
        for bucket in self._buckets.values():
            bucket.fifos = {p: kept for p, fifo in bucket.fifos.items()
                            if (kept := deque(filter(_waiting, fifo)))}
            bucket.live = sum(map(len, bucket.fifos.values()))
            bucket.deadlines = [e for e in bucket.deadlines if _waiting(e[2])]
            heapq.heapify(bucket.deadlines)

    def drain(self) -> list[QueuedInput]:
        """Remove and return every queued input (shutdown)."""
        out = [item for b in self._buckets.values() for item in b.take(b.in_order())]
        self._buckets = {length: _Bucket() for length in self.spec.boundaries}
        return out

    def expired(self, now: float) -> list[Any]:
        """Requests (distinct, live) with an input queued longer than queue_timeout_s."""
        def late(item: QueuedInput) -> bool:
            return now - item.arrival > self.queue_timeout_s

        return list({id(item.request): item.request for bucket in self._buckets.values()
                     if any(map(late, bucket.heads()))
                     for item in bucket.in_order() if late(item)}.values())

    # ------------------------------------------------------------------ choosing a batch
    def batch_cost(self, length: int, n: int) -> float:
        """Predicted seconds to run n inputs of one bucket: full batches of cap(L), then the
        rest at its padded size (point 7; merging ignored, so an upper bound)."""
        cap = self.capacity(length)
        full, rest = divmod(n, cap)
        predict = self.cost.predict
        total = full * predict(length, self.padded_size(cap), cap) if full else 0.0
        return total + (predict(length, self.padded_size(rest), rest) if rest else 0.0)

    def busy_share(self, now: float | None = None) -> float | None:
        """Point 7: the share of its recent time (decayed over BUSY_TAU_S) the worker spent
        in batches, as of `now` (None: the last batch's end); None before any batch."""
        if self._last_end is None:
            return None
        busy, span = self._decayed(now if now is not None else self._last_end)
        return busy / span if span > 0 else 1.0

    def _decayed(self, t: float) -> tuple[float, float]:
        """(busy, span) carried from the last batch's end to time t (no batch between)."""
        gap = max(0.0, t - self._last_end)
        keep = math.exp(-gap / BUSY_TAU_S)
        return self._busy_s * keep, self._span_s * keep + gap

    def _with_deadlines(self) -> Iterator[tuple[float, int, int]]:
        """(earliest deadline, length, live inputs) of each bucket holding inputs with one."""
        for length, bucket in self._buckets.items():
            if bucket.live and (deadline := bucket.earliest_deadline()) < math.inf:
                yield deadline, length, bucket.live

    def start_times(self, now: float | None = None) -> dict[int, float]:
        """Point 7: the latest start of each bucket that holds inputs with deadlines (with
        `now`, -inf for every bucket while the worker is mostly idle)."""
        with_deadlines = list(self._with_deadlines())
        share = self.busy_share(now) if now is not None else None
        if share is not None and share < WAIT_MIN_BUSY:  # idle worker: no plan needed
            return {length: -math.inf for _, length, _ in with_deadlines}
        scale = 1.0 + COST_MARGIN
        jobs = sorted((deadline, length, self.batch_cost(length, live) * scale + WAKE_SLACK_S)
                      for deadline, length, live in with_deadlines)
        starts: dict[int, float] = {}
        later = math.inf  # the start of the next job in deadline order
        for deadline, length, cost in reversed(jobs):
            later = starts[length] = min(deadline, later) - cost
        recent = self.cost.recent_max()
        early = recent + self.guard_s
        # an idle worker waits for company at most about one batch's time (point 7)
        idle_until = math.inf
        if now is not None and self._in_flight == 0 and self._last_end is not None:
            idle_until = self._last_end + max(recent, WAKE_SLACK_S)
        return {length: -math.inf if not self.waiting_pays(length, self._buckets[length].live)
                else min(start - early, idle_until) for length, start in starts.items()}

    def waiting_pays(self, length: int, n: int) -> bool:
        """Point 7: would a full batch of this bucket cost per input enough less than its n
        inputs now (WAIT_GAIN) to wait for it? True where the table knows nothing yet."""
        cap = self.capacity(length)
        if n >= cap:
            return True  # full: ready anyway
        now_per = self.cost.predict(length, self.padded_size(n), n) / n
        full_per = self.cost.predict(length, self.padded_size(cap), cap) / cap
        return not (now_per > 0 and full_per > 0) or now_per >= WAIT_GAIN * full_per

    def batch_done(self, batch: Batch, rows: int, seconds: float, end: float) -> int:
        """Point 8: `batch` ran as `rows` rows in `seconds`, ending at `end`. Returns how many
        of its inputs finished after their deadline."""
        self._in_flight = max(0, self._in_flight - 1)
        self.cost.observe(batch.length, rows, seconds, inputs=batch.size)
        if self._last_end is None:
            self._busy_s = self._span_s = seconds
            self._last_end = end
        else:
            busy, self._span_s = self._decayed(end)
            # time covered, not summed: an asynchronous runner's batches overlap (the next
            # one is launched before this one is collected)
            self._busy_s = busy + min(seconds, max(0.0, end - self._last_end))
            self._last_end = max(end, self._last_end)
        deadlines = [item.deadline for item in batch.items if item.deadline < math.inf]
        if not deadlines:
            return 0
        slack = min(deadlines) - end
        if slack < 0:
            self.guard_s = min(self.guard_s - slack, self._max_budget_s)
        else:
            self.guard_s -= GUARD_DECAY * min(slack, self.guard_s)
        return sum(end > d for d in deadlines)

    def overloaded(self, now: float) -> bool:
        """Point 9: does the queue hold an input its bucket's next batch, run now, would
        finish after the input's deadline, and more work than the largest budget?"""
        if not any(now + self.cost.predict(length, self.padded_size(n), n) > deadline
                   for deadline, length, live in self._with_deadlines()
                   for n in [min(live, self.capacity(length))]):
            return False
        work = sum(self.batch_cost(length, bucket.live)
                   for length, bucket in self._buckets.items() if bucket.live)
        return work > self._max_budget_s

    def _ready_times(self, now: float
                     ) -> Iterator[tuple[int, _Bucket, list[QueuedInput], float, float]]:
        """(length, bucket, its FIFOs' heads, their oldest arrival, when the bucket is ready:
        point 2, <= now: ready) of every non-empty bucket."""
        starts = self.start_times(now)
        for length, bucket in self._buckets.items():
            if heads := list(bucket.heads()):
                oldest = min(h.arrival for h in heads)
                at = now if bucket.live >= self.capacity(length) else starts.get(length, math.inf)
                if not self.latency_slo_s:
                    at = min(at, oldest + self.max_queue_delay_s)
                yield length, bucket, heads, oldest, at

    def next_wake(self, now: float) -> float | None:
        """When the earliest not-yet-ready bucket becomes ready (None: nothing queued); a
        value <= now means some bucket is ready. Adding inputs can move it earlier."""
        return min((at for *_, at in self._ready_times(now)), default=None)

    def pop_batch(self, now: float) -> Batch | None:
        """The next batch to run (docstring points 2-4, 7), removed from the queue; None when
        no bucket is ready."""
        best: tuple[tuple[int, float, float, float, int], int] | None = None
        overload = self.overloaded(now)
        starving = now - STARVE_SHARE * self.queue_timeout_s  # arrived before: oldest first
        for length, bucket, heads, oldest, at in self._ready_times(now):
            if at <= now:
                prio = min(h.priority for h in heads)
                seq = min(h.seq for h in heads if h.priority == prio)
                # point 9: under overload a starving bucket (oldest first), then the fullest
                starve = oldest if overload and oldest <= starving else math.inf
                fill = -min(bucket.live, cap := self.target(length)) / cap if overload else 0.0
                key = (prio, starve, fill, bucket.earliest_deadline(), seq)
                if best is None or key < best[0]:
                    best = (key, length)
        if best is None:
            return None
        length = best[1]
        limit = self.batch_limit(length, overload)
        bucket = self._buckets[length]  # up to `limit` inputs, best first
        items = bucket.take(itertools.islice(bucket.in_order(), limit))
        batch = Batch(length, items, overload=overload)
        if len(items) < limit and self.max_merged_padding > 0:
            self._merge(batch)
        if self.graph_sizes:
            self._fit_graph_size(batch)
        self._in_flight += 1
        return batch

    def batch_failed(self, batch: Batch) -> None:
        """A batch pop_batch gave will not reach batch_done (its model call failed)."""
        self._in_flight = max(0, self._in_flight - 1)

    def padded_size(self, n: int) -> int:
        """Rows a batch of n inputs is computed at (point 5)."""
        if not self.graph_sizes:
            return n
        return round_up_batch_size(n, self.graph_sizes) or n

    def _fit_graph_size(self, batch: Batch) -> None:
        """Point 5: cut the batch to a captured size when padding rows would waste too much."""
        n = batch.size
        up = self.padded_size(n)
        useful = sum(item.length for item in batch.items)
        if up == n or 1.0 - useful / (up * batch.length) <= self.max_merged_padding:
            return
        down = max((b for b in self.graph_sizes or () if b <= n), default=None)
        if down is None:
            return
        kept, back = batch.items[:down], batch.items[down:]
        for item in back:  # still in their FIFOs (nothing drops them before pop_batch
            item.queued = True  # returns): they run next, in their own order
            self._buckets[item.bucket].live += 1
        batch.items = kept
        batch.length = max(item.bucket for item in kept)
        batch.merged = any(item.bucket != batch.length for item in kept)

    def _merge(self, batch: Batch) -> None:
        """Tops the batch up with other buckets' inputs within the padding bound (point 4)."""
        items = batch.items
        n = len(items)
        useful = sum(item.length for item in items)
        bound = self.max_merged_padding
        bounds = self.spec.boundaries
        first = bounds.index(batch.length)
        best: tuple[int, float, int] | None = None  # (-(n + k), waste, T index) of the best
        best_take: list[QueuedInput] = []
        for t in range(first, len(bounds)):
            T = bounds[t]
            room = self.batch_limit(T, batch.overload) - n
            if room <= 0:
                if batch.overload:
                    continue  # targets need not fall with the length, as capacities do
                break  # larger T hold no more inputs (capacity falls with the length)
            if (n * T - useful) / ((n + room) * T) > bound:
                continue  # even `room` inputs of length T could not dilute the padding enough
            if t > first and not self._buckets[T].live:
                continue  # T is only a batch length when an input of bucket T joins
            taken: list[QueuedInput] = []
            k_best, waste_best, total = 0, 0.0, useful
            for b in range(t, -1, -1):
                if len(taken) == room:
                    break
                if b == first and t == first:
                    continue  # the batch's own bucket: already taken
                below = bounds[b] < (1.0 - bound) * T
                for item in self._buckets[bounds[b]].in_order():
                    taken.append(item)
                    total += item.length
                    waste = 1.0 - total / ((n + len(taken)) * T)
                    if waste <= bound:
                        k_best, waste_best = len(taken), waste
                    elif below:
                        break  # shorter inputs only lower the average further
                    if len(taken) == room:
                        break
                if below and 1.0 - total / ((n + len(taken)) * T) > bound:
                    break
            if k_best and (best is None or (-(n + k_best), waste_best, t) < best):
                best = (-(n + k_best), waste_best, t)
                best_take = taken[:k_best]
        if best is None:
            return
        length = bounds[best[2]]
        for item in best_take:
            self._buckets[item.bucket].take([item])
        items += best_take
        batch.length = length
        batch.merged = any(item.bucket != length for item in items)
