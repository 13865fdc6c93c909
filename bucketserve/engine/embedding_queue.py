"""The embedding batcher's queue: which bucket runs next, merging, deadlines. No threads, no
clock: every method takes `now`, so its tests step time by hand instead of sleeping.

Queueing model (EmbeddingBatcher's worker calls `pop_batch` / `next_wake` under its lock):

1. Each input waits on its own in the bucket of its length: the smallest boundary >= len(ids).
   Within a bucket, inputs wait in one FIFO per priority value (policy "fcfs": all share one).
2. A bucket of length L holds at most cap(L) = min(preferred_batch_size, max_batch_tokens // L)
   inputs per batch (under overload with deadlines target(L) <= cap(L), point 10). It is
   *ready* when it holds cap(L) live inputs, or when its wait is over:
   - fixed delay (latency_slo_s == 0): its oldest input has waited max_queue_delay_s;
   - deadlines (point 7): its predicted batch can no longer wait without missing a deadline.
   With latency_slo_s > 0 every input has a deadline and max_queue_delay_s is not used; with
   latency_slo_s == 0 only inputs given one (a request's deadline header) have a deadline, and
   it can only make their bucket run earlier than the fixed delay.
3. Among ready buckets, the one holding the best input runs: lowest priority value, then the
   earliest deadline, then the earliest arrival. It gives up to cap(L) inputs in priority then
   arrival order: one [B, L] batch. Under overload (point 9) the fullest ready bucket runs
   instead (lowest priority value still first).
4. Merging (max_merged_padding > 0): a batch with fewer than cap(L) inputs is topped up with
   queued inputs of other buckets (ready or not), padded to the largest bucket length among
   them, so the batch still has a bucket shape. For each target length T >= L that holds
   inputs, the candidates are the inputs of bucket T, then of the next smaller bucket, and so
   on (longest buckets first; within a bucket, priority then arrival): the first k of them
   join, with k the largest such that the batch's waste 1 - sum(lengths) / (B * T) stays
   <= max_merged_padding and B <= cap(T). The target giving the most inputs wins (then the
   least waste, then the shorter T). A batch its own bucket fills is never topped up. The
   inputs taken are heads of their FIFOs, so merging costs O(cap) per target, not a sort of
   the queue.
5. Compiled shapes (graph_sizes given: the CUDA graph batch sizes): a batch of n inputs runs
   at the smallest size >= n, the extra rows computed for nothing. When those rows would make
   the batch's waste 1 - sum(lengths) / (size * L) exceed max_merged_padding, the batch is cut
   to the largest size <= n instead and the inputs cut off go back to their queues (they run
   next, at their own exact size or with later arrivals). Above the largest size a batch runs
   eagerly at its own size: no padding rows.
6. Inputs of requests that finished early (cancelled, failed, timed out) are skipped when they
   reach the head of a FIFO, or swept out of the buckets `mark_dead` names. `expired(now)`
   hands back the requests whose oldest input waited longer than queue_timeout_s.
7. Deadlines (the feedback loop). An input's deadline is when its batch must have finished:
   arrival + latency_slo_s x (1 - SLO_RESERVE) unless its request named its own budget; the
   reserve is left for the path outside the batch (tokenizing, the response, the network).
   Each bucket holding inputs with deadlines is one job: its earliest deadline d, and the
   predicted cost c of running what it holds now (the cost table, embedding_cost.py: ceil(n /
   cap) batches, the last at its padded size) x (1 + COST_MARGIN) + WAKE_SLACK_S. Jobs run
   one after another on one worker, so in earliest-deadline order the latest start of job k is
       start_k = min(d_k - c_k, start_{k+1} - c_k)      (backward from the last job)
   less a blocking allowance, the longest recent batch (a batch started for another bucket
   meanwhile, e.g. one that filled, runs to its end first), less the guard below. A bucket
   is ready once now >= its start, and at once when waiting would not pay: when the cost
   table says a full batch costs per input no less than 1 / WAIT_GAIN of what its n inputs
   cost per input now (cost(L, cap) / cap x WAIT_GAIN > cost(L, n) / n: a CPU, where a
   forward costs about in proportion to its tokens, for long inputs). Waiting then only
   spends the budget that host stalls need. While a bucket waits, more inputs join it; its
   cost grows, its start moves earlier, and a full bucket runs at once. Merging (point 4) and
   graph sizes (point 5) then shape the batch as without deadlines. A deadline that cannot be
   met any more only makes its bucket ready; nothing is refused for it.
   Nothing waits either while the worker is mostly idle: below WAIT_MIN_BUSY of its recent
   time spent in batches (an exponentially decayed share over about BUSY_TAU_S, `busy_share`),
   every bucket with deadlines is ready at once. An idle worker gains nothing from a fuller
   batch (throughput is the offered rate either way) and the wait is pure latency; inputs
   pile up by themselves while a batch runs, so batches grow with the load. Waiting pays only
   near saturation, where a fuller batch's lower cost per input is what keeps up (on the
   H200, where a batch costs about what one input does, the loop without this rule waited
   to its 50 ms SLO at every rate and fell behind at 2,000 texts/s, while a fixed delay of 0
   ran at p99 3-41 ms: bench/issue15_h200.sh). And a busy worker that has gone idle (no
   batch popped and not yet done) lets a bucket wait for company at most the longest recent
   batch after the last one ended: company that has not come within about a batch's time is
   not on its way (the end of a burst), and a wait to the planned start would be latency
   bought with nothing (on the H200 the last inputs of a 2,000 texts/s run waited up to ~40
   ms for it, 2% of the run's throughput).
8. The feedback (`batch_done`, called with each batch's measured time): the batch's shape
   updates the cost table, and its earliest deadline against its end updates the guard: a
   batch that ended s seconds late raises the guard by s at once; one that ended on time
   lowers it by GUARD_DECAY x min(its slack, the guard). Misses (cost noise on a shared host,
   a late wake-up, inputs merged into a batch, work that arrived while a bucket waited) so
   make every bucket start earlier, and on-time batches slowly give the time back; the guard
   never exceeds the largest budget seen (then nothing waits: the fixed delay 0). Batches
   late under overload (point 9) raise it too: on a shared host a backlog is mostly a stall,
   and the guard it leaves makes the next stall cost fewer misses (a variant that ignored
   batches already lost when they started missed the SLO at 15 and 30 texts/s where fixed
   delays met it, bench/embedding_slo_sweep.py on the 2-core CPU). While it is high every
   bucket is ready at once, which under overload only widens the choice of point 9.
9. Overload: a queued input is *lost* (its bucket's next batch, run now, would end after its
   deadline: nothing the queue does can make it on time any more) and the queued work, at the
   cost table's prediction, exceeds the largest budget (the SLO): a backlog, not one late
   input. Then waiting one more batch only adds that batch's run time to a lost input's
   lateness, and the choice among ready buckets (lost buckets are always ready, so the worker
   never idles) maximises throughput: the fullest bucket, min(live, cap(L)) / cap(L), runs
   first; then the rule of point 3 (priority, deadline, arrival) breaks ties. Full batches
   keep running while the backlog lasts and partial buckets fill meanwhile, where oldest-first
   would dispatch the small batches of the buckets its oldest inputs happen to sit in.
   Starvation bound: an input that has waited longer than STARVE_SHARE x queue_timeout_s puts
   its bucket ahead of every fuller one (oldest first), so fullest-first never lets an input
   time out that oldest-first would have served. Without a backlog (a late input in a short
   queue: a burst, a slow batch) point 3 (earliest deadline first) stands: the inputs that can
   still be on time are, and the late one goes first among its peers.

10. Batch size under overload. A batch takes up to cap(L) inputs (point 2), except with
   deadlines under overload (point 9), where throughput is what counts: then it takes up to
   target(L) <= cap(L) (merging's room counts against it too): of the candidate sizes (the
   graph sizes below cap(L) on CUDA, the powers of two below it otherwise, and cap(L)), the
   largest whose predicted cost per input (the cost table, at the padded size) is within
   TARGET_TOLERANCE of the least. Where a batch's cost per input falls with its size (a GPU;
   short inputs on a CPU) that is cap(L); where it rises again (long inputs on a 2-core Xeon:
   an L=184 MiniLM batch cost 16.0 ms an input at 4-8 rows and 19.1 at 32, activations out of
   cache) the cheaper size drains the backlog faster. Outside overload the smaller batches
   did not pay (2-core Xeon at 100 texts/s, its capacity: 86 vs 92 texts/s with target(L)
   everywhere, the extra batches' own costs), so readiness, planning and waiting_pays count
   in cap(L) as before.

Per batch the work is O(buckets x priorities + B), not O(inputs queued): an offline request
of 20,000 inputs is drained in ~600 batches without rescanning the queue each time.
"""

