"""How many KV blocks the pool gets on a GPU: a warm-up forward at the largest step, then
what is left of `gpu_memory_fraction` of the device (see gpu_kv_budget_blocks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from bucketserve.kernels.attention import AttentionMetadata, forward_context

log = logging.getLogger(__name__)


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


def gpu_kv_budget_blocks(model: torch.nn.Module, layout: KVLayout, limits: StepLimits,
                         memory_fraction: float, device: torch.device,
                         reserve_bytes: int = 256 * 2**20,
                         reserve_graph_activations: bool = False) -> tuple[int, dict]:
    """KV blocks of `layout` that fit in `memory_fraction` of the GPU after a warm-up forward.

    The warm-up runs the largest step the scheduler can issue (max_num_tokens prompt
    tokens in sequences of at most max_model_len) plus the logits of max_num_seqs rows, over
    a small temporary pool, and reads the allocator's peak: weights + activations +
    logits. Memory outside torch's allocator (CUDA context, other processes) is counted
    as used. `reserve_bytes` is kept back for the decode graphs' pool and the sampler.
    `reserve_graph_activations` (piecewise CUDA graphs on) keeps back the warm-up's
    activations once more (its peak less the model's parameters and buffers): the graphs'
    private pool holds a stage's activations at the largest step, apart from the memory
    that eager steps reuse. Returns (blocks, details for the log)."""
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
    outside = total - free - torch.cuda.memory_reserved(device)  # context, other processes
    graph_act = 0
    if reserve_graph_activations:
        tensors = [*model.parameters(), *model.buffers()]
        graph_act = max(0, peak - sum(x.numel() * x.element_size() for x in tensors))
    budget = memory_fraction * total - outside - peak - reserve_bytes - graph_act
    blocks = max(2, int(budget // layout.bytes_per_block()))
    info = {"total_gib": total / 2**30, "peak_torch_gib": peak / 2**30,
            "outside_torch_gib": outside / 2**30, "kv_budget_gib": budget / 2**30,
            "graph_activations_gib": graph_act / 2**30, "warmup_tokens": t}
    log.info("GPU memory: total %.1f GiB, warm-up peak %.2f GiB, outside torch %.2f GiB, "
             "kept for piecewise graphs %.2f GiB, KV budget %.2f GiB (fraction %.2f) -> %d "
             "blocks", info["total_gib"], info["peak_torch_gib"], info["outside_torch_gib"],
             info["graph_activations_gib"], info["kv_budget_gib"], memory_fraction, blocks)
    return blocks, info
