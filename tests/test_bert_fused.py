"""The BERT encoder's fused ops (kernels/bert_ops.py, kernels/triton_bert.py) on the CPU: the
Triton add + LayerNorm kernel under Triton's interpreter against its torch oracle, and the
encoder with the fused path switched on against the plain layers (on the CPU the fused path
runs the torch versions, so this checks the wiring; tests/test_embeddings_gpu.py checks the
CUDA kernels against sentence-transformers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bucketserve.kernels import bert_ops
from bucketserve.models.bert import BertConfig, BertEmbeddingModel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [384, 100])
def test_add_layer_norm_kernel_matches_torch(dtype, hidden):
    from triton_interp import interpreted_triton

    interpreted_triton()
    from bucketserve.kernels import triton_bert

    torch.manual_seed(0)
    x = torch.randn(7, hidden).to(dtype)
    r = (3 * torch.randn(7, hidden)).to(dtype)
    w, b = torch.randn(hidden).to(dtype), torch.randn(hidden).to(dtype)
    got = triton_bert.add_layer_norm(x, r, w, b, 1e-12)
    # the oracle in float32 from the same dtype-rounded sum (the CPU has no float16 LayerNorm
    # kernel of the GPU's kind; both compute in float32 inside)
    want = F.layer_norm((x + r).float(), (hidden,), w.float(), b.float(), 1e-12)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # a strided residual (a view into a wider buffer) is read by its row stride
    wide = torch.zeros(7, hidden + 16, dtype=dtype)
    wide[:, :hidden] = r
    torch.testing.assert_close(triton_bert.add_layer_norm(x, wide[:, :hidden], w, b, 1e-12), got)
    with pytest.raises(ValueError, match="unit column stride"):
        triton_bert.add_layer_norm(x.t().contiguous().t(), r, w, b, 1e-12)


def tiny(act: str) -> BertEmbeddingModel:
    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                     intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                     layer_norm_eps=1e-12, hidden_act=act, pad_token_id=0)
    model = BertEmbeddingModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_fused_path_computes_what_the_plain_layers_do(act):
    model = tiny(act)
    ids = torch.randint(1, 100, (3, 9))
    lengths = torch.tensor([9, 4, 1])
    want = model.embed_lengths(ids, lengths)
    model.use_fused_kernels()
    layer = model.encoder.layers[0]
    assert layer.fused_add_norm
    assert layer.gelu_epilogue == (act == "gelu_pytorch_tanh")  # only where it is exact
    torch.testing.assert_close(model.embed_lengths(ids, lengths), want, rtol=1e-6, atol=1e-6)
    model.use_fused_kernels(add_norm=False, gelu_epilogue=False)
    assert not layer.fused_add_norm and not layer.gelu_epilogue
    torch.testing.assert_close(model.embed_lengths(ids, lengths), want, rtol=0, atol=0)


def test_epilogue_gelu_is_the_tanh_gelu_off_cuda():
    torch.manual_seed(2)
    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    got = bert_ops.linear_gelu(x, w, b)
    torch.testing.assert_close(got, F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert not torch.allclose(got, F.gelu(F.linear(x, w, b)), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ CUDA (skipped without one)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_add_layer_norm_matches_torch(dtype):
    from bucketserve.kernels import triton_bert

    torch.manual_seed(0)
    x = torch.randn(300, 384, device="cuda").to(dtype)
    r = (3 * torch.randn(300, 384, device="cuda")).to(dtype)
    w = torch.randn(384, device="cuda").to(dtype)
    b = torch.randn(384, device="cuda").to(dtype)
    got = triton_bert.add_layer_norm(x, r, w, b, 1e-12)
    want = bert_ops.add_layer_norm_torch(x, r, w, b, 1e-12)
    tol = 1e-2 if dtype == torch.float16 else 4e-2  # one rounding of the output apart
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@cuda
@pytest.mark.gpu
def test_fused_minilm_matches_sentence_transformers_fp32():
    from conftest import minilm_dir
    from sentence_transformers import SentenceTransformer

    from bucketserve.models.bert_loader import load_embedding_model

    model = load_embedding_model("all-minilm-l6-v2", device="cuda", dtype=torch.float16).model
    model.use_fused_kernels()  # add + LayerNorm fused; the erf GELU stays exact
    st = SentenceTransformer(str(minilm_dir()), device="cuda").float()
    g = torch.Generator().manual_seed(3)
    for B, L in ((1, 16), (7, 64), (64, 256)):
        ids = torch.randint(1000, 29000, (B, L), generator=g)
        ids[:, 0] = 101
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
        got = model.embed_lengths(ids.cuda(), lengths.cuda())
        with torch.no_grad():
            want = st({"input_ids": ids.cuda(), "attention_mask": mask.cuda(),
                       "token_type_ids": torch.zeros_like(mask).cuda()})["sentence_embedding"]
        cos = F.cosine_similarity(got.float(), want.float(), dim=-1)
        assert cos.min().item() >= 0.9999, (B, L, cos.min().item())
