"""Device work of the embedding batcher: a batch of token-id rows in, float32 vectors out.

A runner has two calls, so the batcher's worker can build and launch batch k+1 while the
device still runs batch k:

    ticket = runner.launch(rows, length)   # rows: token-id sequences, each 1..length long
    vectors = runner.collect(ticket)       # [len(rows), D] float32 numpy, owned by the caller

`FunctionRunner` wraps any `encode(input_ids [B, L] long, mask [B, L] bool) -> [B, D]`
(the CPU model, test fakes) and runs it inside launch.

`CudaGraphRunner` runs a BertEmbeddingModel on a GPU with one CUDA graph per (batch size,
length bucket), captured at start-up into one memory pool, largest first:

    host (pinned, 2 slots)          device (static, outside the pool)
    in[s]  [B, 1 + L] int32  --H2D-->  in   [B, 1 + L]   column 0: length; 1..L: ids
                                        graph (B, L): embed_lengths(ids, lengths)
    out[s] [B, D] float32    <--D2H--  out  [B, D]

One host-to-device and one device-to-host copy per batch; the two host slots alternate, so a
slot is rewritten only after the batch that used it was collected. A batch of n rows runs at
the smallest captured batch size >= n (round_up_batch_size); rows n.. are padding rows of
length 1 (their vectors are computed and dropped). More rows than the largest captured size,
or a length without graphs, run the same forward eagerly. All device work is on the runner's
own stream, so it does not serialise with an LLM engine sharing the GPU.

On a CPU device (tests without CUDA) nothing is captured: every shape that would be a graph
runs eagerly at its padded size, so the padding-row and shape-selection logic is the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bucketserve.buckets import BucketSpec, round_up_batch_size
from bucketserve.kernels.cuda_graphs import CaptureStats, pool_bytes

log = logging.getLogger("bucketserve.embeddings")

EncodeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Ticket:
    """A launched batch: `rows` real rows computed as `padded_rows` (graph padding)."""

    rows: int
    padded_rows: int
    length: int
    slot: int = 0
    event: Any = None  # torch.cuda.Event recorded after the D2H copy
    result: np.ndarray | None = None  # FunctionRunner: the vectors, ready at launch


def fill_rows(buf: np.ndarray, rows: Sequence[Sequence[int]], pad_id: int) -> None:
    """buf [P, 1 + L] int: column 0 the row's length, columns 1.. its ids then pad_id; rows
    len(rows)..P-1 become padding rows of length 1."""
    buf.fill(pad_id)
    buf[:, 0] = 1
    for r, ids in enumerate(rows):
        n = len(ids)
        buf[r, 0] = n
        buf[r, 1:n + 1] = ids


class FunctionRunner:
    """Runs `encode` synchronously in launch (CPU model, test fakes).

    `trim` (the served CPU path): a batch is computed at its longest row, not at its bucket
    length. An eager forward has no compiled shape to fit, so the columns past the longest
    row would be padding computed for nothing: the bucket still groups inputs of similar
    length (and names the batch), and the ticket's `length` is what was computed."""

    asynchronous = False  # launch returns with the vectors ready

    def __init__(self, encode: EncodeFn, pad_token_id: int = 0, trim: bool = False) -> None:
        self.encode = encode
        self.pad_token_id = pad_token_id
        self.trim = trim

    def launch(self, rows: Sequence[Sequence[int]], length: int) -> Ticket:
        if self.trim and rows:
            length = max(len(r) for r in rows)
        buf = np.empty((len(rows), length + 1), dtype=np.int64)
        fill_rows(buf, rows, self.pad_token_id)
        t = torch.from_numpy(buf)
        ids, lengths = t[:, 1:], t[:, 0]
        mask = torch.arange(length)[None, :] < lengths[:, None]
        out = self.encode(ids, mask)  # [B, D]
        result = out.detach().float().cpu().numpy()
        return Ticket(len(rows), len(rows), length, result=result)

    def collect(self, ticket: Ticket) -> np.ndarray:
        assert ticket.result is not None
        return ticket.result


