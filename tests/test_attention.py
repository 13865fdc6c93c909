"""The torch paged attention (the CPU path and the GPU kernels' oracle) against plain
dense attention computed per sequence with an explicit softmax."""

from __future__ import annotations

import random

import pytest
import torch

from bucketserve.kernels.attention import AttentionMetadata, reference_attention, write_kv


def dense(q, k, v, scale):
    """q [Lq, Hq, D] at the last Lq positions of k, v [L, Hkv, D]; causal."""
    lq, hq, _ = q.shape
    total, hkv, _ = k.shape
    g = hq // hkv
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(total - lq, total)[:, None]
    scores = scores.masked_fill(torch.arange(total)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2), (8, 1)])
def test_reference_attention_matches_dense(hq, hkv):
    rng = random.Random(hq * 10 + hkv)
    torch.manual_seed(hq + hkv)
    d, bs, num_blocks = 16, 4, 200
    # (cached tokens, new tokens): decodes first, then a full prompt and a chunk over a prefix
    seqs = [(0, 1), (13, 1), (40, 1), (41, 1), (7, 1), (0, 37), (22, 9)]
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    k_cache = torch.zeros(num_blocks, bs, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    tables, full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // bs))]
        tables.append(table)
        fk, fv = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
        full_k.append(fk)
        full_v.append(fv)
        pos = torch.arange(total)
        slot = torch.tensor(table)[pos // bs] * bs + pos % bs
        write_kv(fk[:cached], fv[:cached], k_cache, v_cache, slot[:cached])  # the prefix
        ks.append(fk[cached:])
        vs.append(fv[cached:])
        slots.append(slot[cached:])
        qs.append(torch.randn(new, hq, d))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0] + list(torch.tensor([n for _, n in seqs]).cumsum(0)),
                                     dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=5, max_query_len=37, max_seq_len=42,
        query_lens_cpu=[n for _, n in seqs], seq_lens_cpu=[c + n for c, n in seqs])
    write_kv(torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta.slot_mapping)
    scale = d ** -0.5
    out = reference_attention(torch.cat(qs), k_cache, v_cache, meta, scale)
    expected = torch.cat([dense(q, fk, fv, scale) for q, fk, fv in zip(qs, full_k, full_v, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (8, 8, 32, 4), (32, 8, 128, 16), (4, 1, 16, 1)])
def test_cpu_decode_kernel_matches_reference(hq, hkv, d, bs):
    from bucketserve.kernels import cpu_decode

    if cpu_decode.load() is None:
        pytest.skip("no C compiler: the CPU decode kernel is not built here")
    torch.manual_seed(d + bs)
    nd = 6
    lens = [1, 2, bs, bs + 1, 77, 200]
    width = max(-(-n // bs) for n in lens)
    num_blocks = nd * width + 1
    perm = torch.randperm(num_blocks - 1)[: nd * width] + 1
    tables = perm.view(nd, width).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, hkv, d)
    v_cache = torch.randn(num_blocks, bs, hkv, d)
    # q as the model passes it: a strided view into a wider qkv buffer
    q = torch.randn(nd, hq + 2 * hkv, d)[:, :hq]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(nd, dtype=torch.int64),
        query_start_loc=torch.arange(nd + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_decodes=nd,
        max_query_len=1, max_seq_len=max(lens), query_lens_cpu=[1] * nd, seq_lens_cpu=lens)
    out = torch.empty(nd, hq, d)
    cpu_decode.paged_decode(q, k_cache, v_cache, tables, meta.seq_lens, d ** -0.5, out)
    expected = reference_attention(q.contiguous(), k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
