"""How many KV blocks the pool gets on a GPU: a warm-up forward at the largest step, then
what is left of this process's share, `gpu_memory_fraction` of the device, capped at what
is free (see gpu_kv_budget_blocks and kv_budget_blocks)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from bucketserve.kernels.attention import AttentionMetadata, forward_context

log = logging.getLogger(__name__)

GIB = 2**30
# This process's device memory outside torch's allocator (CUDA context, cuBLAS / Triton
# modules) when NVML cannot say: the usual size of a CUDA 12 context with torch's libraries.
CONTEXT_ESTIMATE_BYTES = GIB


@dataclass(frozen=True)
class KVLayout:
    """The KV pool's shape, [layers, k/v, blocks, block_size, kv_heads, head_dim], and its
    element type (the model's dtype, or float8_e4m3fn for an FP8 pool: kernels/quant.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def pool(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool of `num_blocks` blocks."""
        return torch.zeros(self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads,
                           self.head_dim, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class StepLimits:
    """The most sequences and tokens one step can hold (the scheduler's limits) and the
    longest sequence (the block-table width)."""

    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class GpuMemory:
    """Device memory readings in bytes, after the warm-up: `total` and `free`
    (cudaMemGetInfo: free of every process), `reserved` (torch's allocator, this process),
    `own_outside` (this process outside the allocator: its CUDA context) and `peak` (the
    warm-up's allocator peak: weights + activations + logits)."""

    total: int
    free: int
    reserved: int
    own_outside: int
    peak: int


def kv_budget_blocks(mem: GpuMemory, fraction: float, bytes_per_block: int, min_blocks: int,
                     reserve_bytes: int, graph_act: int = 0,
                     frontend_bytes: int = 0) -> tuple[int, dict]:
    """KV blocks for this server: `fraction` of the device is the server's whole share
    (as vLLM's gpu_memory_utilization), so the pool gets the share less what this process
    already holds (own_outside + peak), what its own front ends hold on the device
    (`frontend_bytes`: their embedding / rerank encoders, measured after they loaded) and
    what it keeps back (reserve_bytes, graph_act), capped at the device's free memory less
    the same keep-back (other processes on the GPU are not counted against the share; what
    they hold, the front ends' encoders included, is not free). Raises ValueError when the
    pool would hold fewer than `min_blocks`. Returns (blocks, details for the log)."""
    share = (fraction * mem.total - mem.own_outside - mem.peak - frontend_bytes - reserve_bytes
             - graph_act)
    available = mem.free - reserve_bytes - graph_act
    budget = min(share, available)
    blocks = int(max(0, budget) // bytes_per_block)
    info = {"total_gib": mem.total / GIB, "peak_torch_gib": mem.peak / GIB,
            "own_outside_torch_gib": mem.own_outside / GIB, "free_gib": mem.free / GIB,
            "share_gib": share / GIB, "kv_budget_gib": budget / GIB,
            "graph_activations_gib": graph_act / GIB, "frontend_gib": frontend_bytes / GIB,
            "bound": "fraction"
            if share <= available else "free memory"}
    if blocks < min_blocks:
        need = (min_blocks * bytes_per_block + reserve_bytes + graph_act) / GIB
        if share <= available:
            raise ValueError(
                f"the KV pool needs at least {min_blocks} blocks (one sequence as long as the "
                f"largest step) but gpu_memory_fraction {fraction:g} of {mem.total / GIB:.1f}"
                f" GiB leaves {max(0.0, share) / GIB:.2f} GiB after this process's weights and "
                f"activations ({mem.peak / GIB:.2f} GiB), CUDA context "
                f"({mem.own_outside / GIB:.2f} GiB) and front-end encoders "
                f"({frontend_bytes / GIB:.2f} GiB); raise [kv_cache] gpu_memory_fraction")
        raise ValueError(
            f"the KV pool needs at least {min_blocks} blocks (one sequence as long as the "
            f"largest step; {need:.2f} GiB with what start-up keeps back) but only "
            f"{mem.free / GIB:.2f} GiB of the GPU is free (other processes on it hold "
            f"{(mem.total - mem.free - mem.reserved - mem.own_outside) / GIB:.2f} GiB); "
            f"free GPU memory or lower their share")
    return blocks, info


def own_memory_outside_torch(device: torch.device) -> tuple[int, str]:
    """(bytes, how known) this process holds on `device` outside torch's allocator: NVML's
    per-process use less torch's reserved memory when pynvml is importable and NVML lists
    this pid on the device (not in a separate PID namespace), else CONTEXT_ESTIMATE_BYTES."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    used = proc.usedGpuMemory - torch.cuda.memory_reserved(device)
                    return max(0, used), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no pynvml / NVML: the estimate
        log.debug("NVML per-process memory not available: %s", exc)
    return CONTEXT_ESTIMATE_BYTES, "estimate"


def gpu_kv_budget_blocks(model: torch.nn.Module, layout: KVLayout, limits: StepLimits,
                         memory_fraction: float, device: torch.device,
                         reserve_bytes: int = 256 * 2**20,
                         reserve_graph_activations: bool = False,
                         frontend_bytes: int = 0) -> tuple[int, dict]:
    """KV blocks of `layout` that fit in this process's `memory_fraction` of the GPU after a
    warm-up forward (kv_budget_blocks does the arithmetic).

    The warm-up runs the largest step the scheduler can issue (max_num_tokens prompt
    tokens in sequences of at most max_model_len) plus the logits of max_num_seqs rows, over
    a small temporary pool, and reads the allocator's peak: weights + activations +
    logits. This process's memory outside torch's allocator (its CUDA context:
    own_memory_outside_torch) counts against its share; other processes' memory does not,
    but it is not free either (the pool never takes more than is free).
    `reserve_bytes` is kept back for the decode graphs' pool and the sampler.
    `reserve_graph_activations` (piecewise CUDA graphs on) keeps back the warm-up's
    activations once more (its peak less the model's parameters and buffers): the graphs'
    private pool holds a stage's activations at the largest step, apart from the memory
    that eager steps reuse. The pool must hold at least one sequence as long as the largest
    step (min(max_num_tokens, max_model_len) tokens), else ValueError. `frontend_bytes`:
    what the server's front-end processes hold on this device (wait_frontend_reports),
    counted against the share. Returns (blocks, details for the log)."""
    block_size, max_model_len = layout.block_size, limits.max_model_len
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    # the largest step: max_num_tokens prompt tokens, in sequences of <= max_model_len
    t = max(1, limits.max_num_tokens)
    lens = [min(max_model_len, t - i) for i in range(0, t, max_model_len)]
    per_seq = -(-max(lens) // block_size)
    nblk = 1 + per_seq * len(lens)  # block 0 stays the dummy
    pool = layout.pool(nblk, device)
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
        rows = hidden[torch.arange(limits.max_num_seqs, device=device) % t]
        logits = model.compute_logits(rows)
        torch.argmax(logits, dim=-1).tolist()
    del hidden, rows, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - pool_bytes
    del pool  # (still bound to the model until the real pool replaces it: small)
    # no empty_cache(): the activation blocks stay cached for the first large steps (a
    # cudaMalloc there would stall the step); `reserved` below counts them
    free, total = torch.cuda.mem_get_info(device)
    own_outside, source = own_memory_outside_torch(device)
    graph_act = 0
    if reserve_graph_activations:
        tensors = [*model.parameters(), *model.buffers()]
        graph_act = max(0, peak - sum(x.numel() * x.element_size() for x in tensors))
    mem = GpuMemory(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                    own_outside=own_outside, peak=peak)
    blocks, info = kv_budget_blocks(mem, memory_fraction, layout.bytes_per_block(),
                                    min_blocks=1 + per_seq,
                                    reserve_bytes=reserve_bytes, graph_act=graph_act,
                                    frontend_bytes=frontend_bytes)
    info.update(warmup_tokens=t, own_outside_source=source)
    log.info("GPU memory: total %.1f GiB, free %.1f GiB, warm-up peak %.2f GiB, this process "
             "outside torch %.2f GiB (%s), front-end encoders %.2f GiB, kept for piecewise "
             "graphs %.2f GiB, KV budget %.2f GiB (fraction %.2f of the device for this "
             "server; bound: %s) -> %d blocks",
             info["total_gib"], info["free_gib"], info["peak_torch_gib"],
             info["own_outside_torch_gib"], source, info["frontend_gib"],
             info["graph_activations_gib"], info["kv_budget_gib"], memory_fraction,
             info["bound"], blocks)
    return blocks, info


# ---- front ends that hold device memory ------------------------------------------------
# With an embedding or rerank model on a GPU, every front-end process (--api-workers N)
# loads its own encoder and CUDA context (~0.8 GiB each for MiniLM, most of it the context).
# They load before the core sizes its KV pool and report what they hold; the core counts
# it against gpu_memory_fraction (the server's share), so N encoders fit on an 80 GB card
# where the pool once took 90% and the last workers' encoders ran out of memory.

FRONTEND_REPORT_TIMEOUT_S = 900.0


def process_gpu_bytes(device: torch.device | str = "cuda") -> int:
    """What this process holds on `device`: torch's reserved memory plus what it holds
    outside torch (own_memory_outside_torch: NVML, or the context estimate)."""
    device = torch.device(device)
    outside, _ = own_memory_outside_torch(device)
    return torch.cuda.memory_reserved(device) + outside


def write_frontend_report(directory: str, index: int, nbytes: int) -> None:
    """Front end `index` holds `nbytes` on the device (atomic: the core never reads half)."""
    path = os.path.join(directory, f"frontend-gpu-{index}")
    with open(path + ".tmp", "w") as f:
        f.write(str(int(nbytes)))
    os.replace(path + ".tmp", path)


def wait_frontend_reports(directory: str, count: int,
                          timeout_s: float = FRONTEND_REPORT_TIMEOUT_S,
                          poll_s: float = 0.05) -> int:
    """The sum of `count` front ends' reports in `directory` (write_frontend_report), once
    all are there. TimeoutError after `timeout_s`, or at once when this process's parent
    (the supervisor) is gone."""
    import time

    parent = os.getppid()
    deadline = time.monotonic() + timeout_s
    paths = [os.path.join(directory, f"frontend-gpu-{k}") for k in range(count)]
    while True:
        if all(os.path.exists(p) for p in paths):
            total = 0
            for p in paths:
                with open(p) as f:
                    total += int(f.read())
            return total
        if os.getppid() != parent:
            raise TimeoutError("the supervisor is gone before the front ends loaded")
        if time.monotonic() > deadline:
            missing = [k for k, p in enumerate(paths) if not os.path.exists(p)]
            raise TimeoutError(f"front ends {missing} did not report their GPU memory within "
                               f"{timeout_s:.0f} s")
        time.sleep(poll_s)
