"""DecodeGraphs (kernels/cuda_graphs.py): graph replay equals the eager forward, with padded
and unpadded batch sizes, and dummy rows touch nothing but the dummy block 0. CUDA only."""

from __future__ import annotations

import math

import pytest
import torch

from bucketserve.kernels.attention import AttentionMetadata, forward_context

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAGE = 16
NUM_BLOCKS = 400
# eager and graph runs share kernels (fixed split count) but cuBLAS may pick another GEMM
# for the padded row count, so results agree to rounding, not bit for bit
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}


def decode_meta(lens: list[int], gen: torch.Generator) -> AttentionMetadata:
    pages = [math.ceil(n / PAGE) for n in lens]
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    slots = []
    for i, (n, p) in enumerate(zip(lens, pages, strict=True)):
        tables[i, :p] = torch.tensor(perm[:p], dtype=torch.int32)
        perm = perm[p:]
        slots.append(int(tables[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), num_decodes=len(lens), max_query_len=1,
        max_seq_len=max(lens), query_lens_cpu=[1] * len(lens), seq_lens_cpu=list(lens))


def host_buffers(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, rows: int,
                 width: int) -> tuple[torch.Tensor, ...]:
    """The step's inputs as the runner's pinned host buffers hold them: `rows` long (rows
    past the step hold junk a load must not read), tables `width` wide."""
    n = ids.shape[0]

    def buf(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.full(shape, 7, dtype=x.dtype).pin_memory()
        out[tuple(slice(0, d) for d in x.shape)] = x.cpu()
        return out

    assert rows > n
    return (buf(ids, (rows,)), buf(pos, (rows,)), buf(meta.slot_mapping, (rows,)),
            buf(meta.seq_lens, (rows,)), buf(meta.block_tables, (rows, width)))


@needs_cuda
@pytest.mark.parametrize("via", ["run", "load"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_graphs_match_eager(dtype, via):
    """`run` (device tensors copied in) and `load` + `replay` (the runner's pinned host
    buffers copied straight into the static inputs) both replay what eager computes."""
    pytest.importorskip("triton")
    from bucketserve.kernels.cuda_graphs import DecodeGraphs
    from bucketserve.kernels.triton_attention import TritonAttentionBackend
    from bucketserve.models.config import ModelConfig
    from bucketserve.models.loader import build_dummy_model

    cfg = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)
    backend = TritonAttentionBackend(decode_splits=3)  # same kernels eager and in graphs
    model = build_dummy_model(cfg, "cuda", dtype, attn_backend=backend, seed=0)
    kv = torch.randn(cfg.num_layers, 2, NUM_BLOCKS, PAGE, cfg.num_kv_heads, cfg.head_dim,
                     device="cuda", dtype=dtype)
    model.bind_kv_cache(kv)
    graphs = DecodeGraphs(model, [1, 2, 4, 8], max_blocks_per_seq=32, max_seq_len=512,
                          device="cuda")
    stats = graphs.capture()
    assert stats.num_graphs == 4 and stats.seconds > 0
    assert graphs.padded_size(5) == 8 and graphs.padded_size(9) is None

    gen = torch.Generator().manual_seed(0)
    # padded, full, smallest, padded after a full step, shrinking
    for n in [3, 8, 1, 5, 2]:
        lens = torch.randint(1, 500, (n,), generator=gen).tolist()
        meta = decode_meta(lens, gen)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).cuda()
        pos = torch.tensor(lens, device="cuda") - 1
        kv_before = kv.clone()
        with torch.inference_mode(), forward_context(meta):
            want = model(ids, pos).clone()
            want_tokens = model.compute_logits(want).argmax(-1)
        kv_eager = kv.clone()
        kv.copy_(kv_before)
        if via == "run":
            got = graphs.run(ids, pos, meta).clone()
        else:
            loaded = graphs.load(n, *host_buffers(ids, pos, meta, 12, 32))
            assert torch.equal(loaded, ids)
            got = graphs.replay(n).clone()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL[dtype])
        if dtype == torch.float32:
            with torch.inference_mode():
                assert torch.equal(model.compute_logits(got).argmax(-1), want_tokens)
        # K/V of the real slots as eager wrote them; dummy rows wrote only into block 0
        torch.testing.assert_close(kv[:, :, 1:], kv_eager[:, :, 1:], **TOL[dtype])


@needs_cuda
def test_decode_graphs_refuse_prefill_steps():
    pytest.importorskip("triton")
    from bucketserve.kernels.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(torch.nn.Identity(), [1, 2], max_blocks_per_seq=4, max_seq_len=64,
                          device="cuda")
    meta = decode_meta([5, 7], torch.Generator().manual_seed(1))
    meta.num_decodes = 1  # the second sequence is a prefill
    with pytest.raises(ValueError, match="eagerly"):
        graphs.run(torch.zeros(2, dtype=torch.long, device="cuda"),
                   torch.zeros(2, dtype=torch.long, device="cuda"), meta)
