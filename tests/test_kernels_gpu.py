"""Triton paged attention vs the torch reference (kernels.attention), on a CUDA GPU.

Each case draws fresh random block tables (distinct pages per sequence, scattered over the
pool), a random pool (the cached prefixes), and random q/k/v for the step's new tokens;
the batch mixes decodes (context 1..4096) with prefills (whole prompts and chunks over a
cached prefix). The oracle is reference_attention run in float32 on the same inputs.
Skipped without CUDA or triton; triton is never imported on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from bucketserve.kernels.attention import (
    AttentionMetadata,
    forward_context,
    reference_attention,
    write_kv,
)

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (query heads, kv heads): GQA ratios 1, 3, 4, 8
HEADS = [(4, 4), (9, 3), (32, 8), (16, 2)]
# max abs error against the float32 reference; bf16 keeps 8 bits of mantissa, so an
# output of magnitude ~2 rounds by up to 2**-7; fp32 runs tl.dot in IEEE mode.
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def make_case(decode_lens: list[int], prefills: list[tuple[int, int]], num_heads: int,
              num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
              device: str, gen: torch.Generator):
    """decode_lens: context length of each decode; prefills: (query_len, seq_len) pairs.

    Returns (q, k, v, k_cache, v_cache, meta); pages of all sequences are distinct and in
    random order, block 0 stays the dummy block."""
    seqs = [(1, n) for n in decode_lens] + list(prefills)
    pages_per_seq = [math.ceil(n / page) for _, n in seqs]
    num_blocks = 1 + sum(pages_per_seq) + 3  # a few spare pages nobody uses
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_pages = max(pages_per_seq)
    tables = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
    slots, qsl = [], [0]
    for i, ((qlen, n), np_) in enumerate(zip(seqs, pages_per_seq, strict=True)):
        tables[i, :np_] = torch.tensor(perm[:np_], dtype=torch.int32)
        perm = perm[np_:]
        for pos in range(n - qlen, n):
            slots.append(int(tables[i, pos // page]) * page + pos % page)
        qsl.append(qsl[-1] + qlen)
    t = qsl[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    k_cache = rnd(num_blocks, page, num_kv_heads, head_dim)
    v_cache = rnd(num_blocks, page, num_kv_heads, head_dim)
    # q as a strided view of a fused qkv projection, as the model produces it
    qkv = rnd(t, (num_heads + 2 * num_kv_heads) * head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=1)
    q = q.view(t, num_heads, head_dim)
    k = k.view(t, num_kv_heads, head_dim)
    v = v.view(t, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decodes=len(decode_lens),
        max_query_len=max(ql for ql, _ in seqs),
        max_seq_len=max(n for _, n in seqs),
        query_lens_cpu=[ql for ql, _ in seqs],
        seq_lens_cpu=[n for _, n in seqs],
    )
    return q, k, v, k_cache, v_cache, meta


def run_both(backend, q, k, v, k_cache, v_cache, meta, scale):
    """(triton output, float32 reference output, triton pool, reference pool)."""
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    # poison: the freed block is what torch.empty inside forward() most likely gets back
    poison = torch.full((q.numel() * 2,), float("nan"), dtype=q.dtype, device=q.device)
    del poison
    with forward_context(meta):
        out = backend.forward(q, k, v, k_cache, v_cache, scale)
    write_kv(k, v, kc_ref, vc_ref, meta.slot_mapping)
    ref = reference_attention(q.float(), kc_ref.float(), vc_ref.float(), meta, scale)
    return out, ref, (k_cache, v_cache), (kc_ref, vc_ref)


def random_lengths(gen: torch.Generator, count: int, lo: int, hi: int) -> list[int]:
    """Log-uniform lengths in [lo, hi], always including both ends."""
    x = torch.rand(count, generator=gen) * (math.log(hi) - math.log(lo)) + math.log(lo)
    return sorted({lo, hi, *[int(math.exp(float(v))) for v in x]})


def check(out, ref, pools, ref_pools, dtype, label):
    assert not torch.isnan(out).any(), f"{label}: unwritten or NaN outputs"
    for got, want in zip(pools, ref_pools, strict=True):
        assert torch.equal(got, want), f"{label}: K/V pool differs from the reference write"
    err = (out.float() - ref).abs().max().item()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"{label}: max abs err {err:.3e}, rel {rel:.3e}")
    assert err <= TOL[dtype], f"{label}: max abs error {err} over {TOL[dtype]}"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_mixed_batch_matches_reference(dtype, heads, splits):
    pytest.importorskip("triton")
    from bucketserve.kernels.triton_attention import TritonAttentionBackend

    gen = torch.Generator().manual_seed(1000 * (dtype == torch.bfloat16) + 10 * heads[0] + (splits or 0))
    decode_lens = random_lengths(gen, 10, 1, 4096)
    # whole prompts, chunks over a cached prefix, a 1-token chunk, a chunk ending at 4096
    prefills = [(1, 1), (37, 37), (200, 200), (64, 1000), (1, 513), (300, 4096)]
    hq, hkv = heads
    case = make_case(decode_lens, prefills, hq, hkv, 64, 16, dtype, "cuda", gen)
    backend = TritonAttentionBackend(decode_splits=splits)
    out, ref, pools, ref_pools = run_both(backend, *case, scale=64 ** -0.5)
    check(out, ref, pools, ref_pools, dtype, f"{dtype} hq={hq} hkv={hkv} splits={splits}")


@needs_cuda
@pytest.mark.parametrize("head_dim,page", [(128, 16), (80, 8), (64, 32)])
def test_head_dims_and_page_sizes(head_dim, page):
    pytest.importorskip("triton")
    from bucketserve.kernels.triton_attention import TritonAttentionBackend

    gen = torch.Generator().manual_seed(head_dim * 1000 + page)
    case = make_case([1, 15, 16, 17, 700, 2049], [(50, 50), (33, 290)], 8, 2, head_dim,
                     page, torch.bfloat16, "cuda", gen)
    out, ref, pools, ref_pools = run_both(TritonAttentionBackend(), *case,
                                          scale=head_dim ** -0.5)
    check(out, ref, pools, ref_pools, torch.bfloat16, f"D={head_dim} page={page}")


@needs_cuda
@pytest.mark.parametrize("kind", ["decodes_only", "prefills_only"])
def test_decode_only_and_prefill_only_batches(kind):
    pytest.importorskip("triton")
    from bucketserve.kernels.triton_attention import TritonAttentionBackend

    gen = torch.Generator().manual_seed(7 if kind == "decodes_only" else 8)
    decodes = random_lengths(gen, 40, 1, 4096) if kind == "decodes_only" else []
    prefills = [] if kind == "decodes_only" else [(n, n) for n in random_lengths(gen, 6, 1, 2048)]
    case = make_case(decodes, prefills, 32, 8, 64, 16, torch.bfloat16, "cuda", gen)
    out, ref, pools, ref_pools = run_both(TritonAttentionBackend(), *case, scale=0.125)
    check(out, ref, pools, ref_pools, torch.bfloat16, kind)


# fused small ops (kernels/triton_ops.py): Triton kernels vs their torch versions, which
# tests/test_triton_ops.py ties to transformers. Same rounding points; only rsqrt/exp
# and the sum order may differ, so one bf16 rounding step apart at most.
OPS_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5), torch.float32: dict(rtol=1e-5, atol=1e-6)}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (67, 2048), (300, 960)])
def test_fused_rms_norm(dtype, rows, hidden):
    pytest.importorskip("triton")
    from bucketserve.kernels import triton_ops

    gen = torch.Generator().manual_seed(rows + hidden)
    x, res, w = (torch.randn(*s, generator=gen).to(dtype).cuda()
                 for s in [(rows, hidden), (rows, hidden), (hidden,)])
    for residual in (None, res):
        got, got_res = triton_ops.rms_norm(x, w, 1e-5, residual)
        want, want_res = triton_ops.rms_norm_torch(x, w, 1e-5, residual)
        torch.testing.assert_close(got, want, **OPS_TOL[dtype])
        if residual is not None:
            assert torch.equal(got_res, want_res)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 9, 3, 64), (130, 32, 8, 64), (33, 8, 8, 128)])
def test_fused_rotary(dtype, tokens, hq, hkv, d):
    pytest.importorskip("triton")
    from bucketserve.kernels import triton_ops

    gen = torch.Generator().manual_seed(tokens * d + hq)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype).cuda()
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cache = triton_ops.cos_sin_cache(inv_freq.cuda(), 8192)
    positions = torch.randint(0, 8192, (tokens,), generator=gen).cuda()
    got = triton_ops.apply_rotary(q, k, positions, cache)
    want = triton_ops.apply_rotary_torch(q, k, positions, cache)
    # bf16: the compiled kernel may keep x*cos and x*sin in fp32 instead of rounding each
    # to bf16 (seen on the H200: results up to 2**-8 apart where the sum cancels to ~0).
    # So the bound is the rounding error of one product of the operands' scale (|x| < 8:
    # half a bf16 ulp there is 2**-6), not a relative error of the result.
    tol = dict(rtol=1.6e-2, atol=2**-6) if dtype == torch.bfloat16 else OPS_TOL[dtype]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (100, 8192), (7, 1000)])
def test_fused_silu_and_mul(dtype, rows, inter):
    pytest.importorskip("triton")
    from bucketserve.kernels import triton_ops

    gen = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, 2 * inter, generator=gen).to(dtype).cuda()
    torch.testing.assert_close(triton_ops.silu_and_mul(x), triton_ops.silu_and_mul_torch(x),
                               **OPS_TOL[dtype])
