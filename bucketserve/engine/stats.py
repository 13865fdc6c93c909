"""Per-step statistics, kept in memory and read by the server's /metrics."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

# upper bounds (seconds) of the engine step-time histogram (/metrics bucketserve_engine_step_seconds)
STEP_TIME_BOUNDS = tuple(ms / 1000 for ms in (
    0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 15, 20, 25, 30, 40, 50, 75,
    100, 150, 200, 300, 500, 1000, 2500))


@dataclass(frozen=True)
class StepStats:
    kind: str  # "prefill", "decode" or "mixed"
    bucket: int  # prefill: length bucket of the longest chunk; decode: decode batch bucket
    num_seqs: int
    num_prefill_seqs: int
    num_decode_seqs: int
    computed_tokens: int  # tokens run through the model, padding and recomputation included
    useful_tokens: int  # tokens whose K/V was computed for the first time
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_waiting: int
    num_running: int
    step_time_s: float
    # rows computed beyond the step's tokens: a decode graph's dummy rows, a piecewise graph's
    # padding up to its captured token count (0 for eager steps); part of computed_tokens
    padding_tokens: int = 0


class EngineStats:
    """Running totals plus the most recent steps. Written by the engine thread, read by
    any thread (a lock guards the counters)."""

    def __init__(self, history: int = 1024) -> None:
        self._lock = threading.Lock()
        self.recent: deque[StepStats] = deque(maxlen=history)
        self.num_steps = 0
        self.preemptions_total = 0
        self.computed_tokens_total = 0
        self.useful_tokens_total = 0
        self.bucket_steps: Counter[tuple[str, int]] = Counter()
        # per step kind ("prefill", "decode", "mixed"): tokens computed (padding included)
        # and padding rows of compiled shapes among them
        self.kind_computed_tokens: Counter[str] = Counter()
        self.kind_padding_tokens: Counter[str] = Counter()
        self.batch_sizes: Counter[tuple[str, int]] = Counter()  # (kind, sequences in the step)
        # steps per STEP_TIME_BOUNDS bucket (index len(STEP_TIME_BOUNDS): above the last), and
        # the steps' seconds in all
        self.step_time_counts: Counter[int] = Counter()
        self.step_time_sum_s = 0.0
        self.finished: Counter[str] = Counter()
        # also told of every finish (the server's metrics across --api-workers processes)
        self.on_finished: Callable[[str], None] | None = None
        self.num_waiting = 0
        self.num_running = 0
        self.kv_blocks_used = 0
        self.kv_blocks_total = 0
        # prefix cache (block_manager.py): prompt tokens looked up at admission, of those
        # served from the cache (totals), blocks registered in the cache now
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.prefix_cache_blocks = 0

    def record(self, s: StepStats) -> None:
        with self._lock:
            self.recent.append(s)
            self.num_steps += 1
            self.preemptions_total += s.num_preemptions
            self.computed_tokens_total += s.computed_tokens
            self.useful_tokens_total += s.useful_tokens
            self.bucket_steps[(s.kind, s.bucket)] += 1
            self.kind_computed_tokens[s.kind] += s.computed_tokens
            self.kind_padding_tokens[s.kind] += s.padding_tokens
            self.batch_sizes[(s.kind, s.num_seqs)] += 1
            self.step_time_counts[bisect_left(STEP_TIME_BOUNDS, s.step_time_s)] += 1
            self.step_time_sum_s += s.step_time_s
            self.num_waiting, self.num_running = s.num_waiting, s.num_running
            self.kv_blocks_used, self.kv_blocks_total = s.kv_blocks_used, s.kv_blocks_total

    def record_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1
        if self.on_finished is not None:
            self.on_finished(reason)

    def set_queue(self, num_waiting: int, num_running: int, kv_blocks_used: int) -> None:
        with self._lock:
            self.num_waiting, self.num_running = num_waiting, num_running
            self.kv_blocks_used = kv_blocks_used

    def set_prefix_cache(self, queries_total: int, hits_total: int, cached_blocks: int) -> None:
        with self._lock:
            self.prefix_cache_queries_total = queries_total
            self.prefix_cache_hits_total = hits_total
            self.prefix_cache_blocks = cached_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """hits / queries in tokens over the whole run (0 before any lookup)."""
        if not self.prefix_cache_queries_total:
            return 0.0
        return self.prefix_cache_hits_total / self.prefix_cache_queries_total

    @property
    def padding_waste(self) -> float:
        """1 - useful / computed over the whole run (0 before any step)."""
        if not self.computed_tokens_total:
            return 0.0
        return 1.0 - self.useful_tokens_total / self.computed_tokens_total

    def padding_share(self, kind: str | None = None) -> float:
        """Padding rows of compiled shapes / tokens computed, for one step kind or (None) all
        steps (0 before any step)."""
        with self._lock:
            kinds = [kind] if kind is not None else list(self.kind_computed_tokens)
            computed = sum(self.kind_computed_tokens[k] for k in kinds)
            padding = sum(self.kind_padding_tokens[k] for k in kinds)
        return padding / computed if computed else 0.0

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "num_steps": self.num_steps,
                "preemptions_total": self.preemptions_total,
                "computed_tokens_total": self.computed_tokens_total,
                "useful_tokens_total": self.useful_tokens_total,
                "bucket_steps": dict(self.bucket_steps),
                "kind_computed_tokens": dict(self.kind_computed_tokens),
                "kind_padding_tokens": dict(self.kind_padding_tokens),
                "batch_sizes": dict(self.batch_sizes),
                "step_time_counts": dict(self.step_time_counts),
                "step_time_sum_s": self.step_time_sum_s,
                "finished": dict(self.finished),
                "num_waiting": self.num_waiting,
                "num_running": self.num_running,
                "kv_blocks_used": self.kv_blocks_used,
                "kv_blocks_total": self.kv_blocks_total,
                "prefix_cache_queries_total": self.prefix_cache_queries_total,
                "prefix_cache_hits_total": self.prefix_cache_hits_total,
                "prefix_cache_blocks": self.prefix_cache_blocks,
            }
