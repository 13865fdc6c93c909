"""Model runner: turns a ScheduledBatch into tensors, runs the model, samples.

It owns the KV pool (one preallocated tensor) and never changes scheduling state: it
reads the sequences of a batch and returns one sampled token (or None) per sequence.

One step, on any device:

  1. `StepInputs.fill` writes the step's integer inputs into preallocated host buffers
     (pinned on CUDA) and returns a `StepPlan` (counts, the rows to sample, and the decode
     rows whose input token is still on the device, see below); the buffers are copied to
     the device with non-blocking copies;
  2. one of the forwards: a pure-decode step of n <= the largest decode graph size
     replays a decode CUDA graph (kernels/cuda_graphs.DecodeGraphs: the host buffers are
     copied straight into its static inputs, padded to the captured size with dummy
     rows); a prefill or mixed step (or a larger decode step)
     replays the graph of the next captured token count, attention included
     (kernels/cuda_graphs.MixedGraphs: its static inputs are copied straight from the
     pinned host buffers; `[prefill] mixed_graphs = "piecewise"`: PiecewiseGraphs, graphs
     of everything but attention, which then runs eagerly between them) unless the cost
     model measured at start-up (PaddingCostModel) says an eager run of its exact tokens
     is cheaper than the padded replay; anything else runs eagerly;
  3. one sampling tail: the logits of the sampled rows, the sampler's token ids (a device
     tensor), and a non-blocking copy of those ids to the host.

`launch()` does all three and returns a `RunnerStep` at once, without waiting for the
device; `RunnerStep.result()` waits for the copied ids (the one host sync of a step). With
overlapped scheduling (LLMEngine) the next step is launched before that wait: a decode row
whose token was sampled by the previous, still unresolved, step (the sequence's
`num_pending`) gets id 0 on the host and its id is gathered on the device from the
previous step's sampled tensor (`StepPlan.placeholder_rows` / `placeholder_src`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bucketserve.engine.kv_budget import KVLayout, StepLimits
from bucketserve.engine.sampler import Sampler
from bucketserve.engine.scheduler import ScheduledBatch
from bucketserve.engine.sequence import Sequence, TokenLogprob
from bucketserve.kernels.attention import AttentionMetadata, forward_context, prefill_tiles
from bucketserve.kernels.cpu_plan import CpuPlan, resolve_cpu_plan

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    """A step's sampled tokens: `ids[j]` is the token of batch sequence `seqs[j]` (the ones
    that sampled, in batch order), `logprobs[j]` its logprobs (None: the step asked none)."""

    seqs: list[int]
    ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    # rows the forward computed beyond the step's tokens: a decode graph's dummy rows, a
    # piecewise graph's padding to its token count (0 on the eager path)
    num_padding: int = 0


@dataclass(slots=True)
class StepPlan:
    """What `StepInputs.fill` wrote for one step: counts, rows to sample, placeholders."""

    num_seqs: int
    num_decodes: int
    num_tokens: int  # token rows (decodes first, then the prefill chunks)
    seq_lens: list[int]  # context length of each sequence after the step
    query_lens: list[int]
    sample_rows: list[int]  # token rows whose hidden state is sampled (increasing)
    sample_seqs: list[int]  # the batch index of each sampled row
    # decode rows whose input id is a token the previous step sampled and the host has not
    # seen yet, and that token's index in the previous step's sampled ids
    placeholder_rows: list[int]
    placeholder_src: list[int]

    @property
    def is_decode(self) -> bool:
        return self.num_decodes == self.num_seqs

    def sampled(self, seqs: list[Sequence]) -> list[Sequence]:
        """The batch's sequences that sample, in order (the batch's own list when all do)."""
        return seqs if len(self.sample_seqs) == len(seqs) else [seqs[i] for i in self.sample_seqs]


_NO_TABLE: tuple[None, int] = (None, -1)
# StepInputs._fill_tables: how many rows further down a moved table is looked for
_MOVE_PROBE = 8


class StepInputs:
    """Preallocated host buffers (pinned on CUDA) for one step's integer inputs.

    Sizes: ids/positions/slots [max_tokens] int64, seq_lens [max_seqs] int32,
    query_start_loc [max_seqs + 1] int32, block_tables [max_seqs, max_blocks] int32, and
    [max_seqs] int64 rows for the sampled rows and the placeholders. `fill` writes a batch;
    `to_device` copies the used prefix of each with non-blocking copies (on the CPU it
    returns views of the buffers themselves).
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
        self.h_sample_rows = host(max_seqs, torch.int64)
        self.h_ph_rows = host(max_seqs, torch.int64)
        self.h_ph_src = host(max_seqs, torch.int64)
        # numpy views share the (pinned) memory
        self.ids, self.pos, self.slots = self.h_ids.numpy(), self.h_pos.numpy(), self.h_slots.numpy()
        self.seq_lens, self.qsl = self.h_seq_lens.numpy(), self.h_qsl.numpy()
        self.tables = self.h_tables.numpy()
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self._arange = np.arange(max_seqs + 1)  # row numbers, and a decode step's query starts
        # per table row: (the block_table list written there, its length then)
        self._row_tables: list[tuple[list[int] | None, int]] = [_NO_TABLE] * max_seqs
        # recorded after each step's host-to-device copies: the host buffers are rewritten
        # only once the previous copies have read them
        self.copied = torch.cuda.Event() if pin else None

    def fill(self, batch: ScheduledBatch,
             pending_index: dict[Sequence, int] | None = None) -> StepPlan:
        """Host buffers <- batch. A decode row at a position past its sequence's known
        tokens takes its id from the previous step: `pending_index` maps each sequence that
        step sampled to the index of its token there."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have read the buffers
        bs = self.block_size
        seqs, counts = batch.seqs, batch.num_new_tokens
        n = len(seqs)
        nd = batch.num_decodes
        if n > self.max_seqs:
            raise ValueError(f"step needs {n} rows; buffers hold {self.max_seqs}")
        ntok = nd + sum(counts[nd:])
        if ntok > self.max_tokens:
            raise ValueError(f"step has {ntok} tokens; buffers hold {self.max_tokens}")
        self._fill_tables(seqs)  # first: the decode slots are read from them below
        t = self.tables
        ph_rows: list[int] = []
        ph_src: list[int] = []
        lag: list[int] = []  # decode rows that do not sample (a one-token chunk mid-prompt)
        starts = [s.num_computed_tokens for s in seqs]
        pure_decode = 0 < nd == n  # (a decode row is one new token: ScheduledBatch)
        # decodes (rows 0..nd-1): one token each at position start; a row samples when it
        # then covers every token of its sequence (pending ones included)
        if nd:
            ids = [0] * nd
            for r, seq, p in zip(range(nd), seqs, starts, strict=False):  # the first nd rows
                toks = seq.token_ids
                k = len(toks)
                if p < k:
                    ids[r] = toks[p]
                else:  # sampled by the previous step, not on the host yet
                    ph_rows.append(r)
                if p + 1 != k + seq.num_pending:
                    lag.append(r)
            all_pending = len(ph_rows) == nd  # (overlapped decoding, the usual step)
            if ph_rows:
                prev = pending_index if pending_index is not None else {}
                ph_src = list(map(prev.get, seqs[:nd] if all_pending
                                  else [seqs[r] for r in ph_rows]))
                if None in ph_src:
                    seq = seqs[ph_rows[ph_src.index(None)]]
                    raise ValueError(f"{seq.request_id}: its newest token is neither on "
                                     "the host nor sampled by the previous step")
            dpos = np.array(starts if pure_decode else starts[:nd], dtype=np.int64)
            if all_pending:
                self.ids[:nd] = 0
            else:
                self.ids[:nd] = ids
            self.pos[:nd] = dpos
            rows = self._arange[:nd]
            np.add(t[rows, dpos // bs] * bs, dpos % bs, out=self.slots[:nd])
        # rows to sample: sequences whose every token (pending ones included) is computed;
        # a decode row i is token row i. `first_rows`: they are token rows 0..k-1
        first_rows = not lag
        if lag:
            skip = set(lag)
            sample_rows = [r for r in range(nd) if r not in skip]
        else:
            sample_rows = list(range(nd))
        if pure_decode:  # one token a row: lengths start + 1, query starts 0..n
            lens = dpos + 1
            self.seq_lens[:n] = lens
            seq_lens = lens.tolist()
            self.qsl[:n + 1] = self._arange[:n + 1]
        else:
            seq_lens = [p + c for p, c in zip(starts, counts, strict=True)]
        sample_seqs = list(sample_rows)
        # prefills: ranges of tokens (always known on the host: only a sequence that has
        # sampled has a pending token, and it is then a decode)
        cursor = nd
        for i in range(nd, n):
            seq, start, c = seqs[i], starts[i], counts[i]
            end = start + c
            toks = seq.token_ids
            if end > len(toks):
                raise ValueError(f"{seq.request_id}: a prefill chunk reaches a token still "
                                 "on the device")
            pos = np.arange(start, end, dtype=np.int64)
            self.ids[cursor:cursor + c] = toks[start:end]
            self.pos[cursor:cursor + c] = pos
            self.slots[cursor:cursor + c] = t[i, pos // bs] * bs + pos % bs
            cursor += c
            if end == len(toks) + seq.num_pending:
                first_rows = False  # (a prefill row has two tokens or more)
                sample_rows.append(cursor - 1)
                sample_seqs.append(i)
        if not pure_decode:
            self.seq_lens[:n] = seq_lens
            self.qsl[0] = 0
            np.cumsum(counts, out=self.qsl[1:n + 1])
        k = len(sample_rows)
        self.h_sample_rows.numpy()[:k] = self._arange[:k] if first_rows else sample_rows
        if ph_rows:
            self.h_ph_rows.numpy()[:len(ph_rows)] = (self._arange[:nd] if len(ph_rows) == nd
                                                     else ph_rows)
            self.h_ph_src.numpy()[:len(ph_src)] = ph_src
        return StepPlan(n, nd, ntok, seq_lens, list(counts), sample_rows, sample_seqs,
                        ph_rows, ph_src)

    def _fill_tables(self, seqs: list[Sequence]) -> None:
        """Block tables of the batch rows. A row's entries past its own pages are never read
        (kernels read the ceil(seq_len / block_size) pages a sequence owns), so they may hold
        stale ids. A row is written only when it holds another table than last step or the
        table grew: decode steps mostly repeat the previous batch. When sequences leave,
        the rows after them move up unchanged: such a run of rows is copied within the
        buffer in one slice, not rewritten from its lists."""
        t, cached, max_blocks = self.tables, self._row_tables, self.max_blocks
        top = len(cached)
        # the pending run of moved rows: rows [lo, hi) <- rows [lo + shift, hi + shift),
        # columns [0, width)
        lo = hi = shift = width = 0
        for i, seq in enumerate(seqs):
            tab = seq.block_table
            c = cached[i]
            size = len(tab)
            if c[0] is tab and c[1] == size:
                continue
            if size > max_blocks:
                raise ValueError(f"step needs {size} blocks for a row; buffers hold "
                                 f"{max_blocks}")
            # the table unchanged in a later row (rows are rewritten in increasing order, so
            # a later row still holds what `cached` says): the current run's shift first,
            # then the next few rows (a step loses few sequences)
            j = i + shift
            if not (shift and j < top and cached[j][0] is tab):
                j = 0
                for k in range(i + 1, min(i + _MOVE_PROBE + 1, top)):
                    if cached[k][0] is tab:
                        j = k
                        break
            if j and cached[j][1] == size:
                if hi == i and j - i == shift:
                    hi = i + 1
                    if size > width:
                        width = size
                else:
                    if hi > lo:
                        t[lo:hi, :width] = t[lo + shift:hi + shift, :width]
                    lo, hi, shift, width = i, i + 1, j - i, size
            else:
                if hi > lo:  # (its source rows may include this one)
                    t[lo:hi, :width] = t[lo + shift:hi + shift, :width]
                    lo = hi = 0
                t[i, :size] = tab
            cached[i] = (tab, size)
        if hi > lo:
            t[lo:hi, :width] = t[lo + shift:hi + shift, :width]

    def to_device(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) on the device: non-blocking copies of
        the used rows (whole block-table rows: contiguous; columns past a row's own pages are
        never read). On the CPU, views of the host buffers. Placeholder ids are still 0."""
        dev = self.device
        n, ntok = plan.num_seqs, plan.num_tokens
        cuda = dev.type == "cuda"

        def put(h: torch.Tensor) -> torch.Tensor:
            return h.to(dev, non_blocking=True) if cuda else h

        ids = put(self.h_ids[:ntok])
        pos = put(self.h_pos[:ntok])
        meta = AttentionMetadata(
            slot_mapping=put(self.h_slots[:ntok]),
            query_start_loc=put(self.h_qsl[:n + 1]),
            seq_lens=put(self.h_seq_lens[:n]),
            block_tables=put(self.h_tables[:n]),
            num_decodes=plan.num_decodes,
            max_query_len=max(plan.query_lens),
            max_seq_len=max(plan.seq_lens),
            query_lens_cpu=plan.query_lens,
            seq_lens_cpu=plan.seq_lens,
        )
        return ids, pos, meta

    def index_rows(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """The first k entries of one of the [max_seqs] int64 row buffers, on the device (on the
        CPU a copy: a step prepared ahead rewrites the buffer before this one samples)."""
        return h[:k].to(self.device, non_blocking=True) if self.device.type == "cuda" \
            else h[:k].clone()

    def mark_copied(self) -> None:
        if self.copied is not None:
            self.copied.record()


@dataclass
class PreparedForward:
    """A step whose inputs are in the host buffers, not yet copied or run
    (`ModelRunner.prepare_forward`, then `enqueue_forward`)."""

    batch: ScheduledBatch
    plan: StepPlan
    path: str
    size: int
    padding: int


@dataclass
class QueuedForward:
    """A step whose forward is queued on the device and whose sampling is not yet
    (`ModelRunner.launch_forward`, then `sample_queued`)."""

    batch: ScheduledBatch
    plan: StepPlan
    hidden: torch.Tensor
    rows: torch.Tensor | None  # the hidden rows to sample (None: the first k)
    padding: int
    # each sampled sequence's index in this step's ids, built once (`sample_index`): by a
    # step prepared ahead of this one's sampling (schedule_ahead), or by the sampling
    index: dict[Sequence, int] | None = None

    def sample_index(self) -> dict[Sequence, int]:
        if self.index is None:
            self.index = dict(zip(self.plan.sampled(self.batch.seqs),
                                  range(len(self.plan.sample_seqs)), strict=True))
        return self.index


class RunnerStep:
    """A launched step. `tokens` is the sampled ids on the device (one per sampled row);
    `result()` waits for their copy to the host (the step's one sync) and returns the
    sampled token (or None) and logprob per batch sequence."""

    def __init__(self, batch: ScheduledBatch, num_padding: int, sample_seqs: list[int] | None = None,
                 tokens: torch.Tensor | None = None, host: torch.Tensor | None = None,
                 ready: torch.cuda.Event | None = None,
                 logprobs: list[TokenLogprob | None] | None = None,
                 timing: dict[str, float] | None = None) -> None:
        """A step that samples nothing (prefill chunks only) passes the batch and its padding
        alone."""
        self.batch = batch
        self._timing = timing  # the runner's step_timing: result() adds its wait to "wait_s"
        self.sample_seqs = sample_seqs or []
        self.tokens = tokens
        self.num_padding = num_padding
        self._host = host
        self._ready = ready
        self._logprobs = logprobs
        self._output: RunnerOutput | None = None
        # the guided rows' accept results, where the engine took them before the resolve
        # (LLMEngine._accept_early): index in the output -> accepted
        self.early_accepted: dict[int, bool] | None = None

    def done(self) -> bool:
        """True when `result()` would not wait for the device."""
        return self._output is not None or self._ready is None or self._ready.query()

    def result(self) -> RunnerOutput:
        if self._output is None:
            ids: list[int] = []
            if self.sample_seqs:
                if self._ready is not None:
                    t0 = time.perf_counter()
                    self._ready.synchronize()
                    if self._timing is not None:
                        self._timing["wait_s"] += time.perf_counter() - t0
                    ids = self._host[:len(self.sample_seqs)].tolist()
                else:
                    ids = self.tokens.tolist()
            self._output = RunnerOutput(self.sample_seqs, ids, self._logprobs, self.num_padding)
            self._host = None
        return self._output


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, num_blocks: int,
                 limits: StepLimits, device: torch.device, dtype: torch.dtype,
                 sampler: Sampler, cpu_plan: CpuPlan | None = None) -> None:
        """A KV pool of `num_blocks` blocks of `layout` (its dtype: the model's, or FP8,
        kernels/quant.py); `limits`: the largest step and the longest sequence; dtype: the
        model's; `cpu_plan`: how a CPU model runs (kernels/cpu_plan.py; None: the default
        plan); the plan as applied (GEMM measured) is self.cpu_plan."""
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size = layout.block_size
        self.num_blocks = num_blocks
        self.sampler = sampler
        self.kv_cache = layout.pool(num_blocks, device)
        model.bind_kv_cache(self.kv_cache)
        self.cpu_plan: CpuPlan | None = None
        if device.type == "cpu":
            self.cpu_plan = model.use_cpu_plan(cpu_plan or resolve_cpu_plan())
            log.info("%s", self.cpu_plan.describe())
        log.info("KV pool: %d blocks of %d tokens, %.2f GiB", num_blocks, block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)
        self.max_blocks = -(-limits.max_model_len // block_size)
        self.max_model_len = limits.max_model_len
        self.inputs = StepInputs(max(limits.max_num_tokens, limits.max_num_seqs),
                                 limits.max_num_seqs, self.max_blocks, block_size, device)
        self.graphs = None  # kernels.cuda_graphs.DecodeGraphs when captured
        # prefill / mixed steps: kernels.cuda_graphs.MixedGraphs or PiecewiseGraphs when captured
        self.piecewise = None
        self._h_counts: torch.Tensor | None = None  # pinned: a mixed graph's decode count + tiles
        self._counts_np: np.ndarray | None = None
        # host seconds per phase of launch(); wait_s: waiting for the device in result()
        self.step_timing: dict[str, float] = {"prepare_s": 0.0, "forward_s": 0.0, "sample_s": 0.0,
                                              "wait_s": 0.0}
        self.num_graph_steps = 0  # steps that replayed a captured decode graph
        self.num_piecewise_steps = 0  # prefill / mixed steps replayed from graphs (either kind)
        # steps a captured piecewise size could have held that the cost model ran eagerly
        self.num_cost_eager_steps = 0
        self.num_placeholder_tokens = 0  # input ids read from the previous step on the device
        # the last launched step's sampled ids (device) and, per sequence, its index there
        self._last_tokens: torch.Tensor | None = None
        self._last_index: dict[Sequence, int] = {}
        # two pinned host buffers for the sampled ids (a step's copy must not overwrite the
        # previous step's ids before they are read) and their copy-done events
        self._host_tokens: list[torch.Tensor] = []
        self._token_events: list[torch.cuda.Event] = []
        if device.type == "cuda":
            self._host_tokens = [torch.zeros(limits.max_num_seqs, dtype=torch.int64, pin_memory=True)
                                 for _ in range(2)]
            self._token_events = [torch.cuda.Event(), torch.cuda.Event()]
        self._parity = 0

    # ---- CUDA set-up ---------------------------------------------------------------------

    def setup_cuda(self, decode_batch_sizes: list[int], use_cuda_graphs: bool = True,
                   piecewise_sizes: list[int] | None = None,
                   piecewise_choice: str = "cost", mixed_graphs: str = "full",
                   gemv: str = "auto", max_step_tokens: int | None = None) -> dict:
        """Compiles the attention kernels' variants, captures the decode graphs (largest
        first, one pool) and, with `piecewise_sizes` (token counts), the graphs of prefill
        and mixed steps: `mixed_graphs` "full", one graph per token count with attention
        inside (MixedGraphs), or "piecewise", graphs of everything but attention
        (PiecewiseGraphs). `piecewise_choice` "cost" then measures the graphs against
        eager runs at each size (measure_costs) so that each step takes the cheaper; "pad"
        always replays the next captured size. `gemv` ("auto", "on", "off"): one-row
        projections by the Triton GEMV where it measures faster than cuBLAS (use_gemv of
        the model, before any capture; FP8 projections of more rows are timed up to
        `max_step_tokens`, the most a step holds). Returns {"graphs": n, "capture_s": s,
        "graph_pool_mib": m, "kernel_warmup_s": s, "mixed_graphs": mode,
        "piecewise_graphs": n, "piecewise_capture_s": s, "piecewise_pool_mib": m,
        "cost_model_s": s, "piecewise_eager_from": n, "gemv": {shape: choice}} for the
        start-up log."""
        if self.device.type != "cuda":
            raise ValueError("setup_cuda needs a CUDA device")
        sizes = sorted({b for b in decode_batch_sizes if b >= 1})
        info: dict = {"graphs": 0, "capture_s": 0.0, "graph_pool_mib": 0.0}
        if hasattr(self.model, "use_gemv"):
            t0 = time.perf_counter()
            info["gemv"] = self.model.use_gemv(gemv, max_rows=max_step_tokens)
            info["gemv_s"] = time.perf_counter() - t0
        backend = getattr(self.model, "attn_backend", None)
        if hasattr(backend, "warm_up"):  # compile kernel variants now, not mid-run
            t0 = time.perf_counter()
            cfg = self.model.config
            backend.warm_up(self.kv_cache[0, 0], self.kv_cache[0, 1], cfg.num_heads,
                            self.max_blocks, q_dtype=self.dtype)
            info["kernel_warmup_s"] = time.perf_counter() - t0
        if use_cuda_graphs and sizes and not getattr(backend, "graph_capturable", False):
            log.warning("attention backend %r cannot be captured in a CUDA graph (it syncs "
                        "with the host); decode steps run eagerly",
                        getattr(backend, "name", type(backend).__name__))
        elif use_cuda_graphs and sizes:
            from bucketserve.kernels.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, sizes, self.max_blocks, self.max_model_len,
                                       self.device)
            stats = self.graphs.capture()
            info.update(graphs=stats.num_graphs, capture_s=stats.seconds,
                        graph_pool_mib=stats.pool_bytes / 2**20)
            if piecewise_sizes and getattr(self.model, "fused_ops", False) \
                    and hasattr(self.model, "stage_first"):
                from bucketserve.kernels.cuda_graphs import MixedGraphs, PiecewiseGraphs

                if mixed_graphs == "full":
                    self.use_mixed_graphs(MixedGraphs(self.model, piecewise_sizes,
                                                      self.inputs.max_seqs, self.max_blocks,
                                                      self.device))
                else:
                    self.piecewise = PiecewiseGraphs(self.model, piecewise_sizes, self.device)
                info["mixed_graphs"] = mixed_graphs
                stats = self.piecewise.capture()
                info.update(piecewise_graphs=stats.num_graphs, piecewise_capture_s=stats.seconds,
                            piecewise_pool_mib=stats.pool_bytes / 2**20)
                if piecewise_choice == "cost":
                    t0 = time.perf_counter()
                    cost = self.piecewise.measure_costs()
                    info.update(cost_model_s=time.perf_counter() - t0,
                                piecewise_eager_from=cost.eager_from())
        return info

    def use_mixed_graphs(self, graphs) -> None:
        """Prefill and mixed steps through `graphs` (a kernels.cuda_graphs.MixedGraphs; its
        capture() is the caller's), with a host buffer for their counts."""
        self.piecewise = graphs
        self._h_counts = torch.zeros(1 + graphs.max_tiles, dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        self._counts_np = self._h_counts.numpy()

    # ---- one step ------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """One step, synchronously: launch() and its result()."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch,
               before_sample: Callable[[], None] | None = None) -> RunnerStep:
        """Builds the inputs, queues the forward and the sampling on the device and returns
        without waiting for them. `before_sample` runs on the host once the forward is queued
        and before the sampling is: the engine resolves the previous step there when this
        step's sampling reads its tokens (a grammar's mask, penalties), while the device
        computes this step's forward."""
        return self.sample_queued(self.launch_forward(batch), before_sample)

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch) -> QueuedForward:
        """`launch`'s first half: the inputs and the forward, queued on the device; the
        sampling waits for `sample_queued`. Nothing else may be launched in between."""
        return self.enqueue_forward(self.prepare_forward(batch))

    def prepare_forward(self, batch: ScheduledBatch,
                        after: QueuedForward | None = None) -> PreparedForward:
        """`launch_forward`'s host part: the step's inputs in the host buffers and its path.
        `after`: the queued forward whose sampling comes first (not yet launched): this
        step's placeholders take that one's tokens (else those of the last sampling). Until
        `enqueue_forward` takes it, no other step may be prepared or launched, except the
        sampling of `after`."""
        t0 = time.perf_counter()
        # (`after`'s index is what its sampling will set as the last one)
        index = self._last_index if after is None else after.sample_index()
        plan = self.inputs.fill(batch, index)
        path, size, padding = self._choose_forward(plan)
        self.step_timing["prepare_s"] += time.perf_counter() - t0
        return PreparedForward(batch, plan, path, size, padding)

    @torch.inference_mode()
    def enqueue_forward(self, prepared: PreparedForward) -> QueuedForward:
        """`launch_forward`'s device part: the prepared inputs copied and the forward queued."""
        t0 = time.perf_counter()
        inp = self.inputs
        batch, plan, path = prepared.batch, prepared.plan, prepared.path
        size, padding = prepared.size, prepared.padding
        if path == "mixed_graph":  # inputs straight into the graph's static buffers
            ids = self._load_mixed_graph(size, plan)
            pos = meta = None
        elif path == "decode_graph":  # likewise
            n = plan.num_seqs
            ids = self.graphs.load(n, inp.h_ids, inp.h_pos, inp.h_slots, inp.h_seq_lens,
                                   inp.h_tables)
            pos = meta = None
        else:
            ids, pos, meta = inp.to_device(plan)
        if plan.placeholder_rows:
            self._gather_placeholders(plan, ids)
            self.num_placeholder_tokens += len(plan.placeholder_rows)
        k = len(plan.sample_rows)
        rows = inp.index_rows(inp.h_sample_rows, k) if k and plan.sample_rows[-1] != k - 1 else None
        inp.mark_copied()
        t1 = time.perf_counter()
        if path == "decode_graph":
            self.num_graph_steps += 1
            hidden = self.graphs.replay(plan.num_seqs)
        elif path == "mixed_graph":
            self.num_piecewise_steps += 1
            hidden = self.piecewise.run(size, plan.num_tokens)
        elif path == "piecewise":
            hidden = self._forward_piecewise(size, ids, pos, meta)
        else:
            hidden = self._forward_eager(ids, pos, meta)
        st = self.step_timing
        st["prepare_s"] += t1 - t0
        st["forward_s"] += time.perf_counter() - t1
        return QueuedForward(batch, plan, hidden, rows, padding)

    @torch.inference_mode()
    def sample_queued(self, queued: QueuedForward,
                      before_sample: Callable[[], None] | None = None,
                      pending_offset: int = 0) -> RunnerStep:
        """`launch`'s second half: runs `before_sample` on the host, then queues the sampling
        of the forward `launch_forward` queued (`pending_offset`: Sampler.sample's)."""
        if before_sample is not None:
            before_sample()
        t3 = time.perf_counter()
        step = self._sample(queued.batch, queued.plan, queued.hidden, queued.rows,
                            queued.padding, pending_offset, queued.index)
        self.step_timing["sample_s"] += time.perf_counter() - t3
        return step

    def _gather_placeholders(self, plan: StepPlan, ids: torch.Tensor) -> None:
        """ids[row] = previous step's sampled id, for each placeholder row (on the device)."""
        src = self._last_tokens
        rows, srcs = plan.placeholder_rows, plan.placeholder_src
        m = len(rows)
        if rows[-1] == m - 1 and srcs[-1] == m - 1 and srcs == rows:
            ids[:m].copy_(src[:m])  # the usual decode step: the same sequences, in order
        else:
            inp = self.inputs
            r = inp.index_rows(inp.h_ph_rows, m)
            s = inp.index_rows(inp.h_ph_src, m)
            ids.index_copy_(0, r, src.index_select(0, s))

    # -- the forwards: decode graph, mixed-step graph, piecewise graphs, eager -------------

    def _choose_forward(self, plan: StepPlan) -> tuple[str, int, int]:
        """(path, captured size, padding rows) of a step: "decode_graph" (size: the padded
        batch), "mixed_graph" / "piecewise" (size: the padded token count; self.piecewise is
        a MixedGraphs or a PiecewiseGraphs), or "eager" (size and padding 0)."""
        g = self.graphs
        if g is not None and plan.is_decode:
            bs = g.padded_size(plan.num_seqs)
            if bs is not None:
                return "decode_graph", bs, bs - plan.num_seqs
        pw = self.piecewise
        if pw is not None:
            t = pw.choose(plan.num_tokens)
            if t is not None:
                path = "mixed_graph" if pw.attention_in_graph else "piecewise"
                return path, t, t - plan.num_tokens
            if pw.padded_size(plan.num_tokens) is not None:
                self.num_cost_eager_steps += 1
        return "eager", 0, 0

    def _load_mixed_graph(self, t: int, plan: StepPlan) -> torch.Tensor:
        """The step's host buffers -> the static inputs of the mixed-step graph of size t
        (padding rows' slots -1, the decode count and the prefill tiles); returns the
        graph's input ids of the real rows (placeholders are gathered into them)."""
        inp, mg = self.inputs, self.piecewise
        ntok = plan.num_tokens
        inp.slots[ntok:t] = -1  # padding rows write no K/V
        counts = self._counts_np
        counts[0] = plan.num_decodes
        prefill_tiles(plan.query_lens, plan.num_decodes, counts[1:1 + mg.num_tiles(t)])
        n = plan.num_seqs
        mg.load(t, n, inp.h_ids, inp.h_pos, inp.h_slots, inp.h_qsl, inp.h_seq_lens,
                inp.h_tables[:n], self._h_counts)
        return mg.input_ids[:ntok]

    def _forward_piecewise(self, t: int, ids: torch.Tensor, pos: torch.Tensor,
                           meta: AttentionMetadata) -> torch.Tensor:
        pw = self.piecewise
        n = ids.shape[0]
        # rows n..t-1 keep ids and positions of earlier steps: stale but valid
        pw.input_ids[:n].copy_(ids)
        pw.positions[:n].copy_(pos)
        self.num_piecewise_steps += 1
        with forward_context(meta):
            return pw.run(t, n)

    def _forward_eager(self, ids: torch.Tensor, pos: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        with forward_context(meta):
            return self.model(ids, pos)

    # -- the sampling tail ------------------------------------------------------------------

    def _sample(self, batch: ScheduledBatch, plan: StepPlan, hidden: torch.Tensor,
                rows: torch.Tensor | None, padding: int, pending_offset: int = 0,
                index: dict[Sequence, int] | None = None) -> RunnerStep:
        """Queues the sampling of a forward's hidden rows. `index`: the sampled sequences'
        index in the ids where a step prepared ahead built it already (else built here)."""
        k = len(plan.sample_seqs)
        if not k:
            self._last_tokens, self._last_index = None, {}
            return RunnerStep(batch, padding)
        h = hidden[:k] if rows is None else hidden.index_select(0, rows)
        logits = self.model.compute_logits(h, widen=False)  # (the sampler widens if needed)
        sampled_seqs = plan.sampled(batch.seqs)
        tokens, logprobs = self.sampler.sample(logits, sampled_seqs, pending_offset,
                                               inplace=True)
        host = ready = None
        if self._token_events:  # CUDA: start the copy to the host now, wait for it later
            p = self._parity
            self._parity = 1 - p
            host, ready = self._host_tokens[p], self._token_events[p]
            host[:k].copy_(tokens, non_blocking=True)
            ready.record()
        self._last_tokens = tokens
        self._last_index = index if index is not None else dict(
            zip(sampled_seqs, range(k), strict=True))
        return RunnerStep(batch, padding, plan.sample_seqs, tokens, host, ready, logprobs,
                          self.step_timing)
