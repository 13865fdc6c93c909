"""Torch versions of the fused ops (kernels/triton_ops.py) vs the Hugging Face Llama modules.

These torch versions are the oracle for the Triton kernels (tests/test_kernels_gpu.py), so
they must round where transformers rounds. Runs on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
LlamaConfig = pytest.importorskip("transformers").LlamaConfig

from bucketserve.kernels import triton_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def tiny_config(**kw) -> LlamaConfig:
    return LlamaConfig(hidden_size=96, intermediate_size=160, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       max_position_embeddings=512, hidden_act="silu", **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_hf(dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    cfg = tiny_config()
    norm = modeling_llama.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cfg.hidden_size, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(7, cfg.hidden_size, generator=gen).to(dtype)
    res = torch.randn(7, cfg.hidden_size, generator=gen).to(dtype) if with_residual else None
    got, new_res = triton_ops.rms_norm(x, norm.weight, cfg.rms_norm_eps, res)
    h = x + res if with_residual else x
    with torch.no_grad():
        want = norm(h)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if with_residual:
        torch.testing.assert_close(new_res, h, rtol=0, atol=0)
    else:
        assert new_res is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64}])
def test_rotary_matches_hf(dtype, rope_scaling):
    gen = torch.Generator().manual_seed(2)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling is not None:
        params = {**rope_scaling, "rope_theta": 500000.0}
    cfg = tiny_config(rope_parameters=params)
    rope = modeling_llama.LlamaRotaryEmbedding(cfg)
    t = 9
    positions = torch.randint(0, 512, (t,), generator=gen)
    q = torch.randn(t, 6, 16, generator=gen).to(dtype)
    k = torch.randn(t, 2, 16, generator=gen).to(dtype)
    cos, sin = rope(q, positions[None, :])  # [1, T, D]
    # HF layout: [B, H, T, D]
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None],
                                                         k.transpose(0, 1)[None], cos, sin)
    cache = triton_ops.cos_sin_cache(rope.inv_freq, 512, rope.attention_scaling)
    got_q, got_k = triton_ops.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_hf_mlp_activation(dtype):
    gen = torch.Generator().manual_seed(3)
    cfg = tiny_config()
    mlp = modeling_llama.LlamaMLP(cfg)
    gate = torch.randn(5, cfg.intermediate_size, generator=gen).to(dtype)
    up = torch.randn(5, cfg.intermediate_size, generator=gen).to(dtype)
    got = triton_ops.silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(got, mlp.act_fn(gate) * up, rtol=0, atol=0)
