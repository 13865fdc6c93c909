"""Piecewise forward (kernels/cuda_graphs.PiecewiseGraphs): the fused forward split at each
layer's attention, run over padded static buffers, gives the model's forward for the real
rows and writes exactly the same K/V into the pool. On CPU the stages run eagerly (the graph
capture itself is tested on the GPU in tests/test_cuda_graphs_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

from bucketserve.buckets import load_buckets
from bucketserve.kernels.attention import forward_context
from bucketserve.kernels.cuda_graphs import PiecewiseGraphs
from bucketserve.models.config import ModelConfig
from bucketserve.models.loader import build_dummy_model
from tests.test_runner_inputs import BS, make_batch, step_inputs

VOCAB = 5000


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=1024,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_ids=(2,))
    return build_dummy_model(cfg, device, dtype, seed=3)


CASES = [
    (5, [(40, 0), (250, 100)]),   # mixed: decodes + a prompt + a chunk over a cached prefix
    (0, [(300, 0), (7, 0)]),      # prefill only
    (12, []),                      # decodes only (above the decode graphs, say)
]
# cuBLAS may pick another GEMM for the padded row count: equal to rounding, not bit for bit
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}


def check_piecewise(num_decodes: int, prefills: list, device: str, dtype: torch.dtype,
                    capture: bool) -> None:
    rng = random.Random(num_decodes)
    model = tiny_model(device, dtype)
    cfg = model.config
    pool = torch.zeros(cfg.num_layers, 2, 2000, BS, cfg.num_kv_heads, cfg.head_dim,
                       device=device, dtype=dtype)
    model.bind_kv_cache(pool)
    batch = make_batch(rng, num_decodes, prefills)
    ids, pos, meta = step_inputs(batch, device)
    n = ids.shape[0]
    # the K/V already in the pool (cached prefixes, decode contexts): random, the same for both
    pool.normal_()
    before = pool.clone()
    with torch.inference_mode(), forward_context(meta):
        want_plain = model(ids, pos) if device == "cpu" else None  # module by module (CPU)
        want = model._forward_fused(ids, pos)  # the stages, unpadded
    kv_want = pool.clone()
    if want_plain is not None:
        torch.testing.assert_close(want, want_plain, rtol=1e-5, atol=1e-5)

    pw = PiecewiseGraphs(model, load_buckets().piecewise_token_counts(512), device, capture=capture)
    if capture:
        stats = pw.capture()
        assert stats.num_graphs == len(pw.sizes) * (cfg.num_layers + 1)
    t = pw.padded_size(n)
    assert t is not None and t >= n
    # padding rows: stale but valid ids and positions (as the runner's buffers hold)
    pw.input_ids[:t] = torch.randint(0, VOCAB, (t,), device=device)
    pw.positions[:t] = torch.randint(0, cfg.max_position_embeddings, (t,), device=device)
    pw.input_ids[:n] = ids
    pw.positions[:n] = pos
    pw.o.normal_()  # stale attention outputs in the padding rows must stay harmless
    pool.copy_(before)
    with torch.inference_mode(), forward_context(meta):
        got = pw.run(t, n)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the same slots written (padding rows write none), with the same values up to the
    # rounding of a matmul over more rows
    assert torch.equal(pool != before, kv_want != before), "padding rows reached the pool"
    assert (kv_want != before).any()
    torch.testing.assert_close(pool, kv_want, **TOL[dtype])


@pytest.mark.parametrize("num_decodes, prefills", CASES)
def test_piecewise_equals_forward_and_writes_same_kv(num_decodes, prefills):
    check_piecewise(num_decodes, prefills, "cpu", torch.float32, capture=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_decodes, prefills", CASES)
def test_piecewise_graphs_replay_equals_forward(num_decodes, prefills, dtype):
    check_piecewise(num_decodes, prefills, "cuda", dtype, capture=True)


def test_run_rejects_sizes_it_does_not_have():
    model = tiny_model()
    pw = PiecewiseGraphs(model, [16, 64], "cpu", capture=False)
    assert pw.padded_size(17) == 64 and pw.padded_size(65) is None
    with pytest.raises(ValueError, match="no piecewise size"):
        pw.run(32, 10)
    with pytest.raises(ValueError, match="no piecewise size"):
        pw.run(16, 17)
    with pytest.raises(ValueError, match="positive"):
        PiecewiseGraphs(model, [], "cpu", capture=False)
