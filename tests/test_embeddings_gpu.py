"""Embeddings on a CUDA GPU: every captured (batch, length) graph, with padding rows, and the
eager fallback above the largest captured size, against sentence-transformers in float32
(float16: cosine >= 0.9999 for every row; bfloat16, whose 8-bit mantissa cannot promise that:
sentence-transformers' own bfloat16 accuracy on the same rows, within 1e-4 (H200: ours 0.999713,
theirs 0.999721 at the worst row)); and texts through the batcher as the server builds it.
CUDA only."""

from __future__ import annotations

import asyncio
import copy
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import minilm_dir

from bench.embeddings_gpu import embed_texts
from bucketserve.buckets import load_buckets
from bucketserve.engine.embedding_batcher import build_batcher
from bucketserve.engine.embedding_runner import CudaGraphRunner
from bucketserve.models.bert_loader import load_embedding_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MIN_COSINE = 0.9999


def corpus(n: int, seed: int) -> list[str]:
    """n texts of 8..250 random in-vocabulary words (as bench/embeddings_gpu.py's corpus)."""
    with open(minilm_dir() / "vocab.txt", encoding="utf-8") as f:
        words = [w.strip() for w in f]
    words = [w for w in words if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 250))) for _ in range(n)]


@pytest.fixture(scope="module")
def st32():
    from sentence_transformers import SentenceTransformer

    # float32 whatever the weights file holds (transformers loads a file's own dtype)
    return SentenceTransformer(str(minilm_dir()), device="cuda").float()


def load(dtype: str):
    return load_embedding_model("all-minilm-l6-v2", device="cuda", dtype=getattr(torch, dtype))


def st_reference(st, rows: list[list[int]]) -> torch.Tensor:
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    with torch.no_grad():
        out = st({"input_ids": ids.cuda(), "attention_mask": mask.cuda(),
                  "token_type_ids": torch.zeros_like(ids).cuda()})
    return out["sentence_embedding"].float().cpu()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_captured_shape_and_the_eager_fallback(dtype, st32):
    loaded = load(dtype)
    buckets = load_buckets().check_model(embedding_max_len=loaded.max_seq_length)
    spec = buckets.embedding.spec
    sizes = (1, 2, 4, 16, 64)
    runner = CudaGraphRunner(loaded.model, spec, sizes, lambda L: 100, 0, "cuda")
    report = runner.capture()
    assert report.num_graphs == len(spec) * len(sizes) == len(runner.graphs)
    rng = random.Random(0)
    pools, refs = {}, {}
    for i, L in enumerate(spec.boundaries):
        low, _, high = spec.profile(i)
        pools[L] = [[101] + [rng.randint(1000, 29000)
                             for _ in range(rng.randint(max(low, 3), high) - 2)] + [102]
                    for _ in range(100)]
        refs[L] = st_reference(st32, pools[L])
    worst = 1.0
    for B, L in runner.shapes:
        n = B - 1 if B > 2 else B  # a padding row wherever that still rounds up to B
        assert runner.padded_rows(n, L) == B
        out = runner.collect(runner.launch(pools[L][:n], L))
        cos = torch.nn.functional.cosine_similarity(torch.from_numpy(out), refs[L][:n])
        worst = min(worst, cos.min().item())
    assert runner.num_graph_batches == len(runner.shapes) and runner.num_eager_batches == 0
    for L in spec.boundaries:  # 100 rows > 64: eager, no padding rows
        assert runner.padded_rows(100, L) == 100
        out = runner.collect(runner.launch(pools[L], L))
        cos = torch.nn.functional.cosine_similarity(torch.from_numpy(out), refs[L])
        worst = min(worst, cos.min().item())
    assert runner.num_eager_batches == len(spec)
    floor = MIN_COSINE
    if dtype == "bfloat16":  # sentence-transformers' own bfloat16 on the same rows
        # a copy: casting the shared float32 fixture to bfloat16 and back would leave its
        # weights rounded to bfloat16, and every later test would compare against that
        st16 = copy.deepcopy(st32).to(torch.bfloat16)
        st_bf16 = min(torch.nn.functional.cosine_similarity(
            st_reference(st16, pools[L]), refs[L]).min().item()
            for L in spec.boundaries)
        del st16
        floor = min(MIN_COSINE, st_bf16 - 1e-4)
        print(f"sentence-transformers bfloat16: worst cosine {st_bf16:.6f}")
    print(f"{dtype}: worst cosine {worst:.6f} over {len(runner.shapes)} graphs + eager")
    assert worst >= floor


def test_texts_through_the_batcher_match_st(st32):
    loaded = load("float16")
    texts = corpus(3000, seed=1)
    buckets = load_buckets().check_model(embedding_max_len=loaded.max_seq_length)
    # fewer graph sizes than the default: capture time (the bench runs the default)
    buckets = replace(buckets, embedding=replace(buckets.embedding, batch_sizes=(1, 4, 16, 64)))
    batcher = build_batcher(loaded.model, loaded.config.pad_token_id, buckets)

    async def go():
        batcher.start()
        try:
            return await embed_texts(batcher, loaded.tokenizer.encode_batch, texts, 512)
        finally:
            await batcher.shutdown()

    got = torch.from_numpy(np.stack(asyncio.run(go())))
    ref = st32.encode(texts, batch_size=128, convert_to_tensor=True).float().cpu()
    cos = torch.nn.functional.cosine_similarity(got, ref)
    assert cos.min().item() >= MIN_COSINE
    stats = batcher.stats
    assert stats.num_inputs == len(texts)
    runner = batcher.runner
    assert runner.num_graph_batches > 0
    print(f"padding waste {stats.padding_waste:.4f}, batches {stats.num_batches}, graph "
          f"{runner.num_graph_batches}, eager {runner.num_eager_batches}")
