"""`bucketserve tune-buckets TRACE`: bucket boundaries and batch sizes fitted to recorded traffic.

Four tables of shapes are tuned, each from a weighted list of observed sizes:
  [prefill] boundaries     prompt lengths of the generation requests;
  [decode] batch_sizes     decoding sequences at once, time-weighted, from each request's
                           first-token and end times (request logs carry them);
  [embedding] boundaries   input lengths of the embedding requests;
  [embedding] batch_sizes  batch sizes the batcher would form with those boundaries (inputs of
                           one bucket arriving within max_queue_delay_ms, up to
                           preferred_batch_size).
A size is padded up to the smallest shape >= it; the padding is wasted work. For k shapes,
`optimal_shapes` finds the ones with the least padding by dynamic programming over the sorted
distinct sizes (the optimum puts every shape on an observed size, rounded up to `align`):
  best[k][j] = min over i < j of best[k-1][i] + cost(sizes in (c_i, c_j] padded to c_j),
with prefix sums making each cost O(1) and numpy doing the min over i for all j at once.
How many shapes each table gets: each costs `graph_mib` of memory, worth `waste_per_gib`
padding per GiB; the counts minimising total padding fraction + memory cost are chosen under
`max_graphs` per table and `memory_gib` for all (an exact small knapsack over the tables).

Headroom (on unless `headroom=False`, `--no-headroom`): a table's fitted shapes end at the
largest size in the trace, and on a GPU a size above the last shape runs eagerly, many times
slower than a captured one. A trace recorded at a light load (decode batches of 1-3) would
so leave a server tuned to it with no graphs for the batches of a heavier one: such a tuned
file ran a closed loop at 0.27x the shipped default's throughput on the H200
(bench/issue15_h200.sh). So each
table also keeps a doubling ladder from twice its largest fitted shape up to its limit
(decode: max_running; embedding batches: the batcher's preferred batch size), counted in the
graph budget like the others and commented as headroom: padding above the trace stays under
50%, not an eager cliff. Prompt lengths get none (one longer than the last boundary runs at
its own length, and prefill is bound by arithmetic); the last embedding length boundary is
always the encoder's limit (longer inputs would have no bucket).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np

from bucketserve.bench.workload import WorkloadError


@dataclass(frozen=True)
class TuneLimits:
    max_graphs: int = 16
    memory_gib: float = 2.0
    graph_mib: float = 32.0
    waste_per_gib: float = 0.1
    align: int = 1
    max_model_len: int = 2048
    embedding_max_len: int = 256
    max_running: int | None = None  # None: the base file's, on `device` ("auto": per device)
    device: str = "cpu"  # resolves the base file's "auto" embedding batch settings
    headroom: bool = True  # a doubling ladder of shapes above the trace, to each limit


@dataclass
class Shapes:
    """One table's tuned shapes and what they are expected to waste."""

    shapes: list[int]
    waste: float  # padding fraction: padded / (real + padded)
    per_shape: list[dict] = field(default_factory=list)  # share, padding, size range per shape


# ------------------------------------------------------------------------------ the core DP
def _histogram(values: list[int] | np.ndarray, weights=None) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values, dtype=np.int64)
    w = np.ones(len(v)) if weights is None else np.asarray(weights, dtype=float)
    uniq, inv = np.unique(v, return_inverse=True)
    return uniq, np.bincount(inv, weights=w)


def padding_cost(values, weights, shapes: list[int]) -> float:
    """Total padding (weight x (shape - size)) of sizes padded to the smallest shape >= them;
    sizes above the last shape run unpadded."""
    s = np.asarray(sorted(shapes))
    v = np.asarray(values, dtype=float)
    w = np.ones(len(v)) if weights is None else np.asarray(weights, dtype=float)
    idx = np.searchsorted(s, v, side="left")
    covered = idx < len(s)
    return float(np.sum(w[covered] * (s[idx[covered]] - v[covered])))


