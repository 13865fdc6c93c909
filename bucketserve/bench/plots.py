"""`bucketserve bench --plot DIR`: PNG figures of a run (matplotlib, Agg backend).

From the client's own measurements (any server):
  latency_cdf.png          CDFs of TTFT, ITL and E2E (ms, log scale);
  throughput.png           output tokens/s and requests in flight over time (1 s bins);
  padding_per_bucket.png   nominal padding per bucket: the run's prompt / input lengths padded
                           to the buckets of --buckets FILE (the shipped file by default).
From /metrics scraped during the run (bucketserve only; skipped for other servers):
  queue_depth.png          waiting and running sequences over time;
  batch_sizes.png          sequences per engine step per step kind, and embedding batch sizes;
  kv_blocks.png            KV-cache blocks in use over time.
"""

from __future__ import annotations

import os
import re

import numpy as np

from bucketserve.bench.scrape import engine_info, labelled

_LE = re.compile(r'le="([^"]+)"')


def _metric(sample: dict[str, float], name: str) -> float | None:
    for key in (name, name + "_total"):
        if key in sample:
            return sample[key]
    return None


def _hist(sample: dict[str, float], name: str, label: str | None = None) -> dict[float, float]:
    """Cumulative histogram buckets {le: count} of `name` (optionally one label set)."""
    out: dict[float, float] = {}
    for labels, value in labelled(sample, name + "_bucket").items():
        if label is not None and label not in labels:
            continue
        m = _LE.search(labels)
        if m:
            out[float(m.group(1))] = value
    return out


def _kinds(sample: dict[str, float]) -> list[str]:
    return sorted({m.group(1) for k in labelled(sample, "bucketserve_step_batch_size_bucket")
                   if (m := re.search(r'kind="([^"]+)"', k))})


def server_summary(samples: list[tuple[float, dict[str, float]]]) -> dict:
    """What the server counted during the run: deltas between the first and last scrape."""
    if not samples:
        return {"scraped": False}
    first, last = samples[0][1], samples[-1][1]

    def delta(name: str) -> float:
        a, b = _metric(first, name), _metric(last, name)
        return (b or 0.0) - (a or 0.0)

    out: dict = {"scraped": True, "scrapes": len(samples)}
    computed, useful = delta("bucketserve_computed_tokens"), delta("bucketserve_useful_tokens")
    out["engine_steps"] = delta("bucketserve_engine_steps")
    out["computed_tokens"], out["useful_tokens"] = computed, useful
    out["padding_waste"] = 1.0 - useful / computed if computed else None
    ec, eu = (delta("bucketserve_embedding_computed_tokens"),
              delta("bucketserve_embedding_useful_tokens"))
    if ec:
        out["embedding_computed_tokens"], out["embedding_useful_tokens"] = ec, eu
        out["embedding_padding_waste"] = 1.0 - eu / ec
        out["embedding_batches"] = sum(labelled(last, "bucketserve_embedding_batches_total")
                                       .values()) - sum(
            labelled(first, "bucketserve_embedding_batches_total").values())
    out["preemptions"] = delta("bucketserve_preemptions")
    used = [s.get("bucketserve_kv_blocks_used") for _, s in samples]
    used = [u for u in used if u is not None]
    out["kv_blocks_used_max"] = max(used) if used else None
    out["kv_blocks_total"] = last.get("bucketserve_kv_blocks_total")
    waiting = [s.get("bucketserve_requests_waiting") for _, s in samples]
    out["waiting_max"] = max((w for w in waiting if w is not None), default=None)
    steps = {}
    for labels, value in labelled(last, "bucketserve_bucket_steps_total").items():
        steps[labels] = value - labelled(first, "bucketserve_bucket_steps_total").get(labels, 0.0)
    out["bucket_steps"] = {k: v for k, v in steps.items() if v}
    events = sum(labelled(last, "bucketserve_sse_token_events_total").values()) - sum(
        labelled(first, "bucketserve_sse_token_events_total").values())
    tokens = sum(labelled(last, "bucketserve_sse_tokens_total").values()) - sum(
        labelled(first, "bucketserve_sse_tokens_total").values())
    out["sse_token_events"], out["sse_tokens"] = events, tokens
    out["sse_tokens_per_event"] = tokens / events if events else None
    out["engine_step_ms_p50"] = _quantile_ms(first, last, "bucketserve_engine_step_seconds", 0.5)
    out["engine"] = engine_info(last)
    return out


