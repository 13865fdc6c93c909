"""Model runner: turns a ScheduledBatch into tensors, runs the model, samples.

It owns the KV pool (one preallocated tensor) and never changes scheduling state: it
reads the sequences of a batch and returns one sampled token (or None) per sequence.
"""

from __future__ import annotations

import logging
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


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


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
        log.info("KV pool: %d blocks of %d tokens, %.2f GiB", num_blocks, block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
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