def shape_curve(values, weights=None, k: int = 8, align: int = 1
                ) -> list[tuple[list[int], float]]:
    """For n = 1..k (fewer when there are fewer candidates): the at most n shapes covering
    every value (the largest shape = the largest value rounded up to `align`) with the least
    total padding, as (shapes, padding)."""
    uniq, w = _histogram(values, weights)
    if not len(uniq):
        raise ValueError("no sizes to fit")
    cands = np.unique(-(-uniq // align) * align)  # candidate shapes, ascending
    m = len(cands)
    # W[j], S[j]: weight and weight x size of the values <= cands[j]
    pos = np.searchsorted(uniq, cands, side="right")
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cs = np.concatenate([[0.0], np.cumsum(w * uniq)])
    W, S = cw[pos], cs[pos]
    c = cands.astype(float)
    best = c * W - S  # one shape: everything up to c_j padded to c_j
    levels = [best]
    parent = [np.full(m, -1)]  # -1: first shape; -2: as with one shape fewer; else previous j
    lower = np.tril(np.ones((m, m), dtype=bool), k=-1)  # i < j
    for _ in range(1, min(k, m)):
        # mat[j, i] = best[i] + c_j (W_j - W_i) - (S_j - S_i), only i < j
        mat = np.where(lower, (best + S)[None, :] - c[:, None] * W[None, :], np.inf)
        arg = np.argmin(mat, axis=1)
        new = mat[np.arange(m), arg] + c * W - S
        improved = new < best
        best = np.where(improved, new, best)
        levels.append(best)
        parent.append(np.where(improved, arg, -2))
    out = []
    for n in range(len(levels)):
        shapes, j, level = [], m - 1, n
        while True:
            p = int(parent[level][j])
            if p == -2:
                level -= 1
                continue
            shapes.append(int(cands[j]))
            if p == -1:
                break
            j, level = p, level - 1
        out.append((shapes[::-1], float(levels[n][m - 1])))
    return out


def optimal_shapes(values, weights=None, k: int = 8, align: int = 1) -> tuple[list[int], float]:
    """At most `k` shapes with the least padding (see shape_curve): (shapes, padding)."""
    return shape_curve(values, weights, k, align)[-1]


def describe(values, weights, shapes: list[int]) -> Shapes:
    """Per-shape share of traffic and padding for the comments."""
    v = np.asarray(values, dtype=float)
    w = np.ones(len(v)) if weights is None else np.asarray(weights, dtype=float)
    s = sorted(shapes)
    idx = np.searchsorted(np.asarray(s), v, side="left")
    total_w = float(w.sum()) or 1.0
    per, pad_all, real_all = [], 0.0, float(np.sum(w * v))
    for b, shape in enumerate(s):
        sel = idx == b
        ws = float(w[sel].sum())
        real = float(np.sum(w[sel] * v[sel]))
        padded = ws * shape
        pad_all += padded - real
        per.append({"shape": shape, "share": ws / total_w,
                    "padding": (padded - real) / padded if padded else 0.0,
                    "min": int(v[sel].min()) if ws else None,
                    "max": int(v[sel].max()) if ws else None})
    waste = pad_all / (real_all + pad_all) if real_all + pad_all else 0.0
    return Shapes(s, waste, per)


def headroom_ladder(top: int, limit: int) -> list[int]:
    """Shapes above `top` up to `limit`: doubling from 2 x top, the last one `limit` itself
    (none when top >= limit)."""
    out: list[int] = []
    size = 2 * max(1, top)
    while size < limit:
        out.append(size)
        size *= 2
    if top < limit:
        out.append(limit)
    return out


# ------------------------------------------------------------------------------ the traffic
@dataclass
class Traffic:
    prompt_lens: list[int] = field(default_factory=list)
    decode_sizes: list[int] = field(default_factory=list)
    decode_weights: list[float] = field(default_factory=list)
    embed_lens: list[int] = field(default_factory=list)
    embed_events: list[tuple[float, list[int]]] = field(default_factory=list)  # (arrival, lens)


def read_traffic(path: str, max_running: int = 256) -> Traffic:
    """Lengths and (when the lines carry timings) decode concurrency from a trace / log."""
    t = Traffic()
    intervals: list[tuple[float, float]] = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{no}: not JSON ({exc})") from None
            arrival = next((float(d[k]) for k in ("arrival", "arrival_s", "offset_s",
                                                  "timestamp", "t") if d.get(k) is not None), 0.0)
            lens = d.get("input_tokens") or d.get("input_lengths")
            if str(d.get("endpoint", "")).endswith("embeddings") or lens:
                if isinstance(lens, int):
                    lens = [lens]
                if lens:
                    t.embed_lens.extend(int(x) for x in lens)
                    t.embed_events.append((arrival, [int(x) for x in lens]))
                continue
            plen = next((d[k] for k in ("prompt_tokens", "prompt_len", "input_len")
                         if d.get(k) is not None), None)
            if plen is None:
                raise WorkloadError(f"{path}:{no}: no prompt length (prompt_tokens)")
            t.prompt_lens.append(int(plen))
            if d.get("ttft_s") is not None and d.get("e2e_s") is not None:
                intervals.append((arrival + d["ttft_s"], arrival + d["e2e_s"]))
    if intervals:
        t.decode_sizes, t.decode_weights = decode_concurrency(intervals, max_running)
    return t


def decode_concurrency(intervals: list[tuple[float, float]], cap: int
                       ) -> tuple[list[int], list[float]]:
    """Time-weighted distribution of how many intervals overlap (>= 1), capped at `cap`."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    acc: dict[int, float] = {}
    n, last = 0, None
    for time_, delta in events:
        if last is not None and n > 0 and time_ > last:
            key = min(n, cap)
            acc[key] = acc.get(key, 0.0) + time_ - last
        n += delta
        last = time_
    sizes = sorted(acc)
    return sizes, [acc[s] for s in sizes]


def embedding_batches(events: list[tuple[float, list[int]]], boundaries: list[int],
                      delay_s: float, preferred: int, max_tokens: int) -> list[int]:
    """Batch sizes a length-bucketed batcher forms: per bucket, inputs arriving within
    `delay_s` of the batch's first input, up to `preferred` inputs and `max_tokens` padded
    tokens (a rough replay of the batcher, without merging)."""
    spec = np.asarray(boundaries)
    open_: dict[int, tuple[float, int]] = {}  # bucket -> (first arrival, size)
    sizes: list[int] = []
    for arrival, lens in sorted(events, key=lambda e: e[0]):
        for n in lens:
            i = int(np.searchsorted(spec, n, side="left"))
            bucket = int(spec[min(i, len(spec) - 1)])
            cap = max(1, min(preferred, max_tokens // bucket))
            first, size = open_.get(bucket, (arrival, 0))
            if size and (arrival - first > delay_s or size >= cap):
                sizes.append(size)
                first, size = arrival, 0
            open_[bucket] = (first if size else arrival, size + 1)
    sizes.extend(size for _, size in open_.values() if size)
    return sizes


# ------------------------------------------------------------------------------ choosing k
def _curve(values, weights, align: int, cap: int) -> list[tuple[list[int], float]]:
    """(shapes, padding fraction) for k = 1..cap shapes."""
    uniq, w = _histogram(values, weights)
    real = float(np.sum(uniq * w))
    return [(shapes, pad / (real + pad) if real + pad else 0.0)
            for shapes, pad in shape_curve(uniq, w, cap, align)]


def allocate(curves: list[list[tuple[list[int], float]]], extra: list[int], total: int,
             per_shape_cost: float) -> list[int]:
    """Index into each curve (k - 1) minimising sum(padding) + cost x shapes with at most
    `total` shapes in all (`extra[t]` forced shapes of table t count too)."""
    # dp over tables: budget used -> (objective, picks)
    states: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for t, curve in enumerate(curves):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for used, (obj, picks) in states.items():
            for idx, (shapes, waste) in enumerate(curve):
                n = len(shapes) + extra[t]
                if used + n > total:
                    break
                value = obj + waste + per_shape_cost * n
                cur = nxt.get(used + n)
                if cur is None or value < cur[0]:
                    nxt[used + n] = (value, picks + [idx])
        if not nxt:
            raise WorkloadError(f"the memory budget allows {total} shapes, fewer than the "
                                f"{len(curves)} tables need; raise --memory-gib")
        states = nxt
    return min(states.values(), key=lambda s: s[0])[1]


@dataclass
class Tuned:
    prefill: Shapes | None
    decode: Shapes | None
    embedding: Shapes | None
    embedding_batch: Shapes | None


def tune(traffic: Traffic, limits: TuneLimits, delay_s: float = 0.005, preferred: int = 32,
         max_batch_tokens: int = 8192) -> Tuned:
    cap = limits.max_graphs
    per_shape_cost = limits.waste_per_gib * limits.graph_mib / 1024.0
    total = max(1, int(limits.memory_gib * 1024.0 // limits.graph_mib))
    # name, values, weights, align, forced shapes above the trace (its limit; headroom)
    tables: list[tuple[str, list, list | None, int, list[int]]] = []
    if traffic.prompt_lens:
        plens = [min(n, limits.max_model_len) for n in traffic.prompt_lens]
        # no headroom: a prompt longer than the last boundary is computed at its own length
        # (BucketSpec.padded_len), and a prefill is bound by arithmetic, not launches
        tables.append(("prefill", plens, None, limits.align, []))
    if traffic.decode_sizes:
        tables.append(("decode", traffic.decode_sizes, traffic.decode_weights, 1,
                       headroom_ladder(max(traffic.decode_sizes), _running(limits))
                       if limits.headroom else []))
    if traffic.embed_lens:
        elens = [min(n, limits.embedding_max_len) for n in traffic.embed_lens]
        top = int(-(-max(elens) // limits.align) * limits.align)
        # the last length boundary is always the limit (longer inputs have no bucket)
        tables.append(("embedding", elens, None, limits.align,
                       [limits.embedding_max_len] if top < limits.embedding_max_len else []))
    curves = [_curve(v, w, a, max(1, cap - len(f))) for _, v, w, a, f in tables]
    picks = allocate(curves, [len(f) for *_, f in tables], total, per_shape_cost)
    got: dict[str, Shapes] = {}
    for (name, values, weights, _, forced), curve, idx in zip(tables, curves, picks, strict=True):
        got[name] = describe(values, weights, list(curve[idx][0]) + forced)
    emb_batch = None
    if "embedding" in got:
        sizes = embedding_batches(traffic.embed_events, got["embedding"].shapes, delay_s,
                                  preferred, max_batch_tokens)
        forced = headroom_ladder(max(sizes), preferred) if limits.headroom else []
        shapes, _ = optimal_shapes(sizes, None, max(1, cap - len(forced)), 1)
        emb_batch = describe(sizes, None, shapes + forced)
    return Tuned(got.get("prefill"), got.get("decode"), got.get("embedding"), emb_batch)


# ------------------------------------------------------------------------------ the TOML
def _fmt(value) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _comments(shapes: Shapes, unit: str, what: str) -> list[str]:
    lines = [f"# expected padding {100 * shapes.waste:.2f}% of computed {unit} over the trace; "
             f"per {what}: share of traffic, padding, observed range"]
    for p in shapes.per_shape:
        if p["min"] is None:
            lines.append(f"#   {p['shape']:>6}: no traffic in the trace (kept: headroom or the "
                         "upper limit)")
        else:
            lines.append(f"#   {p['shape']:>6}: {100 * p['share']:5.1f}% of traffic, padding "
                         f"{100 * p['padding']:5.2f}%, sizes {p['min']}..{p['max']}")
    return lines


def embedding_batch_sizes_supported() -> bool:
    from bucketserve.buckets import config

    return "batch_sizes" in config._SCHEMA["embedding"]


def render_toml(tuned: Tuned, base_config, source: str, limits: TuneLimits) -> str:
    """The tuned values over `base_config`'s other keys, as a commented TOML file."""
    values = base_config.to_dict()
    notes: dict[tuple[str, str], list[str]] = {}
    if tuned.prefill:
        values["prefill"]["boundaries"] = tuned.prefill.shapes
        notes[("prefill", "boundaries")] = _comments(tuned.prefill, "prompt tokens", "boundary")
    if tuned.decode:
        values["decode"]["batch_sizes"] = tuned.decode.shapes
        notes[("decode", "batch_sizes")] = _comments(tuned.decode, "decode rows (time-weighted)",
                                                     "batch size")
    elif tuned.prefill:
        notes[("decode", "batch_sizes")] = [
            "# not tuned: the trace has no decode timings (ttft_s and e2e_s per request, as a "
            "--request-log writes them)"]
    if tuned.embedding:
        values["embedding"]["boundaries"] = tuned.embedding.shapes
        notes[("embedding", "boundaries")] = _comments(tuned.embedding, "input tokens", "boundary")
    lines = [f"# bucketserve buckets tuned by `bucketserve tune-buckets {source}`",
             f"# limits: at most {limits.max_graphs} shapes per table, {limits.memory_gib} GiB for "
             f"all shapes at ~{limits.graph_mib} MiB each, a GiB worth {limits.waste_per_gib:.0%} "
             f"padding; lengths aligned to {limits.align}",
             "# Check it: python -m bucketserve.buckets check FILE", ""]
    for table, keys in values.items():
        lines.append(f"[{table}]")
        for key, value in keys.items():
            lines.extend(notes.get((table, key), []))
            lines.append(f"{key} = {_fmt(value)}")
        if table == "embedding" and tuned.embedding_batch:
            lines.extend(_comments(tuned.embedding_batch, "batch rows", "batch size"))
            text = f"batch_sizes = {_fmt(tuned.embedding_batch.shapes)}"
            if embedding_batch_sizes_supported():
                if "batch_sizes" not in keys:
                    lines.append(text)
            else:
                lines.append("# (this build has no [embedding] batch_sizes key yet; uncomment "
                             "once it does)")
                lines.append("# " + text)
        lines.append("")
    return "\n".join(lines)


def _running(limits: TuneLimits) -> int:
    from bucketserve.buckets.config import AUTO_MAX_RUNNING

    if limits.max_running is not None:
        return limits.max_running
    return AUTO_MAX_RUNNING.get(limits.device, AUTO_MAX_RUNNING["cpu"])


def tune_file(path: str, limits: TuneLimits, base: str | None = None) -> str:
    from bucketserve.buckets import load_buckets

    base_config = load_buckets(base)
    if limits.max_running is None:
        limits = replace(limits, max_running=base_config.running_limit(limits.device))
    traffic = read_traffic(path, limits.max_running)
    if not traffic.prompt_lens and not traffic.embed_lens:
        raise WorkloadError(f"{path}: no requests")
    emb = base_config.embedding
    tuned = tune(traffic, limits, emb.max_queue_delay_ms / 1000.0, emb.batch_size(limits.device),
                 emb.batch_tokens(limits.device))
    if tuned.embedding_batch and embedding_batch_sizes_supported():
        base_config = _with_embedding_batch_sizes(base_config, tuned.embedding_batch.shapes)
    return render_toml(tuned, base_config, path, limits)


def _with_embedding_batch_sizes(config, sizes: list[int]):
    from dataclasses import replace

    return replace(config, embedding=replace(config.embedding, batch_sizes=tuple(sizes)))

