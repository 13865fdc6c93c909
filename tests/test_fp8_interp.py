"""FP8 Triton kernels under Triton's interpreter on the CPU (tests/triton_interp.py): the paged
attention kernels reading an FP8 KV pool with per-layer scales (decode with and without
split-K, prefill, the fixed grid of a captured mixed step), the FP8 K/V write, and the
per-row activation quantization. The interpreter rounds some float -> FP8 conversions wrongly
(a carry into the exponent is lost), so the conversions checked here are exact ones; the
rounding of the compiled kernels is checked against torch on a GPU (tests/test_fp8_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bucketserve.kernels.attention import (
    AttentionMetadata,
    FixedGrid,
    max_prefill_tiles,
    prefill_tiles,
    reference_attention,
)
from bucketserve.kernels.fp8 import FP8_DTYPE, FP8_MAX

KS, VS = 0.5, 2.0  # powers of two: value / scale is exact, so the interpreter's cast is too


def _interp():
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_attention

    return triton_attention


def _page_tables(lens: list[int], page: int, rows: int, width: int) -> tuple[torch.Tensor, int]:
    """Block tables [rows, width] giving sequence i of lens[i] tokens its pages in order from
    block 1 (block 0 stays the dummy), and the number of blocks used (the dummy included)."""
    tables = torch.zeros(rows, width, dtype=torch.int32)
    used = 1
    for i, x in enumerate(lens):
        need = -(-x // page)
        tables[i, :need] = torch.arange(used, used + need)
        used += need
    return tables, used


def _fp8_values(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(FP8_DTYPE)


@pytest.mark.parametrize("fixed_grid", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
def test_attention_reads_an_fp8_pool_with_scales(fixed_grid, splits):
    ta = _interp()
    if fixed_grid and splits > 1:
        pytest.skip("a fixed grid decodes without splits")
    torch.manual_seed(splits)
    page, hkv, hq, d, max_seqs = 16, 2, 4, 32, 8
    decodes, prefills = [20, 45], [(5, 9), (40, 0)]  # contexts; (new tokens, cached prefix)
    lens = decodes + [c + p for c, p in prefills]
    qlens = [1] * len(decodes) + [c for c, _ in prefills]
    n, ntok = len(lens), sum(qlens)
    nb = sum(-(-x // page) for x in lens) + 1
    kc, vc = _fp8_values(nb, page, hkv, d), _fp8_values(nb, page, hkv, d)
    tables, _ = _page_tables(lens, page, max_seqs, 8)
    slots = []
    for i, (x, qn) in enumerate(zip(lens, qlens, strict=True)):
        slots += [int(tables[i, p // page]) * page + p % page for p in range(x - qn, x)]
    slots = torch.tensor(slots)
    # new K/V exactly representable after division by the scales
    k = _fp8_values(ntok, hkv, d).float() * KS
    v = _fp8_values(ntok, hkv, d).float() * VS
    q = torch.randn(ntok, hq, d)
    qsl = torch.zeros(max_seqs + 1, dtype=torch.int32)
    qsl[1:n + 1] = torch.tensor(np.cumsum(qlens), dtype=torch.int32)
    seq_lens = torch.ones(max_seqs, dtype=torch.int32)
    seq_lens[:n] = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl[:n + 1],
                             seq_lens=seq_lens[:n], block_tables=tables[:n],
                             num_decodes=len(decodes), max_query_len=max(qlens),
                             max_seq_len=max(lens), query_lens_cpu=qlens, seq_lens_cpu=lens)
    run_meta = meta
    if fixed_grid:
        counts = np.full(1 + max_prefill_tiles(ntok, max_seqs), -1, dtype=np.int32)
        counts[0] = len(decodes)
        prefill_tiles(qlens, len(decodes), counts[1:])
        c = torch.from_numpy(counts)
        fixed = FixedGrid(num_decodes=c[:1], max_decodes=min(ntok, max_seqs), tiles=c[1:])
        run_meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl,
                                     seq_lens=seq_lens, block_tables=tables,
                                     num_decodes=fixed.max_decodes, max_query_len=ntok,
                                     max_seq_len=0, query_lens_cpu=[], seq_lens_cpu=[],
                                     fixed=fixed)
    backend = ta.TritonAttentionBackend(decode_splits=splits)
    kc_want, vc_want = kc.clone(), vc.clone()
    kc_want.view(-1, hkv, d)[slots] = (k / KS).to(FP8_DTYPE)
    vc_want.view(-1, hkv, d)[slots] = (v / VS).to(FP8_DTYPE)
    backend.write_kv(k, v, kc, vc, run_meta, (KS, VS))
    assert torch.equal(kc.view(torch.uint8), kc_want.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_want.view(torch.uint8))
    out = backend.attend(q, kc, vc, run_meta, d ** -0.5, (KS, VS))
    ref = reference_attention(q, kc.float() * KS, vc.float() * VS, meta, d ** -0.5)
    torch.testing.assert_close(out[:ntok], ref, rtol=1e-4, atol=1e-4)


def test_fp8_write_saturates_instead_of_overflowing():
    ta = _interp()
    k = torch.tensor([[[1000.0, -1000.0, 3.0, 0.0]]])
    kc = torch.zeros(2, 4, 1, 4, dtype=FP8_DTYPE)
    vc = torch.zeros_like(kc)
    ta.write_kv_triton(k, k, kc, vc, torch.tensor([5]), (1.0, 1.0))
    assert kc[1, 1, 0].float().tolist() == [FP8_MAX, -FP8_MAX, 3.0, 0.0]


def test_quantize_rows_kernel_matches_torch():
    _interp()
    from bucketserve.kernels import triton_fp8
    from bucketserve.kernels.fp8_ops import quantize_rows_torch

    torch.manual_seed(0)
    # rows of FP8 values times powers of two, each row's largest magnitude 448: the dynamic
    # scale is the power of two and every quotient exact
    vals = _fp8_values(6, 200).float()
    vals[:, 7] = FP8_MAX
    x = vals * torch.tensor([2.0 ** e for e in (-12, -3, 0, 1, 4, 9)])[:, None]
    x[5] = 0.0  # an all-zero row keeps a finite scale
    q, s = triton_fp8.quantize_rows(x)
    q_ref, s_ref = quantize_rows_torch(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    static = torch.tensor(2.0)  # row 3's own scale; row 4 (scale 16) saturates
    q, s = triton_fp8.quantize_rows(x[3:5], static)
    q_ref, s_ref = quantize_rows_torch(x[3:5], static)
    assert q.float().abs().max() == FP8_MAX
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_decode_over_an_fp8_pool_with_fp16_dots():
    """bf16 queries over an FP8 pool with the dots in fp16 (f16_dot): within bf16 rounding of
    the fp32 reference on the pool's values. (The interpreter cannot check the dots in bf16:
    its FP8-to-bf16 conversion gives garbage; tests/test_fp8_gpu.py checks both on a GPU.)"""
    ta = _interp()
    torch.manual_seed(3)
    page, hkv, hq, d, ctx = 16, 2, 8, 32, [37, 5, 64]
    per = -(-max(ctx) // page)
    nb = len(ctx) * per + 1
    kc, vc = _fp8_values(nb, page, hkv, d), _fp8_values(nb, page, hkv, d)
    tables = (torch.randperm(nb - 1)[: len(ctx) * per] + 1).view(len(ctx), per).int()
    lens = torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(len(ctx), hq, d).to(torch.bfloat16)
    out = torch.empty_like(q)
    ta.paged_decode(q, kc, vc, tables, lens, len(ctx), d ** -0.5, out, kv_scales=(KS, VS),
                    f16_dot=True)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(ctx), dtype=torch.long),
                             query_start_loc=torch.arange(len(ctx) + 1, dtype=torch.int32),
                             seq_lens=lens, block_tables=tables, num_decodes=len(ctx),
                             max_query_len=1, max_seq_len=max(ctx),
                             query_lens_cpu=[1] * len(ctx), seq_lens_cpu=ctx)
    ref = reference_attention(q.float(), kc.float() * KS, vc.float() * VS, meta, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * VS)


@pytest.mark.parametrize("residual", [False, True])
def test_fused_readers_apply_deferred_scales_as_they_load(residual):
    """rms_norm_quant and silu_and_mul_quant given a Deferred product's scales (row [T, 1],
    col [N]): bit for bit what the same kernels give for the product scaled beforehand
    (fp8_ops.apply_scales), with the row and column scales both used."""
    _interp()
    from bucketserve.kernels import triton_fp8
    from bucketserve.kernels.fp8_ops import Deferred, apply_scales

    gen = torch.Generator().manual_seed(7 + residual)
    t, n = 5, 96
    raw = torch.randn(t, 2 * n, generator=gen) * 50
    row = torch.rand(t, 1, generator=gen) + 0.01
    col = torch.rand(2 * n, generator=gen) + 0.01
    w = torch.rand(n, generator=gen) + 0.5
    r = torch.randn(t, n, generator=gen) if residual else None
    d = Deferred(raw[:, :n].contiguous(), row, col[:n].contiguous())
    got, got_res = triton_fp8.rms_norm_quant(d.raw, w, 1e-5, r, scales=(d.row, d.col))
    want, want_res = triton_fp8.rms_norm_quant(apply_scales(d), w, 1e-5, r)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert (got_res is None) == (not residual)
    if residual:
        assert torch.equal(got_res, want_res)
    unscaled = triton_fp8.rms_norm_quant(d.raw, w, 1e-5, r)[0]
    assert not torch.equal(unscaled[0].view(torch.uint8), got[0].view(torch.uint8))
    g = Deferred(raw, row, col)
    got = triton_fp8.silu_and_mul_quant(raw, scales=(row, col))
    want = triton_fp8.silu_and_mul_quant(apply_scales(g))
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("static, scaled", [(False, False), (True, False), (False, True)])
def test_two_pass_silu_and_mul_quantization_is_the_one_pass_one(static, scaled):
    """silu_and_mul_quant's chunked two-pass kernel (the row's largest magnitude first, then
    the chunks again, quantized) gives the one-pass kernel's codes and scales bit for bit,
    for a row that does not fill its last chunk, static or dynamic, with deferred scales or
    without; the dynamic scales are the torch reference's (the interpreter's FP8 rounding of
    the codes themselves is not exact: module docstring)."""
    _interp()
    from bucketserve.kernels import triton_fp8
    from bucketserve.kernels.fp8_ops import quantize_rows_torch
    from bucketserve.kernels.triton_ops import silu_and_mul_torch

    gen = torch.Generator().manual_seed(3 + static + 2 * scaled)
    t, n = 4, 300
    x = torch.randn(t, 2 * n, generator=gen) * 3
    x[2, n + 123] = 40.0  # the row's largest product sits in the second chunk
    st = torch.tensor(0.05) if static else None
    sc = (torch.rand(t, 1, generator=gen) + 0.5, torch.rand(2 * n, generator=gen) + 0.5) \
        if scaled else None
    one = triton_fp8.silu_and_mul_quant(x, st, sc)
    two = triton_fp8.silu_and_mul_quant(x, st, sc, chunked=(128, 2))
    assert torch.equal(one[1], two[1])
    assert torch.equal(one[0].view(torch.uint8), two[0].view(torch.uint8))
    if not scaled and not static:
        ref = quantize_rows_torch(silu_and_mul_torch(x))
        assert torch.equal(two[1], ref[1])


def test_quantizing_kernels_with_pdl_give_the_same_bits_and_wait_first(monkeypatch):
    """The activation quantizers launched with programmatic dependent launch (kernels/pdl.py:
    each program lets the next kernel start, then waits for the one before it before it reads
    anything) give the codes, scales and residual sums they give without it, and every program
    waits exactly once: quantize_rows, rms_norm_quant with a residual and deferred scales,
    silu_and_mul_quant one-pass and chunked."""
    _interp()
    from triton_interp import pdl_on

    from bucketserve.kernels import triton_fp8

    gen = torch.Generator().manual_seed(11)
    t, n = 5, 300
    x = torch.randn(t, 2 * n, generator=gen) * 3
    h = torch.randn(t, n, generator=gen)
    r = torch.randn(t, n, generator=gen)
    w = torch.rand(n, generator=gen) + 0.5
    sc = (torch.rand(t, 1, generator=gen) + 0.5, torch.rand(n, generator=gen) + 0.5)

    def run():
        (q1, s1), res = triton_fp8.rms_norm_quant(h, w, 1e-5, r, scales=sc)
        return [*triton_fp8.quantize_rows(h), q1, s1, res, *triton_fp8.silu_and_mul_quant(x),
                *triton_fp8.silu_and_mul_quant(x, chunked=(128, 2))]

    plain = run()
    calls = pdl_on(monkeypatch)
    with_pdl = run()
    for a, b in zip(plain, with_pdl, strict=True):
        if a.dtype == FP8_DTYPE:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)
    assert calls == ["launch", "wait"] * (4 * t)  # four launches of t programs


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_chain_kernels_with_pdl_give_the_same_bits(monkeypatch, splits):
    """The rest of a decode layer's Triton chain launched with programmatic dependent launch:
    the rotary kernel, the K/V write into an FP8 pool, the paged decode and (with splits) the
    merge of its splits give what they give without it, and each program signals and waits
    exactly once, first."""
    ta = _interp()
    from triton_interp import pdl_on

    from bucketserve.kernels import triton_fused

    gen = torch.Generator().manual_seed(5 + splits)
    page, hkv, hq, d = 16, 2, 4, 32
    lens = [20, 45, 3]
    nd = len(lens)
    tables, used = _page_tables(lens, page, nd, 4)
    slots = torch.tensor([int(tables[i, (x - 1) // page]) * page + (x - 1) % page
                          for i, x in enumerate(lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = seq_lens.long() - 1
    cache = torch.randn(64, d, generator=gen)  # rows [cos | sin]
    q0 = torch.randn(nd, hq, d, generator=gen)
    k0 = torch.randn(nd, hkv, d, generator=gen)
    v = _fp8_values(nd, hkv, d).float() * VS
    pool = _fp8_values(used, page, hkv, d), _fp8_values(used, page, hkv, d)

    def run():
        kc, vc = pool[0].clone(), pool[1].clone()
        q, k = triton_fused.apply_rotary(q0, k0, positions, cache)
        ta.write_kv_triton(k, v, kc, vc, slots, (KS, VS))
        out = torch.empty(nd, hq, d)
        ta.paged_decode(q, kc, vc, tables, seq_lens, nd, d ** -0.5, out, num_splits=splits,
                        kv_scales=(KS, VS))
        return [q, k, kc.view(torch.uint8), vc.view(torch.uint8), out]

    plain = run()
    calls = pdl_on(monkeypatch)
    with_pdl = run()
    for a, b in zip(plain, with_pdl, strict=True):
        assert torch.equal(a, b)
    programs = nd + nd + nd * hkv * splits + (nd * hq if splits > 1 else 0)
    assert calls == ["launch", "wait"] * programs
