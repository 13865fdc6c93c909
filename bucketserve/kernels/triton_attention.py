"""Triton paged attention for CUDA: K/V write, decode (GQA, split-K) and varlen prefill.

Imported only for CUDA devices (models.loader.get_backend); never on CPU.

Pool of one layer: k_cache, v_cache [num_blocks, page, Hkv, D]; a token at position n of
sequence s lives in page block_tables[s, n // page], slot n % page. The kernels gather K/V
tiles of BLOCK_N positions at a time through the block table, so any page size works.

Every launch grid comes from host integers in AttentionMetadata (num_decodes, the
number of sequences, max_query_len); everything else (lengths, tables, slots) is read on
the device, so `forward` never syncs and can be captured in a CUDA graph. With
`meta.fixed` (a FixedGrid: a whole prefill or mixed step captured as one graph, see
kernels/cuda_graphs.MixedGraphs) the grids depend only on the step's capacity and the
step's own counts are read on the device: decode programs past the decode count return at
once, and the prefill grid is a list of (sequence, query tile) pairs padded with -1.

Decode: one program per (sequence, kv head, split) takes the whole query group
(Hq / Hkv heads, padded to 16 rows for tl.dot) against one shared stream of K/V, so each
K/V byte is read once per step. With few sequences the (sequence, kv head) grid leaves most
multiprocessors idle, so the context is cut into `num_splits` contiguous chunks whose
partial results (unnormalised output, running max, running sum) a second kernel merges.
The split count only changes speed: each split derives its own range from the device
seq_len, so a graph captured with a fixed count stays correct for any length.

Prefill: one program per (query tile of BLOCK_M tokens, prefill sequence, query head),
causal over the cached prefix plus the new tokens (query i at position
seq_len - q_len + i).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bucketserve.kernels import pdl, triton_pdl
from bucketserve.kernels.attention import (
    PREFILL_BLOCK_M,
    TILE_SHIFT,
    AttentionBackend,
    AttentionMetadata,
    get_forward_context,
)
from bucketserve.kernels.fp8 import FP8_DTYPE

_LOG2E = 1.4426950408889634
# decode over an FP8 pool: dots in fp16 (one conversion instruction per FP8 pair on sm90)
# instead of q's dtype, and the tile config (positions per tile, warps, stages) without
# splits (None: the bf16 pool's). Measured on an H200 (bench/fp8_attention_gpu.py, 8B heads,
# us a layer): batch 256 x context 512 142.4 -> 90.8 (fp16 dots, 64 positions, 2 warps, 4
# stages; the bf16 pool's 131.5), 256 x 2048 526.9 -> 330.9, 64 x 512 47.9 -> 29.1, 1 x 2048
# (8 splits, the bf16 pool's tiles) 10.2 -> 8.6; the same errors against fp32
FP8_F16_DOT = True
FP8_DECODE_TILES: tuple[int, int, int] | None = (64, 2, 4)
# a prefill tile of a fixed-grid launch (kernels/attention.prefill_tiles): sequence, query tile
_TILE_SHIFT: tl.constexpr = tl.constexpr(TILE_SHIFT)
_TILE_MASK: tl.constexpr = tl.constexpr((1 << TILE_SHIFT) - 1)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_inv, v_inv,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                     PDL: tl.constexpr):
    # one program per token: k[t], v[t] ([Hkv, D]) -> pool slot slot_mapping[t]; an FP8 pool
    # stores k * k_inv and v * v_inv (1 / the layer's scales), saturated to +-448
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # tolerate "no slot" markers as well as the dummy block
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv, -448.0), 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr,
                   out_ptr, part_o_ptr, part_ml_ptr, nd_ptr, scale_log2, v_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_bt,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DEVICE_COUNT: tl.constexpr,
                   F16_DOT: tl.constexpr, PDL: tl.constexpr):
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    s = tl.program_id(0)
    if DEVICE_COUNT:  # fixed grid (a captured mixed step): the decode count is on the device
        if s >= tl.load(nd_ptr):
            return
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    # this split's range [lo, hi), a whole number of tiles
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g  # query heads of this kv head; rows >= GROUP are padding
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if F16_DOT:  # an FP8 pool: one cvt an element pair to fp16; q saturated into its range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + s * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        page = tl.load(table + n // PAGE, mask=nmask, other=0).to(tl.int64)
        off = page * stride_cb + (n % PAGE) * stride_cs + kvh * stride_ch  # [BLOCK_N]
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 pool: exact in bf16 / fp16
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (a padded slot) gives zeros
        o = acc / l_safe[:, None] * v_scale
        tl.store(out_ptr + s * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        # partials: part_o [B, Hq, S, BLOCK_D] fp32, part_ml [B, Hq, S, 2] (max, sum)
        num_heads = tl.num_programs(1) * GROUP
        row = (s * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], acc * v_scale,
                 mask=gmask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    # one program per (sequence, query head): out = sum_s w_s o_s / sum_s w_s l_s
    triton_pdl.start(PDL)  # (kernels/pdl.py)
    s = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (s * tl.num_programs(1) + h) * NUM_SPLITS
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    m = tl.load(part_ml_ptr + (row0 + sp) * 2, mask=smask, other=float("-inf"))
    ll = tl.load(part_ml_ptr + (row0 + sp) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty splits weigh nothing
    o = tl.load(part_o_ptr + (row0 + sp)[:, None] * BLOCK_D + d[None, :],
                mask=smask[:, None], other=0.0)
    denom = tl.sum(w * ll, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    res = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + s * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, qsl_ptr,
                    out_ptr, tiles_ptr, scale_log2, v_scale, first_seq,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, TILED: tl.constexpr):
    if TILED:  # fixed grid (a captured mixed step): program -> (sequence, query tile) on the device
        tile = tl.load(tiles_ptr + tl.program_id(0))
        if tile < 0:
            return
        s = tile >> _TILE_SHIFT
        mblk = tile & _TILE_MASK
    else:
        mblk = tl.program_id(0)
        s = first_seq + tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len  # cached positions before this chunk
    kvh = h // GROUP

    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mmask = m < q_len
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    qpos = ctx + m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + s * stride_bt
    # keys 0 .. full_hi-1 are visible to every row of the tile (no mask needed); the
    # keys full_hi .. hi-1 are masked causally, hi being the tile's last query position + 1
    full_hi = (ctx + mblk * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, ctx + (mblk + 1) * BLOCK_M)
    for start in range(0, full_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        page = tl.load(table + n // PAGE).to(tl.int64)
        off = page * stride_cb + (n % PAGE) * stride_cs + kvh * stride_ch
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=dmask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=dmask[None, :], other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    for start in range(full_hi, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        page = tl.load(table + n // PAGE, mask=nmask, other=0).to(tl.int64)
        off = page * stride_cb + (n % PAGE) * stride_cs + kvh * stride_ch
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        causal = (n[None, :] <= qpos[:, None]) & nmask[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        # every row sees position 0, so m_i is finite once a tile was seen; a row whose
        # keys here are all masked gets p = 0 (and if this is the first tile, it is not)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _precision(dtype: torch.dtype) -> str:
    # fp32 runs are the exactness oracle for engine tests: keep tl.dot off tf32
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      max_splits: int = 16, min_tokens_per_split: int = 256) -> int:
    """Splits per (sequence, kv head) so that the decode grid covers ~2 waves of the GPU,
    without cutting the context into chunks shorter than `min_tokens_per_split`."""
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    by_len = triton.cdiv(max(1, max_seq_len), min_tokens_per_split)
    n = max(1, min(want, by_len, max_splits))
    # rounded down to a power of two: NUM_SPLITS is a compile-time constant, so this keeps
    # the kernel variants to a handful that warm_up() compiles before serving (one compile
    # per new count in the middle of a run cost ~30 ms a step on the H200)
    return 1 << (n.bit_length() - 1)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """k, v: [T, Hkv, D] (last dim contiguous) -> pool slots slot_mapping [T]; an FP8 pool
    stores them divided by kv_scales."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        FP8=k_cache.dtype == FP8_DTYPE, **pdl.launch_args(k.device, t))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, num_decodes: int,
                 scale: float, out: torch.Tensor, num_splits: int = 1,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, device_count: torch.Tensor | None = None,
                 kv_scales: tuple[float, float] = (1.0, 1.0),
                 f16_dot: bool | None = None) -> None:
    """Rows 0..num_decodes-1 of q [T, Hq, D] attend over their contexts; writes out rows.
    kv_scales: an FP8 pool's (k, v) scales (the pool holds value / scale).
    f16_dot: an FP8 pool's tiles go to fp16 (not q's dtype) for the dots, q saturated to
    fp16's range (None: FP8_F16_DOT).

    device_count (an int32 tensor of one element on the device): the launch grid covers
    num_decodes rows, but only rows below device_count[0] run (a fixed grid that a CUDA
    graph can replay for any decode count up to num_decodes); needs num_splits == 1.

    block_n (positions per K/V tile) None: 64 for head_dim >= 128 without splits, else 128
    (an FP8 pool without splits: FP8_DECODE_TILES where set, as num_warps and num_stages).
    Measured on an H200 (bench/gpu_8b.py --attn, 8B heads 32/8/128, context 512): 64 took
    131.6 us a layer at batch 256 (KV-read bound 131.3) against 134.1 for 128, and 36.0 against
    41.1 at batch 64; with splits (small batches) 128 stays ahead at long contexts."""
    hq, d = q.shape[1], q.shape[2]
    fp8 = k_cache.dtype == FP8_DTYPE
    tiles = FP8_DECODE_TILES if fp8 and num_splits == 1 else None
    if block_n is None:
        block_n = tiles[0] if tiles else 64 if d >= 128 and num_splits == 1 else 128
    if num_warps is None:
        num_warps = tiles[1] if tiles else 4
    if num_stages is None:
        num_stages = tiles[2] if tiles else 3
    hkv = k_cache.shape[2]
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    if device_count is not None and num_splits != 1:
        raise ValueError("a decode count on the device needs num_splits == 1")
    f16 = fp8 and q.dtype != torch.float32 and (FP8_F16_DOT if f16_dot is None else f16_dot)
    if num_splits > 1:
        part_o = torch.empty(num_decodes * hq * num_splits * block_d, dtype=torch.float32,
                             device=q.device)
        part_ml = torch.empty(num_decodes * hq * num_splits * 2, dtype=torch.float32,
                              device=q.device)
    else:
        part_o = part_ml = out  # unused
    _decode_kernel[(num_decodes, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_ml,
        seq_lens if device_count is None else device_count, scale * kv_scales[0] * _LOG2E,
        kv_scales[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, PAGE=k_cache.shape[1], NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION=_precision(q.dtype), DEVICE_COUNT=device_count is not None, F16_DOT=f16,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_args(q.device, num_decodes))
    if num_splits > 1:
        _merge_splits_kernel[(num_decodes, hq)](
            part_o, part_ml, out, out.stride(0), out.stride(1),
            HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, **pdl.launch_args(q.device, num_decodes))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, first_seq: int, num_seqs: int,
                  max_query_len: int, scale: float, out: torch.Tensor,
                  block_m: int = PREFILL_BLOCK_M, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 2, tiles: torch.Tensor | None = None,
                  kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Sequences first_seq..num_seqs-1 (query rows from query_start_loc) attend causally
    over their pooled contexts; writes their rows of out.

    tiles (int32 on the device, from prefill_tiles): one program per entry, each naming
    (sequence, query tile of block_m rows), -1 for none; first_seq, num_seqs and
    max_query_len are then unused. The grid depends only on tiles' length, so a CUDA graph
    can replay it for any step that fits."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if tiles is None:
        grid = (triton.cdiv(max_query_len, block_m), num_seqs - first_seq, hq)
    else:
        grid = (tiles.numel(), 1, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        query_start_loc if tiles is None else tiles, scale * kv_scales[0] * _LOG2E,
        kv_scales[1], first_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=hq // hkv, HEAD_DIM=d, PAGE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n,
        PRECISION=_precision(q.dtype), TILED=tiles is not None, num_warps=num_warps,
        num_stages=num_stages)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels above (same contract as the torch one).

    `decode_splits`: None picks the split-K count per call from the batch and
    meta.max_seq_len (set meta.max_seq_len to the model's max length in captured graphs);
    an int fixes it.
    """

    name = "triton"
    graph_capturable = True  # no host syncs in forward (runner checks before capturing)

    def __init__(self, decode_splits: int | None = None, max_splits: int = 16) -> None:
        self.decode_splits = decode_splits
        self.max_splits = max_splits
        self._sms: dict[torch.device, int] = {}

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float,
                kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
        """kv_scales: an FP8 pool's (k, v) scales; the pool holds value / scale."""
        meta = get_forward_context()
        scales = kv_scales or (1.0, 1.0)
        self.write_kv(k, v, k_cache, v_cache, meta, scales)
        return self.attend(q, k_cache, v_cache, meta, scale, scales)

    def num_splits(self, meta: AttentionMetadata, num_kv_heads: int,
                   device: torch.device) -> int:
        if self.decode_splits is not None:
            return self.decode_splits
        if device not in self._sms:
            self._sms[device] = _num_sms(device)
        return choose_num_splits(meta.num_decodes, num_kv_heads, meta.max_seq_len,
                                 self._sms[device], self.max_splits)

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                table_width: int, q_dtype: torch.dtype | None = None) -> None:
        """Compiles the kernel variants a serving run can need, before it starts: decode for
        every split count num_splits() can return (powers of two up to max_splits), prefill
        after 0, 1, 2 and 16 decodes (Triton specialises integer arguments equal to 1 or
        divisible by 16). Reads and writes only the dummy block 0. table_width: the block
        tables' row stride used when serving; q_dtype: the queries' dtype (None: the pool's)."""
        dev, dtype, d = k_cache.device, q_dtype or k_cache.dtype, k_cache.shape[3]
        splits, s = [], 1
        while s <= (self.decode_splits or self.max_splits):
            splits.append(s)
            s *= 2
        for first in (0, 1, 2, 16):
            n = first + 1  # `first` decodes and one prefill of 2 tokens
            q = torch.zeros(first + 2, num_heads, d, dtype=dtype, device=dev)
            out = torch.empty_like(q)
            tables = torch.zeros(n, table_width, dtype=torch.int32, device=dev)
            lens = torch.full((n,), 2, dtype=torch.int32, device=dev)
            qsl = torch.tensor([*range(first + 1), first + 2], dtype=torch.int32, device=dev)
            for sp in splits if first else []:
                paged_decode(q, k_cache, v_cache, tables, lens, first, 1.0, out, num_splits=sp)
            paged_prefill(q, k_cache, v_cache, tables, lens, qsl, first, n, 2, 1.0, out)
        torch.cuda.synchronize(dev)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float,
               kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """q [T, Hq, D] (last dim contiguous) -> [T, Hq, D] in q's dtype."""
        assert q.stride(2) == 1 and k_cache.stride(3) == 1
        assert k_cache.stride() == v_cache.stride()
        if q.shape[1] % k_cache.shape[2]:
            raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads "
                             f"({k_cache.shape[2]})")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        fixed = meta.fixed
        if fixed is not None:  # a captured prefill / mixed step: grids from its capacity
            if fixed.max_decodes:
                paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                             fixed.max_decodes, scale, out, device_count=fixed.num_decodes,
                             kv_scales=kv_scales)
            paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, 0, 0, 0, scale, out, tiles=fixed.tiles,
                          kv_scales=kv_scales)
            return out
        nd = meta.num_decodes
        if nd:
            splits = self.num_splits(meta, k_cache.shape[2], q.device)
            paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, nd, scale, out,
                         num_splits=splits, kv_scales=kv_scales)
        if meta.num_seqs > nd:
            paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, nd, meta.num_seqs, meta.max_query_len,
                          scale, out, kv_scales=kv_scales)
        return out
