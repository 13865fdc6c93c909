"""CUDA graphs of the model's forward for pure-decode steps, one per batch size.

A decode step launches ~15 kernels a layer that each run for a few microseconds, so at
small batches the CPU launch cost dominates (measured on an H200: 135M shape, batch 1,
13.9 ms eager vs 1.5 ms as one graph). DecodeGraphs captures `model(input_ids, positions)`
once per batch size from the TOML's decode list, largest first, into one shared memory
pool. A step of n decodes is padded up to the smallest captured size >= n:

    rows 0..n-1   the real decodes (inputs copied into the static buffers)
    rows n..bs-1  dummies: token 0 at position 0, seq_len 1, block table row of zeros and
                  slot 0, so they write into and read from the reserved dummy block 0 only

`run()` is what the runner calls for such a step: it copies the step's device inputs into
the static buffers (device-to-device, no host sync), turns rows left over from a larger
step back into dummies and replays. Steps with prefills, or more decodes than the largest
size, do not use these graphs (`padded_size` returns None): the runner gives them to
PiecewiseGraphs below, or runs them eagerly. The dummy rows are padding: the engine counts
them as computed, not useful, tokens. Works with any AttentionBackend whose forward does no
host sync (TritonAttentionBackend).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from bucketserve.kernels.attention import (
    AttentionMetadata,
    FixedGrid,
    forward_context,
    max_prefill_tiles,
)

log = logging.getLogger(__name__)


def pool_bytes(pool) -> int:
    """Memory a graph pool holds (segments of that pool in the allocator's snapshot; a
    reserved-memory delta is blurred by other frees and allocations). 0 for None."""
    if pool is None:
        return 0
    pool = tuple(pool)
    return sum(int(seg.get("total_size", 0)) for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool)


def next_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` >= n, or None."""
    for size in sizes:
        if size >= n:
            return size
    return None


# the share by which an eager run must beat the padded replay to be chosen (PaddingCostModel)
GRAPH_TIE_MARGIN = 0.10


@dataclass
class PaddingCostModel:
    """Per step, the cheaper of two ways to run n tokens, from times measured at start-up:

      * replay the piecewise graphs at T = the smallest captured size >= n (rows n..T-1 are
        padding): costs graph_ms[T];
      * run the same stages eagerly on exactly n rows: costs eager_ms interpolated at n
        (linear between the measured sizes; below the smallest size, its time; above the
        largest, extrapolated along the last segment).

    Small steps are launch-bound, so the graphs win whatever their padding; large steps are
    bound by arithmetic, so replaying 2,048 rows for 1,100 tokens costs nearly twice the eager
    run, which then wins (measured on an H200 at the 8B shape: see README). Attention runs
    eagerly on the n real rows either way and is left out of both times.

    The eager run must be cheaper by GRAPH_TIE_MARGIN: both times are wall times to
    completion, but an eager forward also holds the engine's host thread for its launches
    while a replay returns at once, and in a busy server that thread is the step's critical
    path. Near a tie, measurement noise alone used to decide, so servers of the same code and
    model split differently (1B shape on an H100: steps of 1,025-2,048 tokens ran eagerly in
    some starts and as graphs in others, the eager ones about 6 ms of host launches each)."""

    sizes: tuple[int, ...]  # captured token counts, increasing
    graph_ms: tuple[float, ...]  # one forward's stages replayed as graphs, per size
    eager_ms: tuple[float, ...]  # the same stages run eagerly at that size

    def __post_init__(self) -> None:
        if not self.sizes or not (len(self.sizes) == len(self.graph_ms) == len(self.eager_ms)):
            raise ValueError("cost model needs one graph and one eager time per size")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError(f"sizes must be strictly increasing, got {self.sizes}")

    def eager_estimate(self, n: int) -> float:
        """Estimated eager time (ms) of the stages at n rows."""
        sz, e = self.sizes, self.eager_ms
        if n <= sz[0] or len(sz) == 1:
            return e[0] if n <= sz[0] else e[0] * n / sz[0]
        i = min(bisect.bisect_left(sz, n), len(sz) - 1)
        lo, hi = sz[i - 1], sz[i]
        return e[i - 1] + (e[i] - e[i - 1]) * (n - lo) / (hi - lo)

    def choose(self, n: int) -> int | None:
        """The captured size to replay for a step of n tokens, or None to run it eagerly."""
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        eager = self.eager_estimate(n) * (1.0 + GRAPH_TIE_MARGIN)
        return self.sizes[i] if self.graph_ms[i] <= eager else None

    def eager_from(self) -> int | None:
        """The smallest token count that runs eagerly (None: every captured count replays)."""
        for n in range(1, self.sizes[-1] + 1):
            if self.choose(n) is None:
                return n
        return None

    def describe(self) -> dict:
        return {"sizes": list(self.sizes), "graph_ms": [round(x, 3) for x in self.graph_ms],
                "eager_ms": [round(x, 3) for x in self.eager_ms],
                "eager_from": self.eager_from()}


