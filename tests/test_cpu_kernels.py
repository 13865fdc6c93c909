"""The C kernels of the float32 CPU forward (kernels/csrc/paged_decode.c) against torch: each
row-wise op, the whole model forward with and without them, the build cache key, and the
AVX2 build of the decode kernel on a machine that has more."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bucketserve.kernels import cpu_decode
from bucketserve.kernels.attention import AttentionMetadata, forward_context
from bucketserve.kernels.cpu_plan import isa_environment, resolve_cpu_plan
from bucketserve.models.config import ModelConfig
from bucketserve.models.loader import build_dummy_model

ROOT = Path(__file__).resolve().parent.parent


def run_forced_avx2(script: str, cache: Path) -> None:
    """Runs `script` in a fresh Python with the AVX2 environment of `--cpu-isa avx2` (our C
    kernels built for it into `cache`); the script prints "ok" at its end."""
    env = {**os.environ, **isa_environment("avx2"), "XDG_CACHE_HOME": str(cache),
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]

needs_kernels = pytest.mark.skipif(cpu_decode.load() is None,
                                   reason="no C compiler: the CPU kernels are not built here")


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: above the single-thread cut-off
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_with_residual(rows, with_delta):
    torch.manual_seed(rows)
    res = torch.randn(rows, 96) * 3
    delta = torch.randn(rows, 96) if with_delta else None
    w = torch.rand(96) + 0.5
    expected_res = res + delta if with_delta else res.clone()
    expected = torch_rms_norm(expected_res, w, 1e-5)
    out = torch.empty_like(res)
    cpu_decode.rms_norm(res, delta, w, 1e-5, out)
    torch.testing.assert_close(res, expected_res, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_rope_rotates_q_k_and_writes_the_pool(rows):
    torch.manual_seed(rows)
    hq, hkv, d, bs, nblocks = 6, 2, 16, 4, 80
    qkv = torch.randn(rows, (hq + 2 * hkv) * d)
    pos = torch.randint(0, 500, (rows,))
    theta = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.arange(512).double()[:, None] * theta[None]
    table = torch.cat([ang.cos(), ang.sin()], -1).float()
    slots = torch.randperm(nblocks * bs - bs)[:rows] + bs  # never block 0
    k_cache = torch.zeros(nblocks, bs, hkv, d)
    v_cache = torch.zeros(nblocks, bs, hkv, d)
    # the torch path of LlamaAttention.forward
    ref = qkv.clone()
    qk = ref[:, : (hq + hkv) * d].view(rows, hq + hkv, d)
    cs = table[pos].unsqueeze(1)
    cos, sin = cs[..., : d // 2], cs[..., d // 2:]
    x1, x2 = qk[..., : d // 2], qk[..., d // 2:]
    x1_orig = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
    x2.mul_(cos).addcmul_(x1_orig, sin)
    cpu_decode.rope_write_kv(qkv, pos, table, hq, hkv, d, k_cache, v_cache, slots)
    torch.testing.assert_close(qkv, ref, rtol=1e-6, atol=1e-6)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    # the pool holds exactly the rotated k and the v of the qkv buffer
    torch.testing.assert_close(flat_k[slots], qkv[:, hq * d:(hq + hkv) * d].view(rows, hkv, d),
                               rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots], qkv[:, (hq + hkv) * d:].view(rows, hkv, d),
                               rtol=0, atol=0)
    untouched = torch.ones(nblocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


@needs_kernels
@pytest.mark.parametrize("rows", [1, 4, 256])
def test_silu_mul(rows):
    torch.manual_seed(rows)
    gu = torch.randn(rows, 2 * 80) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])
    out = torch.empty(rows, 80)
    cpu_decode.silu_mul(gu, out)
    expected = torch.nn.functional.silu(gu[:, :80]) * gu[:, 80:]
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-7)


def _mixed_step(model: torch.nn.Module, cfg: ModelConfig, bs: int = 4):
    """Two decodes and two prompt chunks (one over a cached prefix) over a fresh pool;
    returns (hidden, pool)."""
    torch.manual_seed(0)
    nblocks = 64
    pool = torch.zeros(cfg.num_layers, 2, nblocks, bs, cfg.num_kv_heads, cfg.head_dim)
    model.bind_kv_cache(pool)
    # sequences: (cached tokens, new tokens), decodes first
    seqs = [(9, 1), (21, 1), (0, 13), (6, 150)]
    free = list(range(1, nblocks))
    ids, pos, slots, tables = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop(0) for _ in range(-(-total // bs))]
        tables.append(table)
        p = torch.arange(total)
        slot = torch.tensor(table)[p // bs] * bs + p % bs
        # the cached prefix: random K/V already in the pool
        for layer in range(cfg.num_layers):
            for kv in range(2):
                pool[layer, kv].view(-1, cfg.num_kv_heads, cfg.head_dim)[slot[:cached]] = \
                    torch.randn(cached, cfg.num_kv_heads, cfg.head_dim)
        ids.append(torch.randint(0, cfg.vocab_size, (new,)))
        pos.append(p[cached:])
        slots.append(slot[cached:])
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()],
                                     dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=2, max_query_len=150, max_seq_len=156,
        query_lens_cpu=[n for _, n in seqs], seq_lens_cpu=[c + n for c, n in seqs])
    with torch.inference_mode(), forward_context(meta):
        hidden = model(torch.cat(ids), torch.cat(pos))
    return hidden, pool


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_cpu_forward_matches_torch_path(hq, hkv, d):
    cfg = ModelConfig(vocab_size=300, hidden_size=hq * d, intermediate_size=3 * d, num_layers=3,
                      num_heads=hq, num_kv_heads=hkv, head_dim=d)
    model = build_dummy_model(cfg, seed=1)
    model.use_cpu_plan(resolve_cpu_plan())
    model.cpu_kernels = True
    fast, fast_pool = _mixed_step(model, cfg)
    model.cpu_kernels = False
    ref, ref_pool = _mixed_step(model, cfg)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_pool, ref_pool, rtol=1e-5, atol=1e-5)


def test_cache_key_includes_cpu_features(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = ["-O3", "-march=native"]
    avx512 = cpu_decode.build_target("cc", flags, {"avx2", "fma", "avx512f"})
    avx2 = cpu_decode.build_target("cc", flags, {"avx2", "fma"})
    assert avx512 != avx2
    assert avx512.parent == avx2.parent == tmp_path / "bucketserve" / "kernels"
    assert cpu_decode.build_target("cc", flags, {"fma", "avx2"}) == avx2  # order-free
    assert cpu_decode.host_isa({"avx2", "fma", "avx512f"}) == 3
    assert cpu_decode.host_isa({"avx2", "fma"}) == 2
    assert cpu_decode.host_isa({"sse2"}) == 1


@needs_kernels
@pytest.mark.skipif(cpu_decode.host_isa() < 2, reason="the host has no AVX2")
def test_forced_avx2_matches_reference(tmp_path):
    """The plan with AVX2 forced (what an AVX2-only machine runs), in a process whose
    environment holds torch, oneDNN and MKL to AVX2 as `bucketserve serve --cpu-isa avx2`
    does: torch dispatches AVX2, the C kernels are the AVX2 build, and they, both packed
    GEMMs and the whole model forward give the torch reference's results; prompt attention
    is SDPA there."""
    script = textwrap.dedent("""
        import torch
        from bucketserve.kernels import cpu_decode
        from bucketserve.kernels.attention import AttentionMetadata, reference_attention
        from bucketserve.kernels.cpu_plan import (mkl_packing_available, onednn_packing_available,
                                                  resolve_cpu_plan)
        from bucketserve.models.config import ModelConfig
        from bucketserve.models.loader import build_dummy_model
        from tests.test_cpu_kernels import _mixed_step
        plan = resolve_cpu_plan("avx2")
        assert torch.backends.cpu.get_cpu_capability() == "AVX2" == plan.torch_isa
        assert plan.isa == "avx2" and plan.prefill_attention == "sdpa", plan
        info = cpu_decode.select(plan.march)
        assert info["enabled"] and info["isa"] == "avx2+fma", info
        cfg = ModelConfig(vocab_size=300, hidden_size=9 * 64, intermediate_size=3 * 64,
                          num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64)
        for gemm, ok in (("onednn", onednn_packing_available()), ("mkl", mkl_packing_available())):
            if not ok:
                continue
            model = build_dummy_model(cfg, seed=1)
            applied = model.use_cpu_plan(resolve_cpu_plan("avx2", gemm))
            assert applied.gemm == gemm and applied.c_kernels, applied
            model.cpu_kernels = True
            fast, fast_pool = _mixed_step(model, cfg)
            model.cpu_kernels = False
            ref, ref_pool = _mixed_step(model, cfg)
            torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fast_pool, ref_pool, rtol=1e-5, atol=1e-5)
            with torch.inference_mode():  # the packed GEMM alone against F.linear
                x = torch.randn(37, cfg.hidden_size)
                lin = model.model.layers[0].mlp.gate_up_proj
                torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight),
                                           rtol=1e-5, atol=1e-4)
        torch.manual_seed(0)
        for hq, hkv, d, bs in [(9, 3, 64, 16), (8, 2, 32, 16), (4, 4, 16, 4)]:
            lens = [1, 15, 16, 17, 100, 333]
            nd, width = len(lens), max(-(-n // bs) for n in lens)
            tables = (torch.randperm(nd * width) + 1).view(nd, width).to(torch.int32)
            k = torch.randn(nd * width + 1, bs, hkv, d)
            v = torch.randn_like(k)
            q = torch.randn(nd, hq, d)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(nd, dtype=torch.int64),
                query_start_loc=torch.arange(nd + 1, dtype=torch.int32),
                seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                num_decodes=nd, max_query_len=1, max_seq_len=max(lens),
                query_lens_cpu=[1] * nd, seq_lens_cpu=lens)
            out = torch.empty(nd, hq, d)
            cpu_decode.paged_decode(q, k, v, tables, meta.seq_lens, d ** -0.5, out)
            ref = reference_attention(q, k, v, meta, d ** -0.5)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        # the prefill kernel's 8-row vectors (AVX2): prompts and chunks over a cached prefix
        from bucketserve.kernels.attention import AttentionBackend
        for hq, hkv, d in [(9, 3, 64), (8, 2, 32)]:
            seqs = [(0, 1), (0, 13), (0, 40), (5, 33), (64, 17), (100, 130)]
            bs, nblocks = 16, 60
            k = torch.randn(nblocks, bs, hkv, d)
            v = torch.randn_like(k)
            perm = (torch.randperm(nblocks - 1) + 1).tolist()
            tables, at = [], 0
            for c, n in seqs:
                m = -(-(c + n) // bs)
                tables.append(perm[at:at + m])
                at += m
            width = max(map(len, tables))
            qlens, lens = [n for _, n in seqs], [c + n for c, n in seqs]
            q = torch.randn(sum(qlens), hq, d)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(len(q), dtype=torch.int64),
                query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()],
                                             dtype=torch.int32),
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables],
                                          dtype=torch.int32),
                num_decodes=0, max_query_len=max(qlens), max_seq_len=max(lens),
                query_lens_cpu=qlens, seq_lens_cpu=lens)
            backend = AttentionBackend()
            backend.c_prefill = True
            got = backend.attend(q, k, v, meta, d ** -0.5)
            ref = reference_attention(q, k, v, meta, d ** -0.5)
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
        print("ok")
    """)
    run_forced_avx2(script, tmp_path)


def test_kernels_off_by_the_plan():
    """[cpu] c_kernels = false: no C kernels (torch ops); the model's plan says so."""
    script = textwrap.dedent("""
        from bucketserve.kernels import cpu_decode as c
        from bucketserve.kernels.cpu_plan import isa_environment, resolve_cpu_plan
        from bucketserve.models.config import ModelConfig
        from bucketserve.models.loader import build_dummy_model
        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)
        plan = build_dummy_model(cfg).use_cpu_plan(resolve_cpu_plan(c_kernels=False))
        print(c.load() is None, c.build_info()["enabled"], plan.c_kernels,
              plan.prefill_attention)
    """)
    p = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["True", "False", "False", "sdpa"], p.stderr[-2000:]


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (16, 2, 128)])
@pytest.mark.parametrize("decodes", [0, 2])
def test_prefill_kernel_matches_torch_attention(hq, hkv, d, decodes):
    """Prompt chunks through the C prefill kernel (block size 16) against the SDPA path:
    whole prompts, chunks over a cached prefix, lengths off the tile and block sizes, next to
    decodes, with GQA."""
    from bucketserve.kernels.attention import AttentionBackend, reference_attention

    torch.manual_seed(hq * d + decodes)
    bs, nblocks = 16, 160
    k_cache = torch.randn(nblocks, bs, hkv, d)
    v_cache = torch.randn(nblocks, bs, hkv, d)
    seqs = [(30, 1), (100, 1)][:decodes] + [(0, 1), (0, 13), (0, 16), (5, 40), (64, 17),
                                             (0, 300), (333, 200)]
    perm = torch.randperm(nblocks - 1) + 1
    tables, at = [], 0
    for cached, new in seqs:
        n = -(-(cached + new) // bs)
        tables.append(perm[at:at + n].tolist())
        at += n
    width = max(map(len, tables))
    t = sum(n for _, n in seqs)
    # q as the model passes it: a view into a wider qkv row
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q = qkv[:, :hq * d].view(t, hq, d)
    qlens = [n for _, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(t, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()],
                                     dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32),
        num_decodes=decodes, max_query_len=max(qlens), max_seq_len=max(c + n for c, n in seqs),
        query_lens_cpu=qlens, seq_lens_cpu=[c + n for c, n in seqs])
    scale = d ** -0.5
    ref = reference_attention(q, k_cache, v_cache, meta, scale)
    backend = AttentionBackend()
    backend.c_prefill = True  # the C kernel whatever "auto" picks on this machine
    assert cpu_decode.prefill_supported(q, k_cache)
    got = backend.attend(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
