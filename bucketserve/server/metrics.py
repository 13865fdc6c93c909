"""Prometheus metrics for GET /metrics.

Two sources:
- engine state and running totals (queue lengths, KV blocks, tokens, bucket steps,
  preemptions, finished requests by reason: aborted ones too, whose client is gone) are read from `EngineStats` at scrape time by a custom collector, so a
  scrape always shows the value after the engine's latest step and nothing is counted twice;
- per-request latencies are observed by the server when a choice finishes,
  from the engine's own timestamps in `RequestOutput.metrics` (monotonic seconds:
  arrival, first_scheduled, first_token, finished).

Each app owns its registry (no global state), so several apps can live in one process.

Several front-end processes (`serve --api-workers N`): every one receives every engine
step's stats (engine/core.py, Router), so the engine series are whole in each and are read
from the process that answers the scrape. The per-request series (latency histograms and
finished requests by reason) are each process's own; they are kept in prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the parent for all workers) and summed
over the workers at scrape time, so any worker's /metrics shows the whole server.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from bucketserve.engine.outputs import RequestOutput
from bucketserve.engine.stats import STEP_TIME_BOUNDS, EngineStats
from bucketserve.server.request_log import RequestLog

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0, 300.0, 600.0)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                      0.5, 0.75, 1.0, 2.5)


class EngineStatsCollector(Collector):
    """Exports EngineStats.snapshot() as gauges and counters on every scrape."""

    def __init__(self, get_stats: Callable[[], EngineStats], finished: bool = True,
                 get_info: Callable[[], dict[str, str]] | None = None) -> None:
        self.get_stats = get_stats
        self.finished = finished  # False: another collector exports the finished requests
        self.get_info = get_info

    def collect(self) -> Iterator[Metric]:
        if self.get_info is not None:
            info = self.get_info()
            labels = sorted(info)
            family = GaugeMetricFamily(
                "bucketserve_engine_info", "What the engine runs (always 1): model, device, "
                "dtype, quantization, kv_cache_dtype, structured_backend.", labels=labels)
            family.add_metric([info[k] for k in labels], 1)
            yield family
        snap = self.get_stats().snapshot()
        for name, key, doc in (
            ("bucketserve_requests_running", "num_running", "Sequences in the running set."),
            ("bucketserve_requests_waiting", "num_waiting", "Sequences in the waiting queue."),
            ("bucketserve_kv_blocks_used", "kv_blocks_used", "KV-cache blocks in use."),
            ("bucketserve_kv_blocks_total", "kv_blocks_total", "Usable KV-cache blocks in the pool."),
            ("bucketserve_prefix_cache_blocks", "prefix_cache_blocks",
             "KV blocks registered in the prefix cache (held by sequences or evictable)."),
        ):
            yield GaugeMetricFamily(name, doc, value=snap[key])
        for name, key, doc in (
            ("bucketserve_preemptions", "preemptions_total", "Sequences preempted by recompute."),
            ("bucketserve_computed_tokens", "computed_tokens_total",
             "Tokens run through the model, padding and recomputation included."),
            ("bucketserve_useful_tokens", "useful_tokens_total",
             "Tokens whose K/V was computed for the first time."),
            ("bucketserve_engine_steps", "num_steps", "Engine steps that ran the model."),
            ("bucketserve_prefix_cache_queries", "prefix_cache_queries_total",
             "Tokens of admitted sequences looked up in the prefix cache."),
            ("bucketserve_prefix_cache_hits", "prefix_cache_hits_total",
             "Of the looked-up tokens, those whose K/V came from the prefix cache."),
        ):
            yield CounterMetricFamily(name, doc, value=snap[key])
        steps = CounterMetricFamily("bucketserve_bucket_steps",
                                    "Engine steps per step kind and bucket.",
                                    labels=["kind", "bucket"])
        for (kind, bucket), count in sorted(snap["bucket_steps"].items()):
            steps.add_metric([kind, str(bucket)], count)
        yield steps
        for name, key, doc in (
            ("bucketserve_step_computed_tokens", "kind_computed_tokens",
             "Tokens run through the model per step kind, padding of compiled shapes included."),
            ("bucketserve_step_padding_tokens", "kind_padding_tokens",
             "Padding tokens of compiled shapes (graph sizes above the step's real tokens) per step kind."),
        ):
            family = CounterMetricFamily(name, doc, labels=["kind"])
            for kind, count in sorted(snap.get(key, {}).items()):
                family.add_metric([kind], count)
            yield family
        yield _batch_size_histogram(snap["batch_sizes"])
        yield _step_time_histogram(snap["step_time_counts"], snap["step_time_sum_s"])
        if not self.finished:
            return
        finished = CounterMetricFamily("bucketserve_request_success",
                                       "Finished engine requests (one per choice) by finish reason.",
                                       labels=["finish_reason"])
        for reason, count in sorted(snap["finished"].items()):
            finished.add_metric([reason], count)
        yield finished


def size_buckets(sizes: dict[int, int], top: int) -> list[tuple[str, int]]:
    """A histogram's cumulative (le, count) of sizes ({size: count}) over the powers of two up
    to the one >= top, then +Inf."""
    bounds = [1 << i for i in range(top.bit_length() + 1)]
    cumulative = [(str(le), sum(c for n, c in sizes.items() if n <= le)) for le in bounds]
    return cumulative + [("+Inf", sum(sizes.values()))]


def slot_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, int]]:
    """A histogram's cumulative (le, count) from counts per slot (slot i: values <= bounds[i],
    the last slot: the rest)."""
    return list(zip([*map(str, bounds), "+Inf"], itertools.accumulate(counts), strict=True))


def _batch_size_histogram(counts: dict[tuple[str, int], int]) -> HistogramMetricFamily:
    """Sequences per engine step, per step kind, in power-of-two buckets."""
    hist = HistogramMetricFamily("bucketserve_step_batch_size",
                                 "Sequences per engine step, per step kind.", labels=["kind"])
    for kind in sorted({k for k, _ in counts}):
        sizes = {n: c for (k, n), c in counts.items() if k == kind}
        hist.add_metric([kind], size_buckets(sizes, max(sizes)),
                        sum_value=sum(n * c for n, c in sizes.items()))
    return hist


def _step_time_histogram(counts: dict[int, int], total_s: float) -> HistogramMetricFamily:
    """Engine step times (StepStats.step_time_s: scheduling, launch and, with overlapped
    scheduling, the wait for the previous step's tokens)."""
    hist = HistogramMetricFamily("bucketserve_engine_step_seconds",
                                 "Engine step time as the engine measures it.")
    slots = [counts.get(i, 0) for i in range(len(STEP_TIME_BOUNDS) + 1)]
    hist.add_metric([], slot_buckets(STEP_TIME_BOUNDS, slots), sum_value=total_s)
    return hist


def multiprocess() -> bool:
    """Whether this process is one of several front ends (`serve --api-workers N`)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class ServerMetrics:
    def __init__(self, get_stats: Callable[[], EngineStats],
                 get_info: Callable[[], dict[str, str]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.shared: CollectorRegistry | None = None
        own = self.registry
        if multiprocess():
            from prometheus_client.multiprocess import MultiProcessCollector

            self.shared = CollectorRegistry()
            MultiProcessCollector(self.shared)
            own = None  # written to the shared directory, read by MultiProcessCollector
            finished = Counter("bucketserve_request_success",
                               "Finished engine requests (one per choice) by finish reason.",
                               ["finish_reason"], registry=None)
            self.finished_by_reason = finished
        self.registry.register(EngineStatsCollector(get_stats, finished=self.shared is None,
                                                    get_info=get_info))
        self.ttft = Histogram(
            "bucketserve_time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS, registry=own)
        self.tpot = Histogram(
            "bucketserve_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=_PER_TOKEN_BUCKETS, registry=own)
        self.e2e = Histogram(
            "bucketserve_e2e_request_latency_seconds", "Arrival to finish.",
            buckets=_LATENCY_BUCKETS, registry=own)
        self.queue_time = Histogram(
            "bucketserve_queue_time_seconds", "Arrival to first scheduled step.",
            buckets=_LATENCY_BUCKETS, registry=own)
        # streamed generation: events that carried tokens, and those tokens (server/streaming.py)
        self.sse_events = Counter(
            "bucketserve_sse_token_events",
            "SSE events sent that carried generated tokens (one per engine step per choice), "
            "per endpoint.", ["endpoint"], registry=own)
        self.sse_tokens = Counter(
            "bucketserve_sse_tokens",
            "Generated tokens sent in SSE events, per endpoint; divided by "
            "bucketserve_sse_token_events_total: tokens per event.", ["endpoint"], registry=own)
        self.request_log: RequestLog | None = None  # `serve --request-log FILE`

    def count_finished(self, reason: str) -> None:
        """EngineStats.on_finished in multiprocess mode."""
        self.finished_by_reason.labels(reason).inc()

    def count_stream(self, endpoint: str, events: int, tokens: int) -> None:
        """A stream's token events and their tokens (counted once, when it ends)."""
        if events:
            self.sse_events.labels(endpoint).inc(events)
            self.sse_tokens.labels(endpoint).inc(tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        if self.request_log is not None:
            self.request_log.record_generation(out)
        m = out.metrics
        arrival = m.get("arrival")
        if arrival is None:
            return
        if "first_scheduled" in m:
            self.queue_time.observe(m["first_scheduled"] - arrival)
        if "first_token" in m:
            self.ttft.observe(m["first_token"] - arrival)
        if "finished" in m:
            self.e2e.observe(m["finished"] - arrival)
            if "first_token" in m and out.num_output_tokens > 1:
                self.tpot.observe((m["finished"] - m["first_token"]) / (out.num_output_tokens - 1))

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        if self.shared is not None:
            text += generate_latest(self.shared)
        return text