def _quantile_ms(first: dict, last: dict, name: str, q: float) -> float | None:
    """The q-quantile (ms) of a histogram's observations between two scrapes, interpolated
    linearly within its bucket (as Prometheus' histogram_quantile)."""
    a, b = _hist(first, name), _hist(last, name)
    les = sorted(le for le in b if le != float("inf"))
    cum = [b[le] - a.get(le, 0.0) for le in les]
    total = b.get(float("inf"), 0.0) - a.get(float("inf"), 0.0)
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le, c in zip(les, cum, strict=True):
        if c >= rank:
            return 1e3 * (lo + (le - lo) * (rank - below) / max(c - below, 1e-12))
        lo, below = le, c
    return 1e3 * lo  # in the open top bucket: its lower bound


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.plot(xs, ys, label=label)
    lo = xs[xs > 0].min() if np.any(xs > 0) else None
    if lo is not None and xs[-1] / lo > 20:
        ax.set_xscale("log")
    for p, style in ((50, ":"), (99, "--")):
        ax.axhline(p / 100, color="grey", linestyle=style, linewidth=0.8)


def latency_cdf(results: list[dict], path: str, title: str) -> None:
    plt = _plt()
    gen = [r for r in results if r.get("e2e") is not None and r["kind"] != "embedding"]
    emb = [r for r in results if r.get("e2e") is not None and r["kind"] == "embedding"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, name, values in (
        (axes[0], "TTFT", [1000 * r["ttft"] for r in gen]),
        (axes[1], "ITL", [1000 * x for r in gen for x in r["itl"]]),
        (axes[2], "E2E", [1000 * r["e2e"] for r in gen]),
    ):
        _cdf(ax, values, f"generation ({len(values)})")
        if name == "E2E" and emb:
            _cdf(ax, [1000 * r["e2e"] for r in emb], f"embeddings ({len(emb)})")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests") + " <= x")
        ax.set_title(name)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Latency CDFs: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput(results: list[dict], path: str, title: str) -> None:
    plt = _plt()
    token_times, spans = [], []
    for r in results:
        if r.get("start") is None:
            continue
        end = r["start"] + (r["e2e"] if r.get("e2e") is not None else 0.0)
        spans.append((r["start"], end))
        if r.get("ttft") is not None and r["kind"] != "embedding":
            t = r["start"] + r["ttft"]
            token_times.append(t)
            token_times.extend((t + np.cumsum(r["itl"])).tolist())
    horizon = max((e for _, e in spans), default=1.0)
    nb = max(1, int(np.ceil(horizon)))
    fig, ax = plt.subplots(figsize=(10, 4))
    counts, edges = np.histogram(token_times, bins=nb, range=(0, nb))
    ax.step(edges[:-1], counts, where="post", label="output tokens/s (token events)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    grid = np.linspace(0, horizon, 400)
    starts = np.sort([s for s, _ in spans])
    ends = np.sort([e for _, e in spans])
    inflight = np.searchsorted(starts, grid, side="right") - np.searchsorted(ends, grid,
                                                                             side="right")
    ax2.plot(grid, inflight, color="tab:orange", label="requests in flight (client)")
    ax2.set_ylabel("requests in flight")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    ax.set_title(f"Throughput over time: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def padding_per_bucket(reqs, buckets_file: str | None, path: str, title: str,
                       server: dict | None = None) -> None:
    from bucketserve.bench.tuner import describe
    from bucketserve.buckets import load_buckets

    plt = _plt()
    cfg = load_buckets(buckets_file)
    tables = []
    plens = [r.prompt_tokens for r in reqs if r.kind != "embedding"]
    elens = [n for r in reqs if r.kind == "embedding" for n in r.input_lengths]
    if plens:
        tables.append(("prefill (prompt tokens)", plens, list(cfg.prefill_boundaries)))
    if elens:
        tables.append(("embedding (input tokens)", elens, list(cfg.embedding.boundaries)))
    fig, axes = plt.subplots(1, max(1, len(tables)), figsize=(7 * max(1, len(tables)), 4),
                             squeeze=False)
    for ax, (name, values, bounds) in zip(axes[0], tables, strict=False):
        d = describe(values, None, bounds)
        used = [p for p in d.per_shape if p["min"] is not None]
        xs = np.arange(len(used))
        ax.bar(xs, [100 * p["padding"] for p in used], color="tab:red", alpha=0.8,
               label="padding (% of the bucket's computed tokens)")
        ax.set_xticks(xs, [str(p["shape"]) for p in used], rotation=45 if len(used) > 12 else 0)
        ax.set_xlabel("bucket (tokens)")
        ax.set_ylabel("padding (%)")
        ax2 = ax.twinx()
        ax2.plot(xs, [100 * p["share"] for p in used], "o-", color="tab:blue",
                 label="share of inputs (%)")
        ax2.set_ylabel("share of inputs (%)")
        measured = ""
        if server and name.startswith("prefill") and server.get("padding_waste") is not None:
            measured = f"; server-measured step padding {100 * server['padding_waste']:.1f}%"
        if server and name.startswith("embedding") and server.get("embedding_padding_waste") \
                is not None:
            measured = f"; server-measured {100 * server['embedding_padding_waste']:.1f}%"
        ax.set_title(f"{name}: nominal padding {100 * d.waste:.1f}%{measured}", fontsize=9)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Padding per bucket ({os.path.basename(buckets_file or 'default.toml')}): "
                 f"{title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def queue_depth(samples, t0: float, path: str, title: str) -> None:
    plt = _plt()
    ts = [t - t0 for t, _ in samples]
    fig, ax = plt.subplots(figsize=(10, 4))
    for name, label in (("bucketserve_requests_waiting", "waiting sequences"),
                        ("bucketserve_requests_running", "running sequences"),
                        ("bucketserve_embedding_requests_waiting", "embedding requests queued")):
        ys = [s.get(name) for _, s in samples]
        if any(y is not None for y in ys):
            ax.plot(ts, [y or 0 for y in ys], label=label)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests / sequences")
    ax.set_title(f"Queue depth (scraped /metrics): {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hist_delta(first: dict, last: dict, name: str, label: str | None = None
                ) -> tuple[list[str], list[float]]:
    a, b = _hist(first, name, label), _hist(last, name, label)
    les = sorted(b)
    cum = [b[le] - a.get(le, 0.0) for le in les]
    counts = [cum[0]] + [cum[i] - cum[i - 1] for i in range(1, len(cum))] if cum else []
    labels, prev = [], 0
    for le in les:
        labels.append(f">{int(prev)}" if le == float("inf") else
                      (f"{int(le)}" if prev + 1 >= le else f"{int(prev) + 1}-{int(le)}"))
        prev = le if le != float("inf") else prev
    keep = [i for i, c in enumerate(counts) if c > 0]
    if keep:
        lo, hi = keep[0], keep[-1] + 1
        return labels[lo:hi], counts[lo:hi]
    return [], []


def batch_sizes(samples, path: str, title: str) -> None:
    plt = _plt()
    first, last = samples[0][1], samples[-1][1]
    panels = [(f"{k} steps", "bucketserve_step_batch_size", f'kind="{k}"') for k in _kinds(last)]
    if _hist(last, "bucketserve_embedding_batch_size"):
        panels.append(("embedding batches", "bucketserve_embedding_batch_size", None))
    data = [(name, *_hist_delta(first, last, metric, label)) for name, metric, label in panels]
    data = [d for d in data if d[1]]  # kinds that ran during this run
    if not data:
        return
    fig, axes = plt.subplots(1, len(data), figsize=(4.5 * len(data), 4), squeeze=False)
    for ax, (name, labels, counts) in zip(axes[0], data, strict=True):
        ax.bar(range(len(counts)), counts)
        ax.set_xticks(range(len(counts)), labels, rotation=45)
        ax.set_xlabel("batch size (sequences or inputs)")
        ax.set_ylabel("steps" if "steps" in name else "batches")
        ax.set_title(name)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Batch-size distribution per step kind: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kv_blocks(samples, t0: float, path: str, title: str) -> None:
    plt = _plt()
    ts = [t - t0 for t, _ in samples]
    used = [s.get("bucketserve_kv_blocks_used", 0.0) for _, s in samples]
    total = samples[-1][1].get("bucketserve_kv_blocks_total")
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(ts, used, label="blocks in use")
    if total:
        ax.axhline(total, color="grey", linestyle="--", label=f"pool ({int(total)} blocks)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("KV-cache blocks")
    ax.set_title(f"KV-cache blocks in use (scraped /metrics): {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out_dir: str, results: list[dict], t0: float, samples, reqs,
                buckets_file: str | None = None, title: str = "") -> list[str]:
    """Every figure this run has data for; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    def path(name: str) -> str:
        p = os.path.join(out_dir, name)
        paths.append(p)
        return p

    latency_cdf(results, path("latency_cdf.png"), title)
    throughput(results, path("throughput.png"), title)
    server = server_summary(samples) if samples else None
    padding_per_bucket(reqs, buckets_file, path("padding_per_bucket.png"), title, server)
    if len(samples) >= 2:
        queue_depth(samples, t0, path("queue_depth.png"), title)
        kv_blocks(samples, t0, path("kv_blocks.png"), title)
        p = os.path.join(out_dir, "batch_sizes.png")
        batch_sizes(samples, p, title)
        if os.path.exists(p):
            paths.append(p)
    return paths
