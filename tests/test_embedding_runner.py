"""CudaGraphRunner's shape selection and padding rows, on CPU (no CUDA: every shape that would
be a graph runs eagerly at its padded size), against sentence-transformers in float32; and the
whole-batch base64 encoding of the response."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import torch
from conftest import minilm_dir

from bucketserve.buckets import BucketSpec
from bucketserve.engine.embedding_runner import CudaGraphRunner, fill_rows, graph_shapes
from bucketserve.models.bert_loader import load_embedding_model

MIN_COSINE = 0.9999


def test_graph_shapes_cover_each_bucket_up_to_its_full_batch():
    spec = BucketSpec((8, 64, 256))
    shapes = graph_shapes(spec, (1, 2, 4, 8, 16), lambda L: 1024 // L)  # caps 128, 16, 4
    assert sorted(shapes) == sorted([(b, 8) for b in (1, 2, 4, 8, 16)]
                                    + [(b, 64) for b in (1, 2, 4, 8, 16)]
                                    + [(b, 256) for b in (1, 2, 4)])
    assert shapes[0] == (4, 256) and shapes[-1] == (1, 8)  # largest B x L first
    # a capacity between sizes rounds up: cap 3 needs the 4-row graph
    assert sorted(graph_shapes(BucketSpec((32,)), (1, 2, 4, 8), lambda L: 3)) == [
        (1, 32), (2, 32), (4, 32)]


def test_fill_rows_layout():
    buf = np.full((4, 1 + 5), -7, dtype=np.int32)
    fill_rows(buf, [[5, 6, 7], [9]], pad_id=0)
    assert buf.tolist() == [[3, 5, 6, 7, 0, 0], [1, 9, 0, 0, 0, 0],
                            [1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]  # padding rows: length 1


@pytest.fixture(scope="module")
def minilm():
    return load_embedding_model("all-minilm-l6-v2")


def st_reference(rows: list[list[int]]) -> torch.Tensor:
    """sentence-transformers float32 on exactly these token ids."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir()), device="cpu").float()
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    with torch.no_grad():
        out = st({"input_ids": ids, "attention_mask": mask,
                  "token_type_ids": torch.zeros_like(ids)})
    return out["sentence_embedding"]


def random_rows(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[101] + [rng.randint(1000, 29000) for _ in range(rng.randint(low, high) - 2)] + [102]
            for _ in range(n)]


def test_padded_rows_and_eager_fallback_match_sentence_transformers(minilm):
    spec = BucketSpec((16, 48))
    runner = CudaGraphRunner(minilm.model, spec, (1, 2, 4), lambda L: 6, 0, "cpu")
    rows = {16: random_rows(6, 3, 16, seed=1), 48: random_rows(6, 17, 48, seed=2)}
    refs = {L: st_reference(r) for L, r in rows.items()}
    # (rows, length) -> rows computed: 3 -> graph 4 (one padding row), 2 -> 2, 5 and 6 -> eager
    for n, padded in ((1, 1), (2, 2), (3, 4), (5, 5), (6, 6)):
        for L in (16, 48):
            assert runner.padded_rows(n, L) == padded
            before = (runner.num_graph_batches, runner.num_eager_batches)
            ticket = runner.launch(rows[L][:n], L)
            assert (ticket.rows, ticket.padded_rows) == (n, padded)
            out = runner.collect(ticket)
            assert out.shape == (n, minilm.model.embedding_dim) and out.dtype == np.float32
            graph = padded <= 4
            assert (runner.num_graph_batches - before[0], runner.num_eager_batches - before[1]) \
                == ((1, 0) if graph else (0, 1))
            cos = torch.nn.functional.cosine_similarity(torch.from_numpy(out), refs[L][:n])
            assert cos.min().item() >= MIN_COSINE, (n, L, cos)


@pytest.mark.parametrize("dim", [384, 5, 1024])
def test_base64_rows_equal_per_row_encoding(dim):
    from bucketserve.server.embeddings import base64_rows_bytes

    mat = np.random.default_rng(dim).standard_normal((7, dim)).astype(np.float32)
    got = [row.decode("ascii") for row in base64_rows_bytes(mat)]
    assert got == [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in mat]
    assert np.array_equal(np.frombuffer(base64.b64decode(got[3]), dtype="<f4"), mat[3])


def test_function_runner_trims_an_eager_batch_to_its_longest_row():
    from bucketserve.engine.embedding_runner import FunctionRunner

    seen: list[tuple[int, int]] = []

    def encode(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(ids.shape))
        # a masked mean of the ids: padding columns must not change a row's result
        return ((ids * mask).sum(1) / mask.sum(1)).float()[:, None]

    rows = [[5, 6, 7], [9], [1, 2, 3, 4, 5]]
    plain, trimmed = FunctionRunner(encode), FunctionRunner(encode, trim=True)
    a = plain.collect(plain.launch(rows, 16))
    t = trimmed.launch(rows, 16)
    b = trimmed.collect(t)
    assert seen == [(3, 16), (3, 5)]  # the bucket length, then the longest row
    assert t.length == 5 and t.rows == t.padded_rows == 3
    np.testing.assert_array_equal(a, b)


def test_trimmed_cpu_batches_match_sentence_transformers_and_count_what_they_compute():
    from sentence_transformers import SentenceTransformer

    from bucketserve.engine.embedding_batcher import BatcherStats
    from bucketserve.engine.embedding_runner import FunctionRunner

    loaded = load_embedding_model(str(minilm_dir()))
    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = ["a short one", "a rather longer sentence about buckets and padding on the CPU",
             "mid length text here"]
    rows = [loaded.tokenizer.encode(t) for t in texts]
    runner = FunctionRunner(loaded.model, trim=True)
    with torch.inference_mode():
        t = runner.launch(rows, 64)
        got = runner.collect(t)
    ref = st.encode(texts, convert_to_numpy=True)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= MIN_COSINE
    assert t.length == max(len(r) for r in rows) < 64
    stats = BatcherStats()
    stats.record_batch(64, [len(r) for r in rows], [0.0] * 3, False, t)
    assert stats.computed_tokens == 3 * t.length and stats.batches_per_bucket == {64: 1}
