"""CUDA graphs of the model's forward for pure-decode steps, one per batch size.

A decode step launches ~15 kernels a layer that each run for a few microseconds, so at
small batches the CPU launch cost dominates (measured on an H200: 135M shape, batch 1,
13.9 ms eager vs 1.5 ms as one graph). DecodeGraphs captures `model(input_ids, positions)`
once per batch size from the TOML's decode list, largest first, into one shared memory
pool. A step of n decodes is padded up to the smallest captured size >= n:

    rows 0..n-1   the real decodes (inputs copied into the static buffers)
    rows n..bs-1  dummies: token 0 at position 0, seq_len 1, block table row of zeros and
                  slot 0, so they write into and read from the reserved dummy block 0 only

Steps with prefills, or more decodes than the largest size, run eagerly (the caller's
choice: `padded_size` returns None). Works with any AttentionBackend whose forward does no
host sync (TritonAttentionBackend).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from bucketserve.kernels.attention import AttentionMetadata, forward_context

log = logging.getLogger(__name__)


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
        """Memory the graphs' private pool holds (segments of that pool in the allocator's
        snapshot; a reserved-memory delta is blurred by other frees and allocations)."""
        if self.pool is None:
            return 0
        pool = tuple(self.pool)
        return sum(int(seg.get("total_size", 0)) for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured size a step of `num_decodes` decodes runs at, or None (eager)."""
        for bs in self.sizes:
            if bs >= num_decodes:
                return bs
        return None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Replays the graph for a pure-decode step -> hidden [n, H]. The result is a view
        of the graph's static output: use it before the next run()."""
        n = meta.num_seqs
        bs = self.padded_size(n)
        if meta.num_decodes != n or bs is None or not self.graphs:
            raise ValueError(f"no captured graph for {n} sequences ({meta.num_decodes} decodes); "
                             "run this step eagerly")
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables are {width} wide; graphs were captured for "
                             f"{self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # columns >= width of real rows are stale but never read: a row reads only the
        # ceil(seq_len / block_size) <= width pages its sequence owns
        self.block_tables[:n, :width].copy_(meta.block_tables)
        end = min(bs, self._dirty)
        if end > n:  # turn rows left over from a larger step back into dummies
            self.input_ids[n:end].zero_()
            self.positions[n:end].zero_()
            self.slot_mapping[n:end].zero_()
            self.seq_lens[n:end].fill_(1)
            self.block_tables[n:end].zero_()
        self._dirty = self._dirty if self._dirty > bs else n
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