@dataclass
class CaptureStats:
    num_graphs: int
    seconds: float
    pool_bytes: int  # memory held by the graphs' private pool after capture


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, batch_sizes: list[int], max_blocks_per_seq: int,
                 max_seq_len: int, device: torch.device | str) -> None:
        """max_seq_len: the longest context a decode can have (the model's max length); the
        captured attention metadata carries it, so kernels size their work for it."""
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"decode batch sizes must be positive, got {batch_sizes}")
        self.model = model
        self.sizes = sorted(set(batch_sizes))
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        bmax = self.sizes[-1]
        kw = {"device": self.device}
        # static inputs, [bmax] (block tables [bmax, max_blocks_per_seq]); views [:bs] per graph
        self.input_ids = torch.zeros(bmax, dtype=torch.long, **kw)
        self.positions = torch.zeros(bmax, dtype=torch.long, **kw)
        self.slot_mapping = torch.zeros(bmax, dtype=torch.long, **kw)
        self.seq_lens = torch.ones(bmax, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros(bmax, max_blocks_per_seq, dtype=torch.int32, **kw)
        self.query_start_loc = torch.arange(bmax + 1, dtype=torch.int32, **kw)
        self._dirty = 0  # rows [0, _dirty) may hold a real sequence's inputs from a past step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # static hidden [bs, H] per graph
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=self.max_seq_len, query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_seq_len] * bs)

    def _forward(self, bs: int) -> torch.Tensor:
        with forward_context(self._meta(bs)):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Captures every size, largest first (smaller graphs reuse the pool's memory)."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            # warm-up outside the graph: compiles the Triton kernels, sets up cuBLAS
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        stats = CaptureStats(len(self.graphs), time.perf_counter() - t0, self.pool_bytes())
        log.info("captured %d decode graphs (batch %d..%d) in %.2f s, %.1f MiB",
                 stats.num_graphs, self.sizes[0], self.sizes[-1], stats.seconds,
                 stats.pool_bytes / 2**20)
        return stats

    def pool_bytes(self) -> int:
        return pool_bytes(self.pool)

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured size a step of `num_decodes` decodes runs at, or None (eager)."""
        return next_size(self.sizes, num_decodes)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Replays the graph for a pure-decode step -> hidden [n, H]. The result is a view
        of the graph's static output: use it before the next run()."""
        n = meta.num_seqs
        self._stage(n, meta.num_decodes, meta.block_tables.shape[1])
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # columns >= width of real rows are stale but never read: a row reads only the
        # ceil(seq_len / block_size) <= width pages its sequence owns
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        return self.replay(n)

    @torch.inference_mode()
    def load(self, n: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """A decode step of n sequences from the host: each of its (pinned) buffers is copied
        straight into the static inputs with one non-blocking copy, rows [:n] (block tables:
        whole rows), where `run` would copy device tensors made first. Returns the static
        input ids [:n] (placeholders may be gathered into them); then `replay(n)`."""
        self._stage(n, n, block_tables.shape[1])
        self.input_ids[:n].copy_(ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(slots[:n], non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens[:n], non_blocking=True)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables[:n], non_blocking=True)
        return self.input_ids[:n]

    def replay(self, n: int) -> torch.Tensor:
        """Replays the graph of a step of n decodes whose inputs are in place -> hidden [n, H]
        (a view of the graph's static output: use it before the next replay)."""
        bs = self.padded_size(n)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def _stage(self, n: int, num_decodes: int, width: int) -> None:
        """Checks a step of n sequences against the captured graphs and turns the rows left
        over from a larger step back into dummies."""
        bs = self.padded_size(n)
        if num_decodes != n or bs is None or not self.graphs:
            raise ValueError(f"no captured graph for {n} sequences ({num_decodes} decodes); "
                             "run this step eagerly")
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables are {width} wide; graphs were captured for "
                             f"{self.block_tables.shape[1]}")
        end = min(bs, self._dirty)
        if end > n:
            self.input_ids[n:end].zero_()
            self.positions[n:end].zero_()
            self.slot_mapping[n:end].zero_()
            self.seq_lens[n:end].fill_(1)
            self.block_tables[n:end].zero_()
        self._dirty = self._dirty if self._dirty > bs else n


def best_ms(fn, device: torch.device, passes: int) -> float:
    """Wall time of fn() to completion (device synced before and after), in ms: the best of
    the passes after the first (a warm-up), or the one pass."""
    cuda = device.type == "cuda"
    best = float("inf")
    for i in range(passes):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        if i or passes == 1:
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


class TokenCountGraphs:
    """What the runner asks of the graphs of prefill and mixed steps (PiecewiseGraphs,
    MixedGraphs): captured token counts `sizes`, and the cost model, once measured."""

    sizes: list[int]
    cost: PaddingCostModel | None = None

    def padded_size(self, num_tokens: int) -> int | None:
        """The token count a step of `num_tokens` runs at, or None (larger: eager)."""
        return next_size(self.sizes, num_tokens)

    def choose(self, num_tokens: int) -> int | None:
        """The captured size a step of `num_tokens` replays, or None to run it eagerly: the
        cost model's choice once measured (measure_costs), else the next captured size."""
        if self.cost is not None:
            return self.cost.choose(num_tokens)
        return self.padded_size(num_tokens)

    def _keep_costs(self, graph_ms: list[float], eager_ms: list[float],
                    what: str) -> PaddingCostModel:
        self.cost = PaddingCostModel(tuple(self.sizes), tuple(graph_ms), tuple(eager_ms))
        log.info("%s cost model (ms per forward, graphs / eager): %s; the first token count "
                 "run eagerly: %s", what, ", ".join(
                     f"{t}: {g:.2f}/{e:.2f}" for t, g, e in zip(self.sizes, graph_ms, eager_ms,
                                                                strict=True)),
                 self.cost.eager_from())
        return self.cost


class PiecewiseGraphs(TokenCountGraphs):
    """Prefill and mixed steps as CUDA graphs of everything but attention.

    An eager prefill or mixed step launches ~10 kernels a layer from Python: measured on an
    H200, a 135M-shape forward costs 12-15 ms of launches at any token count, several times
    its GPU work. Attention is the only part of the forward that mixes rows of different
    sequences and whose launch grid depends on the batch (sequence count, query lengths), so
    the model's fused forward is split at each layer's attention (LlamaForCausalLM.stage_*),
    and for each token count T of `sizes` the L + 1 stages are captured as graphs over static
    buffers of T rows:

        first[T]        ids, positions          -> res, q, k, v   (embedding, layer 0 to attention)
        between[T][i]   o, res, positions       -> res, q, k, v   (layer i after attention, layer i+1 to it)
        last[T]         o, res                  -> h              (last layer after attention, final norm)

    The sizes come from the TOML (`prefill.piecewise_sizes`, see
    BucketsConfig.piecewise_token_counts). A step of n tokens runs at the smallest T >= n:
    rows n..T-1 are padding. They hold stale
    but valid ids and positions, every op in a stage is row-wise, and attention runs eagerly
    on the n real rows only (its K/V write and grid come from the step's metadata), so padding
    rows never reach the KV pool or a real row. Capture is largest T first, into one pool;
    data passes between graphs only through the static buffers, which live outside the pool.

    With capture=False (CPU tests) the stages run eagerly over the same buffers.
    """

    attention_in_graph = False  # the runner runs attention between the pieces (run)

    def __init__(self, model: torch.nn.Module, sizes: list[int], device: torch.device | str,
                 capture: bool = True) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"piecewise graph sizes must be positive, got {sizes}")
        self.model = model
        self.sizes = sorted(set(sizes))
        self.device = torch.device(device)
        self.use_graphs = capture
        cfg = model.config
        tmax = self.sizes[-1]
        dtype = next(model.parameters()).dtype
        kw = {"device": self.device}
        self.num_layers = cfg.num_layers
        # static buffers [tmax, ...]; size T uses the first T rows
        self.input_ids = torch.zeros(tmax, dtype=torch.long, **kw)
        self.positions = torch.zeros(tmax, dtype=torch.long, **kw)
        self.res = torch.zeros(tmax, cfg.hidden_size, dtype=dtype, **kw)
        self.q = torch.zeros(tmax, cfg.num_heads, cfg.head_dim, dtype=dtype, **kw)
        self.k = torch.zeros(tmax, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, **kw)
        self.v = torch.zeros(tmax, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, **kw)
        self.o = torch.zeros(tmax, cfg.num_heads, cfg.head_dim, dtype=dtype, **kw)
        self.h = torch.zeros(tmax, cfg.hidden_size, dtype=dtype, **kw)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # T -> [first, between..., last]
        self.pool = None
        self.cost: PaddingCostModel | None = None  # measure_costs(); None: always pad

    # -- the stages over the static buffers (what is captured) --------------------------------

    def _keep(self, t: int, res: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        self.res[:t].copy_(res)
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)

    def _stage(self, t: int, index: int) -> None:
        """Stage `index` (0: first, 1..L-1: between layers index-1 and index, L: last)."""
        m = self.model
        if index == 0:
            self._keep(t, *m.stage_first(self.input_ids[:t], self.positions[:t]))
        elif index < self.num_layers:
            self._keep(t, *m.stage_between(index - 1, self.o[:t], self.res[:t],
                                           self.positions[:t]))
        else:
            self.h[:t].copy_(m.stage_last(self.o[:t], self.res[:t]))

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Captures the L + 1 stages of every size, largest size first, into one pool."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stages = range(self.num_layers + 1)
        for t in reversed(self.sizes):
            # warm-up outside the graphs (kernel compilation, cuBLAS workspaces)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for index in stages:
                    self._stage(t, index)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graphs = []
            for index in stages:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._stage(t, index)
                graphs.append(graph)
            self.graphs[t] = graphs
        torch.cuda.synchronize(self.device)
        stats = CaptureStats(sum(map(len, self.graphs.values())), time.perf_counter() - t0,
                             pool_bytes(self.pool))
        log.info("captured %d piecewise graphs (%d token counts %d..%d, %d pieces each) in "
                 "%.2f s, %.1f MiB", stats.num_graphs, len(self.sizes), self.sizes[0],
                 self.sizes[-1], self.num_layers + 1, stats.seconds, stats.pool_bytes / 2**20)
        return stats

    @torch.inference_mode()
    def measure_costs(self, repeats: int = 2, long_tokens: int = 2048) -> PaddingCostModel:
        """Times, at every captured size, one pass of the L + 1 stages replayed as graphs and
        the same stages run eagerly (host launches included: wall time to completion, best of
        `repeats` after a warm-up pass; sizes above `long_tokens`, whose passes are long and
        steady, once without warm-up), and keeps them as `self.cost`, which `choose` then
        consults. Stale static buffers are valid inputs (as for padding rows); nothing reaches
        the KV pool."""
        def timed(fn, t: int) -> float:
            return best_ms(fn, self.device, repeats + 1 if t <= long_tokens else 1)

        stages = range(self.num_layers + 1)
        graph_ms, eager_ms = [], []
        for t in self.sizes:
            graphs = self.graphs.get(t) if self.use_graphs else None

            def replay(t=t, graphs=graphs) -> None:
                for index in stages:
                    if graphs is not None:
                        graphs[index].replay()
                    else:
                        self._stage(t, index)

            def eager(t=t) -> None:
                for index in stages:
                    self._stage(t, index)

            graph_ms.append(timed(replay, t))
            eager_ms.append(timed(eager, t))
        return self._keep_costs(graph_ms, eager_ms, "piecewise")

    # -- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, t: int, num_tokens: int) -> torch.Tensor:
        """One forward at size t (a captured size >= num_tokens) over the static inputs, which
        the caller has filled: input_ids[:t] and positions[:t], rows >= num_tokens padding
        (any valid id and position). Call inside forward_context(meta) with the step's
        metadata for its num_tokens real tokens. Returns hidden [num_tokens, H], a view of a
        static buffer: use it before the next run()."""
        if t not in self.sizes or num_tokens > t:
            raise ValueError(f"no piecewise size {t} for {num_tokens} tokens "
                             f"(sizes {self.sizes})")
        graphs = self.graphs.get(t) if self.use_graphs else None
        if self.use_graphs and graphs is None:
            raise ValueError("capture() has not run")
        n = num_tokens
        for index in range(self.num_layers + 1):
            if graphs is not None:
                graphs[index].replay()
            else:
                self._stage(t, index)
            if index < self.num_layers:
                # layer `index`'s attention over the real rows only
                o = self.model.attention(index, self.q[:n], self.k[:n], self.v[:n])
                self.o[:n].copy_(o.view(n, *self.o.shape[1:]))
        return self.h[:n]


