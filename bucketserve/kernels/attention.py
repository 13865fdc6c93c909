"""Paged attention: the one interface that model code calls.

A step's tokens are flattened into one batch of T tokens, grouped by sequence, decodes
first and then prefills (chunks of prompts, or whole prompts):

    tokens:   | d0 | d1 | d2 |  p0 p0 p0 p0 p0  |  p1 p1 p1  |
    seq:        0    1    2          3                4
    query_start_loc = [0, 1, 2, 3, 8, 11]        (B+1 entries)
    seq_lens        = context length of each sequence after this step, cached tokens
                      included (a decode's query is its last position)

Each token's K/V is written to the pool at `slot_mapping[t]` (block * block_size + offset)
before attention reads the context back through the block tables. Queries attend
causally: query i of sequence s (at position seq_lens[s] - q_len + i) sees positions
0 .. seq_lens[s] - q_len + i.

KV pool of one layer: k_cache, v_cache, each [num_blocks, block_size, num_kv_heads, head_dim].
Block 0 is reserved as the dummy block: padded slots write there and nothing reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from bucketserve.kernels import cpu_decode

# Query rows per program of the prefill kernel (kernels/triton_attention.py), and so the unit
# of the prefill tiles below.
PREFILL_BLOCK_M = 64
# A prefill tile of a fixed-grid launch packed in one int32: sequence << TILE_SHIFT | query
# tile (the Triton prefill kernel unpacks it).
TILE_SHIFT = 16


@dataclass
class FixedGrid:
    """Attention launch grids that depend only on a step's capacity, with the step's own
    counts on the device: what a CUDA graph of a whole prefill or mixed step replays
    (kernels/cuda_graphs.MixedGraphs). Only the Triton backend reads it.

    The decode grid has `max_decodes` rows, of which rows below num_decodes[0] run; the
    prefill grid has one program per entry of `tiles` (prefill_tiles: sequence << TILE_SHIFT |
    query tile, -1 for none)."""

    num_decodes: torch.Tensor  # int32 [1], on the device
    max_decodes: int
    tiles: torch.Tensor  # int32 [max_prefill_tiles(T, max_seqs)], on the device


def max_prefill_tiles(num_tokens: int, max_seqs: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Most prefill tiles a step of num_tokens query rows over at most max_seqs sequences
    needs: sum over sequences of ceil(q_i / block_m) < num_tokens / block_m + sequences, and
    each sequence holds at least one row."""
    return -(-num_tokens // block_m) + min(num_tokens, max_seqs)


def prefill_tiles(query_lens: list[int], first_seq: int, out: np.ndarray,
                  block_m: int = PREFILL_BLOCK_M) -> int:
    """Writes the prefill tiles of sequences first_seq.. (query lengths query_lens[first_seq:])
    into out (int32): sequence << TILE_SHIFT | query tile, in sequence order, then -1 to the end of
    out. Returns the number of tiles."""
    if len(query_lens) > 1 << (31 - TILE_SHIFT):
        raise ValueError(f"{len(query_lens)} sequences: a prefill tile names at most "
                         f"{1 << (31 - TILE_SHIFT)}")
    k = 0
    for i in range(first_seq, len(query_lens)):
        nb = -(-query_lens[i] // block_m)
        if k + nb > len(out):
            raise ValueError(f"the prefill needs more than {len(out)} tiles")
        base = i << TILE_SHIFT
        if nb == 1:
            out[k] = base
        else:
            out[k:k + nb] = np.arange(base, base + nb, dtype=np.int32)
        k += nb
    out[k:] = -1
    return k


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    num_decodes: int  # sequences 0..num_decodes-1 have query length 1
    max_query_len: int
    max_seq_len: int
    # host copies, so the CPU path never syncs
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # set in a captured prefill / mixed step: grids from its capacity, counts on the device
    fixed: FixedGrid | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Makes `meta` visible to every attention layer for one forward pass."""
    global _current
    prev, _current = _current, meta
    try:
        yield
    finally:
        _current = prev


def get_forward_context() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside forward_context()")
    return _current


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> pool slots. Reference (torch) version."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence: [length, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache.index_select(0, block_table[:nblocks]).flatten(0, 1)[:length]


def _length_groups(lens: list[int], slack: float = 1.25) -> list[list[int]]:
    """Decode rows sorted by context length and cut into groups whose longest context is at
    most `slack` times their shortest (plus one), so padding inside a group stays small."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] <= slack * lens[groups[-1][0]] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """q, out: [nd, Hq, D]. Rows of similar context length share one SDPA call.

    Grouped-query heads need no copy of K/V: query head h belongs to kv head h // G, so q is
    viewed as [n, Hkv, G, D], the G heads of a group playing the part of query positions.
    """
    nd, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    lens = meta.seq_lens_cpu[:nd]
    for rows in _length_groups(lens):
        n = len(rows)
        idx = torch.tensor(rows, device=q.device)
        max_len = lens[rows[-1]]
        nblocks = (max_len + bs - 1) // bs
        blocks = meta.block_tables[idx, :nblocks].flatten()
        # index_select copies whole blocks (several times faster than advanced indexing):
        # [n * nblocks, bs, Hkv, D] -> [n, Hkv, L, D]
        k = k_cache.index_select(0, blocks).view(n, nblocks * bs, hkv, d)[:, :max_len]
        v = v_cache.index_select(0, blocks).view(n, nblocks * bs, hkv, d)[:, :max_len]
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        mask = None
        if lens[rows[0]] != max_len:
            lens_t = torch.tensor([lens[r] for r in rows], device=q.device)
            mask = (torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None])[:, None, None, :]
        qg = q[idx].view(n, hkv, hq // hkv, d)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        out[idx] = o.reshape(n, hq, d)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """The prefill sequences (num_decodes onwards), one causal SDPA call each."""
    group = q.shape[1] // k_cache.shape[2]
    start = meta.num_decodes
    for s in range(meta.num_decodes, meta.num_seqs):
        qlen, klen = meta.query_lens_cpu[s], meta.seq_lens_cpu[s]
        table = meta.block_tables[s]
        k, v = _gather_context(k_cache, table, klen), _gather_context(v_cache, table, klen)
        # 4-d [1, H, L, D] inputs take the CPU flash kernel; 3-d ones fall back to plain math.
        # Grouped-query heads go in as they are (enable_gqa): on the CPU this measured 3-4x
        # faster than repeating K/V per query head (same result), and copies nothing.
        k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        qs = q[start:start + qlen].transpose(0, 1)[None]  # [1, Hq, qlen, D]
        if qlen == klen:
            o = F.scaled_dot_product_attention(qs, k[None], v[None], is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        else:
            # chunk of a longer context: query i sits at position klen - qlen + i
            qpos = torch.arange(klen - qlen, klen, device=q.device)
            mask = torch.arange(klen, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs, k[None], v[None], attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)
        out[start:start + qlen] = o[0].transpose(0, 1)
        start += qlen


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Torch reference over the pool (K/V already written). q: [T, Hq, D] -> [T, Hq, D]."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        _decode_attention(q[:nd], k_cache, v_cache, meta, scale, out[:nd])
    _prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def c_prefill_default() -> bool:
    """Whether prompt attention takes the C kernel without a CPU plan's choice: where the
    kernels are built for AVX-512 (the rule of kernels/cpu_plan.resolve_cpu_plan's "auto")."""
    return cpu_decode.build_info().get("isa") == "avx512f"


class AttentionBackend:
    """Writes the new K/V into the pool, then attends over it. Subclassed by the Triton
    backend on CUDA (bucketserve.kernels.triton_attention), selected by the runner."""

    name = "torch"
    # float32 CPU prompt chunks through the C kernel (cpu_decode.paged_prefill) or SDPA: set
    # from the CPU plan's prefill_attention (LlamaForCausalLM.use_cpu_plan); None:
    # c_prefill_default()
    c_prefill: bool | None = None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        if not cpu_decode.supports(q, k_cache):
            return reference_attention(q, k_cache, v_cache, meta, scale)
        # float32 on the CPU: the C kernels, which read the pool in place
        out = torch.empty(q.shape, dtype=q.dtype)
        if nd:
            cpu_decode.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    scale, out[:nd])
        if nd < meta.num_seqs:
            use_c = self.c_prefill if self.c_prefill is not None else c_prefill_default()
            if use_c and cpu_decode.prefill_supported(q, k_cache):
                cpu_decode.paged_prefill(q, k_cache, v_cache, meta.block_tables[nd:meta.num_seqs],
                                         meta.query_lens_cpu[nd:], meta.seq_lens_cpu[nd:], nd,
                                         scale, out)
            else:
                _prefill_attention(q, k_cache, v_cache, meta, scale, out)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float,
                kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
        """kv_scales (an FP8 pool's k and v scales: stored = value / scale) need a backend
        that reads FP8 pools (the Triton one); this one refuses them."""
        if kv_scales is not None:
            raise ValueError(f"the {self.name} attention backend has no FP8 KV cache; it "
                             "needs the Triton backend (CUDA)")
        meta = get_forward_context()
        self.write_kv(k, v, k_cache, v_cache, meta)
        return self.attend(q, k_cache, v_cache, meta, scale)