from __future__ import annotations

import heapq
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
    fifos: dict[int, deque[QueuedInput]] = field(default_factory=dict)  # priority -> FIFO
    live: int = 0  # inputs queued here whose request is not done (skipped ones excluded)
    # (deadline, seq, input) of inputs with a finite deadline; entries of inputs taken or
    # dead are dropped lazily when they reach the top
    deadlines: list[tuple[float, int, QueuedInput]] = field(default_factory=list)

    def earliest_deadline(self) -> float:
        heap = self.deadlines
        while heap and (not heap[0][2].queued or heap[0][2].request.done):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def heads(self) -> Iterator[QueuedInput]:
        """The live head of every non-empty FIFO (dead heads are dropped on the way)."""
        for prio in list(self.fifos):
            fifo = self.fifos[prio]
            while fifo and fifo[0].request.done:
                fifo.popleft()
                self.live -= 1
            if fifo:
                yield fifo[0]
            else:
                del self.fifos[prio]


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

    @property
    def num_live(self) -> int:
        return sum(b.live for b in self._buckets.values())

    def live_per_bucket(self) -> dict[int, int]:
        return {length: b.live for length, b in self._buckets.items() if b.live}

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
            fifo = bucket.fifos.get(prio)
            if fifo is None:
                fifo = bucket.fifos[prio] = deque()
            item = QueuedInput(ids, request, index, prio, now, self._seq, n, length, deadline)
            fifo.append(item)
            if deadline < math.inf:
                heapq.heappush(bucket.deadlines, (deadline, self._seq, item))
            bucket.live += 1
            if bucket.live == 1 or bucket.live >= self.capacity(length):
                moved = True
            self._seq += 1
        return moved

    def mark_dead(self, bucket_lengths: Iterable[int]) -> None:
        """A request queued in these buckets finished early: sweep its inputs out of them."""
        for length in set(bucket_lengths):
            bucket = self._buckets[length]
            for prio, fifo in list(bucket.fifos.items()):
                kept = deque(item for item in fifo if not item.request.done)
                if kept:
                    bucket.fifos[prio] = kept
                else:
                    del bucket.fifos[prio]
            bucket.live = sum(map(len, bucket.fifos.values()))
            bucket.deadlines = [e for e in bucket.deadlines if not e[2].request.done]
            heapq.heapify(bucket.deadlines)

    def drain(self) -> list[QueuedInput]:
        """Remove and return every queued input (shutdown)."""
        out = [item for b in self._buckets.values() for fifo in b.fifos.values() for item in fifo]
        for b in self._buckets.values():
            b.fifos.clear()
            b.deadlines.clear()
            b.live = 0
        for item in out:
            item.queued = False
        return out

    def expired(self, now: float) -> list[Any]:
        """Requests (distinct, live) with an input queued longer than queue_timeout_s."""
        out: dict[int, Any] = {}
        for bucket in self._buckets.values():
            for head in bucket.heads():
                if now - head.arrival <= self.queue_timeout_s:
                    continue
                for fifo in bucket.fifos.values():
                    for item in fifo:
                        if now - item.arrival > self.queue_timeout_s and not item.request.done:
                            out[id(item.request)] = item.request
        return list(out.values())

    # ------------------------------------------------------------------ choosing a batch
    def _oldest(self, bucket: _Bucket) -> float | None:
        return min((h.arrival for h in bucket.heads()), default=None)

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

    def start_times(self, now: float | None = None) -> dict[int, float]:
        """Point 7: the latest start of each bucket that holds inputs with deadlines (with
        `now`, -inf for every bucket while the worker is mostly idle)."""
        with_deadlines = []  # (earliest deadline, length, live inputs)
        for length, bucket in self._buckets.items():
            if bucket.live:
                deadline = bucket.earliest_deadline()
                if deadline < math.inf:
                    with_deadlines.append((deadline, length, bucket.live))
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
        lost = False
        for length, bucket in self._buckets.items():
            if not bucket.live:
                continue
            deadline = bucket.earliest_deadline()
            if deadline == math.inf:
                continue
            n = min(bucket.live, self.capacity(length))
            if now + self.cost.predict(length, self.padded_size(n), n) > deadline:
                lost = True
                break
        if not lost:
            return False
        work = sum(self.batch_cost(length, bucket.live)
                   for length, bucket in self._buckets.items() if bucket.live)
        return work > self._max_budget_s

    def _ready_at(self, length: int, bucket: _Bucket, oldest: float, now: float,
                  starts: dict[int, float]) -> float:
        """When this non-empty bucket is ready (point 2); <= now: ready."""
        if bucket.live >= self.capacity(length):
            return now
        at = starts.get(length, math.inf)
        if not self.latency_slo_s:
            at = min(at, oldest + self.max_queue_delay_s)
        return at

    def next_wake(self, now: float) -> float | None:
        """When the earliest not-yet-ready bucket becomes ready (None: nothing queued); a
        value <= now means some bucket is ready. Adding inputs can move it earlier."""
        wake = None
        starts = self.start_times(now)
        for length, bucket in self._buckets.items():
            oldest = self._oldest(bucket)
            if oldest is None:
                continue
            at = self._ready_at(length, bucket, oldest, now, starts)
            wake = at if wake is None else min(wake, at)
        return wake

    def pop_batch(self, now: float) -> Batch | None:
        """The next batch to run (docstring points 2-4, 7), removed from the queue; None when
        no bucket is ready."""
        best: tuple[tuple[int, float, float, float, int], int] | None = None
        starts = self.start_times(now)
        overload = self.overloaded(now)
        starving = now - STARVE_SHARE * self.queue_timeout_s  # arrived before: oldest first
        for length, bucket in self._buckets.items():
            heads = list(bucket.heads())
            if not heads:
                continue
            oldest = min(h.arrival for h in heads)
            if self._ready_at(length, bucket, oldest, now, starts) <= now:
                prio = min(h.priority for h in heads)
                seq = min(h.seq for h in heads if h.priority == prio)
                # point 9: under overload a starving bucket (oldest first), then the fullest
                starve, fill = math.inf, 0.0
                if overload:
                    cap = self.target(length)
                    fill = -min(bucket.live, cap) / cap
                    if oldest <= starving:
                        starve = oldest
                key = (prio, starve, fill, bucket.earliest_deadline(), seq)
                if best is None or key < best[0]:
                    best = (key, length)
        if best is None:
            return None
        length = best[1]
        limit = self.batch_limit(length, overload)
        items = self._take(length, limit)
        batch = Batch(length, items)
        if len(items) < limit and self.max_merged_padding > 0:
            self._merge(batch, overload)
        if self.graph_sizes:
            self._fit_graph_size(batch)
        batch.overload = overload
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
        for item in back:
            bucket = self._buckets[item.bucket]
            fifo = bucket.fifos.get(item.priority)
            if fifo is None:
                fifo = bucket.fifos[item.priority] = deque()
            i = 0  # back in arrival order (these are mostly at the front)
            while i < len(fifo) and fifo[i].seq < item.seq:
                i += 1
            fifo.insert(i, item)
            bucket.live += 1
            item.queued = True
            if item.deadline < math.inf:
                heapq.heappush(bucket.deadlines, (item.deadline, item.seq, item))
        batch.items = kept
        batch.length = max(item.bucket for item in kept)
        batch.merged = any(item.bucket != batch.length for item in kept)

    def _take(self, length: int, n: int) -> list[QueuedInput]:
        """Up to n live inputs of one bucket, best first (priority, then arrival)."""
        bucket = self._buckets[length]
        taken: list[QueuedInput] = []
        for prio in sorted(bucket.fifos):
            fifo = bucket.fifos[prio]
            while fifo and len(taken) < n:
                item = fifo.popleft()
                item.queued = False
                bucket.live -= 1
                if not item.request.done:
                    taken.append(item)
            if not fifo:
                del bucket.fifos[prio]
            if len(taken) == n:
                break
        return taken

    def _live_in_order(self, length: int) -> Iterator[QueuedInput]:
        """Live inputs of one bucket, best first (priority, then arrival)."""
        bucket = self._buckets[length]
        for prio in sorted(bucket.fifos):
            for item in bucket.fifos[prio]:
                if not item.request.done:
                    yield item

    def _merge(self, batch: Batch, overload: bool = False) -> None:
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
            room = self.batch_limit(T, overload) - n
            if room <= 0:
                if overload:
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
                for item in self._live_in_order(bounds[b]):
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
            items.append(item)
        self._remove(best_take)
        batch.length = length
        batch.merged = any(item.bucket != length for item in items)

    def _remove(self, taken: list[QueuedInput]) -> None:
        """Takes these queued inputs out of their buckets. _merge takes the live heads of
        FIFOs in order, so they come off the front (dead inputs between them too)."""
        for item in taken:
            item.queued = False
        wanted = {id(item) for item in taken}
        for length in {item.bucket for item in taken}:
            bucket = self._buckets[length]
            for prio in list(bucket.fifos):
                fifo = bucket.fifos[prio]
                while fifo and wanted and (id(fifo[0]) in wanted or fifo[0].request.done):
                    wanted.discard(id(fifo.popleft()))
                    bucket.live -= 1
                if wanted and any(id(item) in wanted for item in fifo):  # not at the front
                    kept = deque(item for item in fifo if id(item) not in wanted)
                    bucket.live -= len(fifo) - len(kept)
                    wanted -= {id(item) for item in fifo}
                    bucket.fifos[prio] = fifo = kept
                if not fifo:
                    del bucket.fifos[prio]