def graph_shapes(spec: BucketSpec, batch_sizes: Sequence[int],
                 capacity: Callable[[int], int]) -> list[tuple[int, int]]:
    """(B, L) shapes worth capturing: for each bucket length L, the batch sizes up to the one
    a full batch (capacity(L) rows) rounds up to; largest B * L first (capture order)."""
    sizes = sorted(set(batch_sizes))
    shapes = []
    for length in spec.boundaries:
        top = round_up_batch_size(capacity(length), sizes) or sizes[-1]
        shapes += [(b, length) for b in sizes if b <= top]
    return sorted(shapes, key=lambda s: (s[0] * s[1], s[1]), reverse=True)


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, spec: BucketSpec, batch_sizes: Sequence[int],
                 capacity: Callable[[int], int], pad_token_id: int = 0,
                 device: torch.device | str = "cuda") -> None:
        self.model = model
        self.spec = spec
        self.sizes = sorted(set(batch_sizes))
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.shapes = graph_shapes(spec, self.sizes, capacity)
        self.shape_set = set(self.shapes)
        dim = model.embedding_dim
        # Most rows any batch can have: the largest capacity, or the largest graph size.
        self.max_rows = max_rows = max(max(capacity(b) for b in spec.boundaries),
                                       max(b for b, _ in self.shapes))
        width = spec.max_len + 1
        cuda = self.device.type == "cuda"
        self.asynchronous = cuda  # launch only enqueues device work; collect waits for it
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.dev_in = torch.zeros(max_rows * width, dtype=torch.int32, device=self.device)
        self.dev_out = torch.zeros(max_rows, dim, dtype=torch.float32, device=self.device)
        self.host_in = [torch.zeros(max_rows * width, dtype=torch.int32, pin_memory=cuda)
                        for _ in range(2)]
        self.host_out = [torch.zeros(max_rows, dim, dtype=torch.float32, pin_memory=cuda)
                         for _ in range(2)]
        self._host_in_np = [t.numpy() for t in self.host_in]
        self._host_out_np = [t.numpy() for t in self.host_out]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if cuda else [None, None]
        self._slot = 0
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.report: CaptureStats | None = None
        self.num_graph_batches = 0  # batches at a captured shape (CPU: at a padded shape)
        self.num_eager_batches = 0  # batches above the largest captured size

    # ------------------------------------------------------------------ forward over statics
    def _forward(self, rows: int, length: int) -> None:
        # dev_in[: rows * (1 + length)] viewed [rows, 1 + length] -> dev_out[:rows]
        buf = self.dev_in[: rows * (length + 1)].view(rows, length + 1)
        out = self.model.embed_lengths(buf[:, 1:], buf[:, 0])
        self.dev_out[:rows].copy_(out)

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Captures every shape, largest first, into one pool; logs count, time, memory."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        warmed: set[int] = set()
        with torch.cuda.stream(self.stream):  # None (CPU): no-op
            for rows, length in self.shapes:
                # fill the statics with valid padding rows (length 1), as any replay sees
                fill_rows(self._host_in_np[0][: rows * (length + 1)].reshape(rows, length + 1),
                          [], self.pad_token_id)
                self.dev_in[: rows * (length + 1)].copy_(self.host_in[0][: rows * (length + 1)])
                if length not in warmed:  # kernel selection / cuBLAS workspaces, per length
                    self._forward(rows, length)
                    warmed.add(length)
                # capture_begin/end directly: torch.cuda.graph() would also gc.collect() and
                # empty the allocator's cache for every one of the few hundred shapes
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool)
                try:
                    self._forward(rows, length)
                finally:
                    graph.capture_end()
                self.graphs[(rows, length)] = graph
        torch.cuda.synchronize(self.device)
        report = CaptureStats(len(self.graphs), time.perf_counter() - t0, pool_bytes(self.pool))
        self.report = report
        sizes = sorted({b for b, _ in self.shapes})
        log.info("captured %d embedding graphs (%d length buckets %d..%d x batch sizes %s) in "
                 "%.2f s, %.1f MiB pool", report.num_graphs, len(self.spec), self.spec.boundaries[0],
                 self.spec.max_len, sizes, report.seconds, report.pool_bytes / 2**20)
        return report

    def padded_rows(self, rows: int, length: int) -> int:
        """Rows a batch of `rows` at `length` is computed at (itself when eager)."""
        size = round_up_batch_size(rows, self.sizes)
        return size if size is not None and (size, length) in self.shape_set else rows

    # ------------------------------------------------------------------ one batch
    @torch.inference_mode()
    def launch(self, rows: Sequence[Sequence[int]], length: int) -> Ticket:
        n = len(rows)
        if n > self.max_rows or length > self.spec.max_len:
            raise ValueError(f"a batch of {n} x {length} exceeds the runner's buffers "
                             f"({self.max_rows} x {self.spec.max_len})")
        padded = self.padded_rows(n, length)
        slot = self._slot
        self._slot ^= 1
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # its last batch was collected already; cheap
        count = padded * (length + 1)
        fill_rows(self._host_in_np[slot][:count].reshape(padded, length + 1), rows,
                  self.pad_token_id)
        with torch.cuda.stream(self.stream):  # None (CPU): no-op
            self.dev_in[:count].copy_(self.host_in[slot][:count], non_blocking=True)
            graph = self.graphs.get((padded, length))
            if graph is not None:
                graph.replay()
            else:
                self._forward(padded, length)
            if (padded, length) in self.shape_set:
                self.num_graph_batches += 1
            else:
                self.num_eager_batches += 1
            self.host_out[slot][:n].copy_(self.dev_out[:n], non_blocking=True)
            if event is not None:
                event.record(self.stream)
        return Ticket(n, padded, length, slot=slot, event=event)

    def collect(self, ticket: Ticket) -> np.ndarray:
        if ticket.event is not None:
            ticket.event.synchronize()
        return self._host_out_np[ticket.slot][: ticket.rows].copy()


Runner = FunctionRunner | CudaGraphRunner
