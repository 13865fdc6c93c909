"""Model runner: turns a ScheduledBatch into tensors, runs the model, samples.

It owns the KV pool (one preallocated tensor) and never changes scheduling state: it
reads the sequences of a batch and returns one sampled token (or None) per sequence.

CPU: inputs are built with numpy per step and the model runs eagerly.

CUDA (see `setup_cuda`, called by LLMEngine):
  - the step's integer inputs are written into pinned, preallocated host buffers (numpy
    views) and copied to preallocated device buffers with non-blocking copies;
  - a pure-decode step of n <= the largest decode bucket sequences replays the CUDA graph
    of the smallest captured batch size >= n (kernels/cuda_graphs.DecodeGraphs); the
    padding rows are dummies that write only the reserved block 0. Prefill, mixed and
    larger decode steps replay piecewise graphs (kernels/cuda_graphs.PiecewiseGraphs:
    everything but attention, at the next captured token count, attention eager on the
    real rows), or run eagerly when graphs are off;
  - the only device-to-host sync of a step is the sampler's copy of the sampled ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from bucketserve.engine.sampler import Sampler
from bucketserve.engine.scheduler import ScheduledBatch
from bucketserve.engine.sequence import TokenLogprob
from bucketserve.kernels.attention import AttentionMetadata, forward_context

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled: list[int | None]  # per batch sequence; None while still in its prompt
    logprobs: list[TokenLogprob | None]
    # rows the forward computed beyond the step's tokens: a decode graph's dummy rows, a
    # piecewise graph's padding to its token count (0 on the eager paths)
    num_padding: int = 0


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def gpu_kv_budget_blocks(model: torch.nn.Module, num_layers: int, num_kv_heads: int,
                         head_dim: int, block_size: int, dtype: torch.dtype,
                         max_num_tokens: int, max_num_seqs: int, max_model_len: int,
                         memory_fraction: float, device: torch.device,
                         reserve_bytes: int = 256 * 2**20,
                         reserve_graph_activations: bool = False) -> tuple[int, dict]:
    """KV blocks that fit in `memory_fraction` of the GPU after a warm-up forward.

    The warm-up runs the largest step the scheduler can issue (max_num_tokens prompt
    tokens in sequences of at most max_model_len) plus the logits of max_num_seqs rows, over
    a small temporary pool, and reads the allocator's peak: weights + activations +
    logits. Memory outside torch's allocator (CUDA context, other processes) is counted
    as used. `reserve_bytes` is kept back for the decode graphs' pool and the sampler.
    `reserve_graph_activations` (piecewise CUDA graphs on) keeps back the warm-up's
    activations once more (its peak less the model's parameters and buffers): the graphs'
    private pool holds a stage's activations at the largest step, apart from the memory
    that eager steps reuse. Returns (blocks, details for the log)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    # the largest step: max_num_tokens prompt tokens, in sequences of <= max_model_len
    t = max(1, max_num_tokens)
    lens = [min(max_model_len, t - i) for i in range(0, t, max_model_len)]
    per_seq = -(-max(lens) // block_size)
    nblk = 1 + per_seq * len(lens)  # block 0 stays the dummy
    pool = torch.zeros(num_layers, 2, nblk, block_size, num_kv_heads, head_dim,
                       dtype=dtype, device=device)
    pool_bytes = pool.numel() * pool.element_size()
    model.bind_kv_cache(pool)
    tables = 1 + torch.arange(len(lens) * per_seq, dtype=torch.int32).view(len(lens), per_seq)
    pos = torch.cat([torch.arange(n) for n in lens])
    seq_of = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    slots = tables[seq_of, pos // block_size].long() * block_size + pos % block_size
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), num_decodes=0, max_query_len=max(lens),
        max_seq_len=max(lens), query_lens_cpu=lens, seq_lens_cpu=lens)
    with torch.inference_mode():
        with forward_context(meta):
            hidden = model(torch.zeros(t, dtype=torch.long, device=device), pos.to(device))
        rows = hidden[torch.arange(max_num_seqs, device=device) % t]
        logits = model.compute_logits(rows)
        torch.argmax(logits, dim=-1).tolist()
    del hidden, rows, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - pool_bytes
    del pool  # (still bound to the model until the real pool replaces it: small)
    # no empty_cache(): the activation blocks stay cached for the first large steps (a
    # cudaMalloc there would stall the step); `reserved` below counts them
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)  # context, other processes
    graph_act = 0
    if reserve_graph_activations:
        tensors = [*model.parameters(), *model.buffers()]
        graph_act = max(0, peak - sum(x.numel() * x.element_size() for x in tensors))
    budget = memory_fraction * total - outside - peak - reserve_bytes - graph_act
    per_block = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
    blocks = max(2, int(budget // per_block))
    info = {"total_gib": total / 2**30, "peak_torch_gib": peak / 2**30,
            "outside_torch_gib": outside / 2**30, "kv_budget_gib": budget / 2**30,
            "graph_activations_gib": graph_act / 2**30, "warmup_tokens": t}
    log.info("GPU memory: total %.1f GiB, warm-up peak %.2f GiB, outside torch %.2f GiB, "
             "kept for piecewise graphs %.2f GiB, KV budget %.2f GiB (fraction %.2f) -> %d "
             "blocks", info["total_gib"], info["peak_torch_gib"], info["outside_torch_gib"],
             info["graph_activations_gib"], info["kv_budget_gib"], memory_fraction, blocks)
    return blocks, info


_NO_TABLE: tuple[None, int] = (None, -1)


class StepInputs:
    """Preallocated host (pinned on CUDA) and device buffers for one step's integer inputs.

    Sizes: ids/positions/slots [max_tokens] int64, seq_lens [max_seqs] int32,
    query_start_loc [max_seqs + 1] int32, block_tables [max_seqs, max_blocks] int32.
    `fill` writes a batch into the host buffers (padded with dummy decode rows up to
    `pad_to`), `to_device` copies the used prefix of each with non-blocking copies.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.h_ids = host(max_tokens, torch.int64)
        self.h_pos = host(max_tokens, torch.int64)
        self.h_slots = host(max_tokens, torch.int64)
        self.h_seq_lens = host(max_seqs, torch.int32)
        self.h_qsl = host(max_seqs + 1, torch.int32)
        self.h_tables = host((max_seqs, max_blocks), torch.int32)
        # numpy views share the (pinned) memory
        self.ids, self.pos, self.slots = self.h_ids.numpy(), self.h_pos.numpy(), self.h_slots.numpy()
        self.seq_lens, self.qsl = self.h_seq_lens.numpy(), self.h_qsl.numpy()
        self.tables = self.h_tables.numpy()
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        # per table row: (the block_table list written there, its length then)
        self._row_tables: list[tuple[list[int] | None, int]] = [_NO_TABLE] * max_seqs
        # recorded after each step's host-to-device copies: the host buffers are rewritten
        # only once the previous copies have read them (a step that samples nothing has no
        # other sync)
        self.copied = torch.cuda.Event() if pin else None

    def wait_copies(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def mark_copied(self) -> None:
        if self.copied is not None:
            self.copied.record()

    def fill(self, batch: ScheduledBatch, pad_to: int = 0):
        """Host buffers <- batch. Returns (num_tokens, num_rows, seq_lens list, sample_rows,
        sample_seqs, width): rows = sequences + dummy rows up to pad_to (decode only)."""
        bs = self.block_size
        seqs, counts = batch.seqs, batch.num_new_tokens
        n = len(seqs)
        nd = batch.num_decodes
        starts = [s.num_computed_tokens for s in seqs]
        tabs = [s.block_table for s in seqs]
        width = max(map(len, tabs))
        rows = max(n, pad_to)
        if width > self.max_blocks or rows > self.max_seqs:
            raise ValueError(f"step needs {rows} rows x {width} blocks; buffers hold "
                             f"{self.max_seqs} x {self.max_blocks}")
        total = nd + sum(counts[nd:])
        ntok = max(total, pad_to)
        if ntok > self.max_tokens:
            raise ValueError(f"step has {ntok} tokens; buffers hold {self.max_tokens}")
        # decodes (rows 0..nd-1): one token each at position start
        if nd:
            dstart = starts[:nd]
            self.ids[:nd] = [s.token_ids[p] for s, p in zip(seqs[:nd], dstart, strict=True)]
            self.pos[:nd] = dstart
            self.slots[:nd] = [t[p // bs] * bs + p % bs for t, p in zip(tabs[:nd], dstart, strict=True)]
        seq_lens = [p + c for p, c in zip(starts, counts, strict=True)]
        # prefills: ranges of tokens
        cursor = nd
        for i in range(nd, n):
            seq, start, c = seqs[i], starts[i], counts[i]
            end = start + c
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(tabs[i], dtype=np.int64)
            self.ids[cursor:cursor + c] = seq.token_ids[start:end]
            self.pos[cursor:cursor + c] = pos
            self.slots[cursor:cursor + c] = table[pos // bs] * bs + pos % bs
            cursor += c
        self.seq_lens[:n] = seq_lens
        self.qsl[0] = 0
        np.cumsum(counts, out=self.qsl[1:n + 1])
        # Block tables: a row's entries past its own pages are never read (kernels read the
        # ceil(seq_len / block_size) pages a sequence owns), so they may hold stale ids. A
        # row is rewritten only when it holds another table than last step or the table
        # grew (decode steps mostly repeat the previous batch: ~1.5 us a row saved).
        t, cached = self.tables, self._row_tables
        for i, tab in enumerate(tabs):
            c = cached[i]
            if c[0] is not tab or c[1] != len(tab):
                t[i, :len(tab)] = tab
                cached[i] = (tab, len(tab))
        if rows > n:  # dummy decode rows: token 0 at position 0 in the dummy block 0
            self.ids[n:rows] = 0
            self.pos[n:rows] = 0
            self.slots[n:rows] = 0
            self.seq_lens[n:rows] = 1
            self.qsl[n + 1:rows + 1] = np.arange(n + 1, rows + 1)
            t[n:rows, 0] = 0
            cached[n:rows] = [_NO_TABLE] * (rows - n)
        if nd == n and sum(seq_lens) == sum(s.num_tokens for s in seqs):
            # pure decode, all caught up (seq_lens[i] <= num_tokens, so equal sums mean
            # equal terms; a 1-token prompt chunk also has one new token but no sample)
            return ntok, rows, seq_lens, list(range(n)), list(range(n)), width
        sample_rows, sample_seqs = [], []
        qsl = self.qsl
        for i in range(n):
            if seq_lens[i] == seqs[i].num_tokens:  # every known token computed: sample next
                sample_rows.append(int(qsl[i + 1]) - 1)
                sample_seqs.append(i)
        return ntok, rows, seq_lens, sample_rows, sample_seqs, width


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 sampler: Sampler) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = sampler
        # [layers, k/v, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=device)
        model.bind_kv_cache(self.kv_cache)
        if device.type == "cpu" and hasattr(model, "pack_cpu_weights") and model.pack_cpu_weights():
            log.info("CPU: projections use MKL's packed sgemm")
        log.info("KV pool: %d blocks of %d tokens, %.2f GiB", num_blocks, block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)
        self.inputs: StepInputs | None = None  # CUDA: set by setup_cuda
        self.graphs = None  # kernels.cuda_graphs.DecodeGraphs when captured
        self.piecewise = None  # kernels.cuda_graphs.PiecewiseGraphs when captured
        self.step_timing: dict[str, float] = {"prepare_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}
        self.num_graph_steps = 0  # steps that replayed a captured decode graph
        self.num_piecewise_steps = 0  # prefill / mixed steps run as piecewise graphs

    # ---- CUDA set-up ---------------------------------------------------------------------

    def setup_cuda(self, max_num_seqs: int, max_num_tokens: int, max_model_len: int,
                   decode_batch_sizes: list[int], use_cuda_graphs: bool = True,
                   piecewise_graphs: bool = True,
                   prefill_boundaries: tuple[int, ...] | None = None) -> dict:
        """Allocates the step buffers, compiles the attention kernels' variants and captures
        the decode graphs (largest first, one pool) and, with `piecewise_graphs`, the
        piecewise graphs of prefill and mixed steps up to max_num_tokens tokens (at the
        prefill boundaries and multiples of 1024: cuda_graphs.piecewise_sizes). Returns
        {"graphs": n, "capture_s": s, "graph_pool_mib": m, "kernel_warmup_s": s,
        "piecewise_graphs": n, "piecewise_capture_s": s, "piecewise_pool_mib": m} for the
        start-up log."""
        if self.device.type != "cuda":
            raise ValueError("setup_cuda needs a CUDA device")
        sizes = sorted({b for b in decode_batch_sizes if b >= 1})
        max_blocks = -(-max_model_len // self.block_size)
        max_seqs = max([max_num_seqs, *sizes])
        self.inputs = StepInputs(max(max_num_tokens, max_seqs), max_seqs, max_blocks,
                                 self.block_size, self.device)
        info = {"graphs": 0, "capture_s": 0.0, "graph_pool_mib": 0.0}
        backend = getattr(self.model, "attn_backend", None)
        if hasattr(backend, "warm_up"):  # compile kernel variants now, not mid-run
            t0 = time.perf_counter()
            cfg = self.model.config
            backend.warm_up(self.kv_cache[0, 0], self.kv_cache[0, 1], cfg.num_heads, max_blocks)
            info["kernel_warmup_s"] = time.perf_counter() - t0
        if use_cuda_graphs and sizes and not getattr(backend, "graph_capturable", False):
            log.warning("attention backend %r cannot be captured in a CUDA graph (it syncs "
                        "with the host); decode steps run eagerly",
                        getattr(backend, "name", type(backend).__name__))
        elif use_cuda_graphs and sizes:
            from bucketserve.kernels.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, sizes, max_blocks, max_model_len, self.device)
            stats = self.graphs.capture()
            info.update(graphs=stats.num_graphs, capture_s=stats.seconds,
                        graph_pool_mib=stats.pool_bytes / 2**20)
            if piecewise_graphs and getattr(self.model, "fused_ops", False) \
                    and hasattr(self.model, "stage_first"):
                from bucketserve.kernels.cuda_graphs import PiecewiseGraphs, piecewise_sizes

                sizes = (piecewise_sizes(max_num_tokens, tuple(prefill_boundaries))
                         if prefill_boundaries else piecewise_sizes(max_num_tokens))
                self.piecewise = PiecewiseGraphs(self.model, sizes, self.device)
                stats = self.piecewise.capture()
                info.update(piecewise_graphs=stats.num_graphs, piecewise_capture_s=stats.seconds,
                            piecewise_pool_mib=stats.pool_bytes / 2**20)
        return info

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        if self.inputs is not None:
            return self._run_cuda(batch)
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(batch)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        sampled: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(batch.seqs)
        if sample_seqs:
            logits = self.model.compute_logits(hidden[sample_rows])
            out = self.sampler(logits, [batch.seqs[i] for i in sample_seqs])
            for i, tok, lp in zip(sample_seqs, out.token_ids, out.logprobs, strict=True):
                sampled[i] = tok
                logprobs[i] = lp
        return RunnerOutput(sampled, logprobs)

    def _run_cuda(self, batch: ScheduledBatch) -> RunnerOutput:
        t0 = time.perf_counter()
        n = len(batch.seqs)
        g = self.graphs
        pad = g.padded_size(n) if g is not None and batch.num_decodes == n else None
        inp = self.inputs
        t_pw = None  # the piecewise graphs' token count, when they run this step
        inp.wait_copies()
        ntok, rows, seq_lens, sample_rows, sample_seqs, width = inp.fill(batch, pad or 0)
        if pad is not None:
            # straight into the graph's static inputs; graph rows >= pad are never read
            g.input_ids[:pad].copy_(inp.h_ids[:pad], non_blocking=True)
            g.positions[:pad].copy_(inp.h_pos[:pad], non_blocking=True)
            g.slot_mapping[:pad].copy_(inp.h_slots[:pad], non_blocking=True)
            g.seq_lens[:pad].copy_(inp.h_seq_lens[:pad], non_blocking=True)
            # whole rows (a row reads only the pages its own sequence owns)
            g.block_tables[:pad].copy_(inp.h_tables[:pad], non_blocking=True)
            inp.mark_copied()
            t1 = time.perf_counter()
            g.graphs[pad].replay()
            self.num_graph_steps += 1
            hidden = g.outputs[pad][:n]
        else:
            dev = self.device
            pw = self.piecewise
            t_pw = pw.padded_size(ntok) if pw is not None else None
            if t_pw is not None:
                # rows ntok..t_pw-1 of the host buffers hold stale but valid ids / positions
                pw.input_ids[:t_pw].copy_(inp.h_ids[:t_pw], non_blocking=True)
                pw.positions[:t_pw].copy_(inp.h_pos[:t_pw], non_blocking=True)
            else:
                ids = inp.h_ids[:ntok].to(dev, non_blocking=True)
                pos = inp.h_pos[:ntok].to(dev, non_blocking=True)
            meta = AttentionMetadata(
                slot_mapping=inp.h_slots[:ntok].to(dev, non_blocking=True),
                query_start_loc=inp.h_qsl[:n + 1].to(dev, non_blocking=True),
                seq_lens=inp.h_seq_lens[:n].to(dev, non_blocking=True),
                # whole rows: contiguous; columns past a row's own pages are never read
                block_tables=inp.h_tables[:n].to(dev, non_blocking=True),
                num_decodes=batch.num_decodes,
                max_query_len=max(batch.num_new_tokens),
                max_seq_len=max(seq_lens),
                query_lens_cpu=list(batch.num_new_tokens),
                seq_lens_cpu=seq_lens,
            )
            inp.mark_copied()
            t1 = time.perf_counter()
            with forward_context(meta):
                if t_pw is not None:
                    hidden = pw.run(t_pw, ntok)
                    self.num_piecewise_steps += 1
                else:
                    hidden = self.model(ids, pos)
        t2 = time.perf_counter()
        sampled: list[int | None] = [None] * n
        logprobs: list[TokenLogprob | None] = [None] * n
        if sample_seqs:
            k = len(sample_rows)
            if sample_rows[-1] == k - 1:  # rows 0..k-1 (increasing): decode steps
                h = hidden[:k]
            else:
                idx = torch.tensor(sample_rows, dtype=torch.long).to(self.device, non_blocking=True)
                h = hidden[idx]
            logits = self.model.compute_logits(h)
            out = self.sampler(logits, [batch.seqs[i] for i in sample_seqs])  # the one sync
            for i, tok, lp in zip(sample_seqs, out.token_ids, out.logprobs, strict=True):
                sampled[i] = tok
                logprobs[i] = lp
        t3 = time.perf_counter()
        st = self.step_timing
        st["prepare_s"] += t1 - t0
        st["forward_s"] += t2 - t1
        st["sample_s"] += t3 - t2
        if pad is not None:
            padding = pad - n
        elif t_pw is not None:
            padding = t_pw - ntok
        else:
            padding = 0
        return RunnerOutput(sampled, logprobs, padding)

    def _prepare(self, batch: ScheduledBatch):
        """Flattened inputs for one step; the per-token arrays are built with numpy."""
        bs = self.block_size
        seqs, counts = batch.seqs, batch.num_new_tokens
        n_seqs = len(seqs)
        total = sum(counts)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((n_seqs, max_blocks), dtype=np.int32)
        seq_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sample_seqs: list[int] = []
        cursor = 0
        for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            start = seq.num_computed_tokens
            end = start + n
            table = np.asarray(seq.block_table, dtype=np.int64)
            tables[i, : len(table)] = table
            pos = np.arange(start, end, dtype=np.int64)
            input_ids[cursor : cursor + n] = seq.token_ids[start:end]
            positions[cursor : cursor + n] = pos
            slots[cursor : cursor + n] = table[pos // bs] * bs + pos % bs
            cursor += n
            seq_lens.append(end)
            query_start.append(cursor)
            if end == seq.num_tokens:  # every known token computed: sample the next one
                sample_rows.append(cursor - 1)
                sample_seqs.append(i)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            num_decodes=batch.num_decodes,
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(counts),
            seq_lens_cpu=seq_lens,
        )
        rows = torch.tensor(sample_rows, dtype=torch.long).to(dev, non_blocking=True)
        return (torch.from_numpy(input_ids).to(dev, non_blocking=True),
                torch.from_numpy(positions).to(dev, non_blocking=True), meta, rows, sample_seqs)