class MixedGraphs(TokenCountGraphs):
    """Prefill and mixed steps as one CUDA graph per token count, attention included.

    PiecewiseGraphs leaves attention out of the graphs because its launch grids depend on
    the batch; running it eagerly between the pieces costs a few kernel launches a layer
    from Python (H200, 135M shape: a mixed step of 256 decodes and a short prompt took
    ~10 ms served, nearly all of it launches, against ~1.2 ms for its pieces). Here
    attention runs on fixed grids (kernels/attention.FixedGrid) whose size depends only on
    the captured token count T: the decode kernel's grid has min(T, max_seqs) rows and its
    programs past the step's decode count (a device scalar) return at once; the prefill
    kernel gets one program per entry of a (sequence, query tile) list that the host writes
    each step, padded with -1. So for each T of `sizes` the whole forward
    `model(input_ids[:T], positions[:T])` is one graph over static buffers:

        input_ids, positions, slot_mapping [T]     rows n..T-1 padding, slot -1 (no KV write)
        query_start_loc [S+1], seq_lens [S], block_tables [S, W]  rows of the step's sequences
        counts [1 + tiles]                         decode count, then the prefill tiles

    with S = max_seqs. A step of n tokens replays the smallest T >= n (or runs eagerly
    where the cost model, measured at start-up, finds that cheaper); padding rows are
    row-local garbage that never reaches the KV pool or a real row. The runner fills the
    static buffers from its pinned host buffers (`load`), one copy each. Capture is largest
    first into one pool, as for the other graphs.
    """

    attention_in_graph = True  # the runner loads the static inputs (load), then run()

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_seqs: int,
                 max_blocks_per_seq: int, device: torch.device | str,
                 capture: bool = True) -> None:
        """capture=False (CPU tests, with the Triton kernels interpreted): run() runs the
        same forward eagerly over the same static buffers instead of replaying a graph."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"mixed graph sizes must be positive, got {sizes}")
        self.model = model
        self.sizes = sorted(set(sizes))
        self.max_seqs = max_seqs
        self.device = torch.device(device)
        tmax = self.sizes[-1]
        kw = {"device": self.device}
        self.input_ids = torch.zeros(tmax, dtype=torch.long, **kw)
        self.positions = torch.zeros(tmax, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((tmax,), -1, dtype=torch.long, **kw)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, **kw)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, **kw)
        # prefill tiles each size's graph launches (looked up per step, computed once)
        self._tiles = {t: max_prefill_tiles(t, max_seqs) for t in self.sizes}
        self.max_tiles = self._tiles[tmax]
        # [0]: the step's decode count; [1:]: its prefill tiles (-1: none)
        self.counts = torch.empty(1 + self.max_tiles, dtype=torch.int32, **kw)
        self._empty_step()
        self.use_graphs = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # static hidden [T, H] per graph
        self.pool = None
        self.cost: PaddingCostModel | None = None

    def num_tiles(self, t: int) -> int:
        """Prefill tiles the graph of size t launches (kernels.attention.max_prefill_tiles)."""
        return self._tiles[t]

    def _meta(self, t: int) -> AttentionMetadata:
        fixed = FixedGrid(num_decodes=self.counts[:1], max_decodes=min(t, self.max_seqs),
                          tiles=self.counts[1:1 + self.num_tiles(t)])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables,
            num_decodes=fixed.max_decodes, max_query_len=t, max_seq_len=0, query_lens_cpu=[],
            seq_lens_cpu=[], fixed=fixed)

    def _forward(self, t: int) -> torch.Tensor:
        with forward_context(self._meta(t)):
            return self.model(self.input_ids[:t], self.positions[:t])

    def _empty_step(self) -> None:
        """Static inputs of a step with nothing to do: no KV writes, no attention programs."""
        self.slot_mapping.fill_(-1)
        self.counts.fill_(-1)
        self.counts[0] = 0

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Captures every size, largest first (smaller graphs reuse the pool's memory)."""
        self._empty_step()
        if not self.use_graphs:
            return CaptureStats(0, 0.0, 0)
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        for t in reversed(self.sizes):
            stream = torch.cuda.Stream(self.device)  # warm-up: kernel compilation, cuBLAS
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(t)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[t] = self._forward(t)
            self.graphs[t] = graph
        torch.cuda.synchronize(self.device)
        stats = CaptureStats(len(self.graphs), time.perf_counter() - t0, pool_bytes(self.pool))
        log.info("captured %d mixed-step graphs (token counts %d..%d, attention included) in "
                 "%.2f s, %.1f MiB", stats.num_graphs, self.sizes[0], self.sizes[-1],
                 stats.seconds, stats.pool_bytes / 2**20)
        return stats

    @torch.inference_mode()
    def measure_costs(self, repeats: int = 2, long_tokens: int = 2048) -> PaddingCostModel:
        """Times one replay of each size's graph against the same forward run eagerly (host
        launches included; wall time to completion, best of `repeats` after a warm-up pass,
        sizes above `long_tokens` once), both on an empty step (attention programs return at
        once, nothing reaches the KV pool), and keeps them as `self.cost` for `choose`."""
        self._empty_step()

        def passes(t: int) -> int:
            return repeats + 1 if t <= long_tokens else 1

        graph_ms = [best_ms(self.graphs[t].replay, self.device, passes(t)) for t in self.sizes]
        eager_ms = [best_ms(lambda t=t: self._forward(t), self.device, passes(t))
                    for t in self.sizes]
        return self._keep_costs(graph_ms, eager_ms, "mixed-step graph")

    def load(self, t: int, num_seqs: int, ids: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
             block_tables: torch.Tensor, counts: torch.Tensor) -> None:
        """Copies a step's inputs (host buffers, pinned: the copies do not block) into the
        static buffers of size t: ids, positions, slots [>= t] (slots of padding rows -1),
        query_start_loc [>= n+1], seq_lens [>= n], block_tables [>= n, W], counts
        [>= 1 + num_tiles(t)] (decode count, prefill tiles padded with -1)."""
        n = num_seqs
        width = block_tables.shape[1]
        if t not in self._tiles or n > self.max_seqs or width > self.block_tables.shape[1] \
                or (self.use_graphs and t not in self.graphs):
            raise ValueError(f"no mixed-step graph for {t} tokens and {n} sequences")
        nb = dict(non_blocking=True)
        self.input_ids[:t].copy_(ids[:t], **nb)
        self.positions[:t].copy_(positions[:t], **nb)
        self.slot_mapping[:t].copy_(slots[:t], **nb)
        self.query_start_loc[:n + 1].copy_(query_start_loc[:n + 1], **nb)
        self.seq_lens[:n].copy_(seq_lens[:n], **nb)
        self.block_tables[:n, :width].copy_(block_tables[:n], **nb)
        k = 1 + self._tiles[t]
        self.counts[:k].copy_(counts[:k], **nb)

    def run(self, t: int, num_tokens: int) -> torch.Tensor:
        """Replays size t over the loaded inputs -> hidden [num_tokens, H], a view of the
        graph's static output: use it before the next run()."""
        if not self.use_graphs:
            with torch.inference_mode():
                return self._forward(t)[:num_tokens]
        self.graphs[t].replay()
        return self.outputs[t][:num_tokens]
