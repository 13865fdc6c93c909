"""Our BERT encoder + pooling vs sentence-transformers (the oracle), in many batch compositions.

Every input's vector must have cosine >= 0.9999 with SentenceTransformer(dir).encode's vector,
whether it is encoded alone, with all others in one request, or in concurrent requests spread
over differently-sized buckets and batches.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import minilm_dir

from bucketserve.engine.embedding_batcher import EmbeddingBatcher
from bucketserve.engine.embedding_runner import FunctionRunner
from bucketserve.models.bert_loader import load_embedding_model

MIN_COSINE = 0.9999


def corpus(n: int, seed: int) -> list[str]:
    """n texts of 8..250 random in-vocabulary words (as bench/embeddings_gpu.py's corpus)."""
    with open(minilm_dir() / "vocab.txt", encoding="utf-8") as f:
        words = [w.strip() for w in f]
    words = [w for w in words if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 250))) for _ in range(n)]


@pytest.fixture(scope="module")
def ours():
    return load_embedding_model("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")


def _text_of_length(tokenizer, n: int, seed: int) -> str:
    """A text of exactly n word pieces (specials included), drawn from the vocabulary."""
    rng = random.Random(seed)
    words = [w for w in tokenizer._tok.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    words.sort()
    text = ""
    while True:
        candidate = (text + " " + rng.choice(words)).strip()
        if len(tokenizer.encode(candidate)) > n:
            break
        text = candidate
    while len(tokenizer.encode(text)) < n:  # pad with single-piece tokens
        text += " a"
    assert len(tokenizer.encode(text)) == n
    return text


@pytest.fixture(scope="module")
def mixed_texts(ours) -> list[str]:
    tok = ours.tokenizer
    texts = [
        "a",  # one word piece
        "Hello world!",
        "Der schnelle braune Fuchs springt über den faulen Hund.",
        "Le café est très bon, n'est-ce pas ? Ça dépend.",
        "东京は日本の首都です。北京是中国的首都。",
        "Привет, как дела? Всё хорошо.",
        "مرحبا بالعالم",
        "नमस्ते दुनिया",
        "🚀🎉 emoji party 👩‍👩‍👧‍👦 ✨",
        "   leading and trailing spaces   ",
        "Numbers 3.14159 and symbols #$%&*()!",
    ]
    texts += [_text_of_length(tok, n, seed=n) for n in (15, 16, 17, 33, 64, 100, 129, 200, 255, 256)]
    return texts


@pytest.fixture(scope="module")
def reference(st_model, mixed_texts) -> torch.Tensor:
    return torch.from_numpy(st_model.encode(mixed_texts, batch_size=32))


def _check(got: list[torch.Tensor], ref: torch.Tensor, texts: list[str]) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        cos = F.cosine_similarity(g.float(), r, dim=0).item()
        assert cos >= MIN_COSINE, f"input {i} ({texts[i][:30]!r}): cosine {cos}"


def test_tokenization_matches_sentence_transformers(ours, st_model, mixed_texts):
    lengths = [len(ours.tokenizer.encode(t)) for t in mixed_texts]
    assert min(lengths) == 3 and max(lengths) == 256  # 1 word piece .. max_seq_length
    ref = st_model.tokenizer(mixed_texts, truncation=True, max_length=256)["input_ids"]
    assert ours.tokenizer.encode_batch(mixed_texts) == ref
    assert ours.max_seq_length == st_model.max_seq_length == 256


ASCII_EDGE_CASES = [
    "Plain ASCII, Mixed CASE and punctuation: (a) [b] {c}!?",
    "tabs\tnewlines\nreturns\r and  double  spaces",
    "control \x00 \x07 \x1b[31m chars \x7f removed by clean_text",
    "vertical\x0btab and form\x0cfeed",
    "[CLS] [SEP] [MASK] [PAD] [UNK] as text, and [mask] [cls] lower-case",
    "a" * 150 + " over-long word, " + "supercalifragilisticexpialidocious" * 3,
    "don't stop-believing; it's 3.14159 o'clock @home #1 $5 ~tilde `tick`",
    "café naïve déjà vu",  # not ASCII: the full tokenizer
    "   ",
    "x",
]


def fast_text(tok, text: str) -> str | None:
    """The text the fast path encodes for `text` alone, or None (the full tokenizer)."""
    return (tok._fast_texts([text]) or [None])[0]


def test_ascii_fast_path_gives_the_full_tokenizers_ids(ours, mixed_texts):
    from tokenizers import Tokenizer

    tok = ours.tokenizer
    assert tok._plain is not None  # MiniLM's BertNormalizer: the fast path is on
    full = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    full.no_padding()
    full.no_truncation()
    texts = ASCII_EDGE_CASES + mixed_texts + corpus(300, seed=7)
    assert sum(fast_text(tok, t) is not None for t in texts) > 300  # most take it
    assert fast_text(tok, "[MASK] x") is None and fast_text(tok, "caf\u00e9") is None
    assert tok.encode_batch(texts) == [e.ids for e in full.encode_batch(texts)]
    # each alone (all-fast and all-full batches) and truncated
    for t in ASCII_EDGE_CASES:
        assert tok.encode(t) == full.encode(t).ids, t
    full.enable_truncation(16)  # the tokenizer's own truncation: the reference
    assert tok.encode_batch(texts, max_length=16) == [e.ids for e in full.encode_batch(texts)]


def test_whole_chunk_check_takes_the_fast_path_only_when_every_text_would(ours):
    from tokenizers import Tokenizer

    tok = ours.tokenizer
    full = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    full.no_padding()
    full.no_truncation()
    clean = corpus(50, seed=3) + ["Mixed CASE (a) {b}!", "tabs\tand\nnewlines", "x"]
    assert tok._fast_texts(clean) == [fast_text(tok, t) for t in clean]
    for odd in ASCII_EDGE_CASES + ["nul\x00inside", "a [b] c", "[SEP]", "x [mask] y"]:
        chunk = clean[:10] + [odd] + clean[10:20]
        per_text = [fast_text(tok, t) for t in chunk]
        joined = tok._fast_texts(chunk)
        # all or nothing: a chunk with any text the fast path must not take falls back
        assert joined == (per_text if None not in per_text else None), odd
        assert tok.encode_batch(chunk) == [e.ids for e in full.encode_batch(chunk)], odd


def test_tokenizer_processes_give_the_same_ids(ours):
    from bench.embeddings_gpu import TokenizerProcesses, encode_packed, unpack

    texts = ASCII_EDGE_CASES + corpus(200, seed=5)
    want = ours.tokenizer.encode_batch(texts)
    flat, lengths = encode_packed(ours.tokenizer, texts)
    assert [v.tolist() for v in unpack(flat, lengths)] == want
    with TokenizerProcesses(ours.tokenizer, 2, threads=1) as procs:
        got = procs.encode_batch(texts)
        assert [v.dtype for v in got[:1]] == [np.int32]
        assert [v.tolist() for v in got] == want
        trunc = procs.encode_batch(texts, max_length=16)
        assert [v.tolist() for v in trunc] == ours.tokenizer.encode_batch(texts, max_length=16)


def test_truncation_matches_sentence_transformers(ours, st_model):
    text = "word " * 400
    ids = ours.tokenizer.encode_batch([text], max_length=256)[0]
    assert ids == st_model.tokenizer([text], truncation=True, max_length=256)["input_ids"][0]
    L = len(ids)
    got = ours.model(torch.tensor([ids]), torch.ones(1, L, dtype=torch.bool))[0]
    ref = torch.from_numpy(st_model.encode([text]))[0]
    assert F.cosine_similarity(got, ref, dim=0).item() >= MIN_COSINE


def test_each_input_alone(ours, mixed_texts, reference):
    got = []
    for ids in ours.tokenizer.encode_batch(mixed_texts):
        L = len(ids)
        got.append(ours.model(torch.tensor([ids]), torch.ones(1, L, dtype=torch.bool))[0])
    _check(got, reference, mixed_texts)


def test_packed_projections_equal_plain_ones(ours, mixed_texts):
    """The loader lets the projections use MKL's packed sgemm on CPU for forwards of at most
    PACKED_MAX_ROWS tokens; the plain F.linear path (packed weights removed) gives the same
    vectors, on both sides of that limit."""
    from bucketserve.models.bert import NO_ROW_LIMIT, PACKED_MAX_ROWS
    from bucketserve.models.llama import Linear, packed_gemm_backend

    linears = [m for m in ours.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * ours.config.num_layers
    backend = packed_gemm_backend()
    if backend is None:
        pytest.skip("this torch build has no packed sgemm")
    assert all(m.packed is not None for m in linears)
    # MKL's packed sgemm only up to PACKED_MAX_ROWS tokens; oneDNN's for every forward
    limit = PACKED_MAX_ROWS if backend == "mkl" else NO_ROW_LIMIT
    assert backend in ("mkl", "onednn") and all(m.max_packed_rows == limit for m in linears)
    for texts in (mixed_texts[-1:], mixed_texts[-4:]):  # 1 x 256 and 4 x 256 tokens
        token_ids = ours.tokenizer.encode_batch(texts)
        L = max(map(len, token_ids))
        ids = torch.tensor([t + [0] * (L - len(t)) for t in token_ids])
        mask = torch.tensor([[i < len(t) for i in range(L)] for t in token_ids])
        assert (ids.numel() <= PACKED_MAX_ROWS) == (len(texts) == 1)
        packed = ours.model(ids, mask)
        saved = [m.packed for m in linears]
        try:
            for m in linears:
                m.packed = None
            plain = ours.model(ids, mask)
        finally:
            for m, p in zip(linears, saved, strict=True):
                m.packed = p
        assert F.cosine_similarity(packed, plain, dim=1).min().item() >= 0.999999


def _batched(ours, token_ids, groups, **batcher_kw) -> list[torch.Tensor]:
    """Run `groups` (lists of input indices) as concurrent requests through a batcher."""

    async def run():
        batcher = EmbeddingBatcher(FunctionRunner(ours.model, 0), **batcher_kw)
        batcher.start()
        try:
            results = await asyncio.gather(
                *[batcher.embed([token_ids[i] for i in g]) for g in groups])
        finally:
            await batcher.shutdown()
        return batcher, results

    batcher, results = asyncio.run(run())
    out: list[torch.Tensor | None] = [None] * len(token_ids)
    for g, vecs in zip(groups, results, strict=True):
        for i, v in zip(g, vecs, strict=True):
            assert isinstance(v, np.ndarray) and v.dtype == np.float32  # numpy rows, no tensors
            out[i] = torch.from_numpy(v)
    # Every bucket ran at its own length: rows were padded to a boundary, never beyond.
    assert set(batcher.stats.batches_per_bucket) <= set(batcher_kw["boundaries"])
    if batcher_kw.get("max_merged_padding"):  # the layout is meant to merge buckets
        assert batcher.stats.merged_batches > 0
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("layout", ["one_request", "single_requests", "random_groups",
                                    "merged_buckets"])
def test_batch_compositions(ours, mixed_texts, reference, layout):
    token_ids = ours.tokenizer.encode_batch(mixed_texts)
    n = len(token_ids)
    rng = random.Random(layout)
    if layout == "one_request":
        groups = [list(range(n))]
        kw = dict(boundaries=(16, 32, 64, 128, 256), preferred_batch_size=32,
                  max_batch_tokens=8192, max_queue_delay_ms=5.0)
    elif layout == "single_requests":
        groups = [[i] for i in rng.sample(range(n), n)]
        kw = dict(boundaries=(8, 24, 40, 128, 192, 256), preferred_batch_size=3,
                  max_batch_tokens=8192, max_queue_delay_ms=20.0)
    elif layout == "merged_buckets":
        # Fine buckets, few inputs each, merging unbounded: batches mix lengths 1..256 tokens,
        # short inputs padded far beyond their own bucket.
        groups = [[i] for i in rng.sample(range(n), n)]
        kw = dict(boundaries=tuple(range(16, 257, 16)), preferred_batch_size=6,
                  max_batch_tokens=8192, max_queue_delay_ms=20.0, max_merged_padding=1.0)
    else:
        order = rng.sample(range(n), n)
        cuts = sorted(rng.sample(range(1, n), 5))
        groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        kw = dict(boundaries=(4, 16, 100, 256), preferred_batch_size=5,
                  max_batch_tokens=600, max_queue_delay_ms=1.0)
    _check(_batched(ours, token_ids, groups, **kw), reference, mixed_texts)


# ------------------------------------------------------------------ other pooling modes
@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A small random BERT saved as a sentence-transformers directory with MiniLM's tokenizer."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, path / name)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 100}))
    return path


POOLING_CONFIGS = {
    "cls": {"pooling_mode_cls_token": True},
    "lasttoken": {"pooling_mode_lasttoken": True},
    "max": {"pooling_mode_max_tokens": True},
    "mean+cls": {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
}


@pytest.mark.parametrize("mode", sorted(POOLING_CONFIGS))
@pytest.mark.parametrize("normalize", [False, True])
def test_pooling_modes(tiny_bert_dir, tmp_path, mode, normalize):
    from sentence_transformers import SentenceTransformer

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_bert_dir, model_dir)
    (model_dir / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, **POOLING_CONFIGS[mode]}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))

    texts = ["short", "a somewhat longer sentence with several words", "🚀 Grüße aus Köln",
             "x " * 60]
    ref = torch.from_numpy(SentenceTransformer(str(model_dir), device="cpu").encode(texts))
    loaded = load_embedding_model(str(model_dir))
    assert loaded.max_seq_length == 100
    token_ids = loaded.tokenizer.encode_batch(texts)
    got = _batched(loaded, token_ids, [[0, 1, 2, 3]], boundaries=(8, 32, 64, 100),
                   preferred_batch_size=4, max_batch_tokens=1000, max_queue_delay_ms=1.0)
    assert ref.shape[1] == loaded.model.embedding_dim
    _check(got, ref, texts)
    if not normalize:  # also the scale, not just the direction
        assert torch.allclose(torch.stack(got), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}])),
     "Dense"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()),
         "position_embedding_type": "relative_key"})), "position_embedding_type"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "hidden_act": "swishy"})), "hidden_act"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
])
def test_unsupported_directories_are_refused(tiny_bert_dir, tmp_path, change, message):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_bert_dir, model_dir)
    change(model_dir)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_embedding_model(str(model_dir))


def test_plain_bert_directory_defaults_to_mean_pooling(tiny_bert_dir):
    from transformers import AutoModel

    loaded = load_embedding_model(str(tiny_bert_dir))  # no modules.json: mean, no normalize
    assert loaded.model.pooling == ("mean",) and not loaded.model.normalize
    ids = torch.tensor([loaded.tokenizer.encode("plain BERT directory")])
    mask = torch.ones_like(ids, dtype=torch.bool)
    hf = AutoModel.from_pretrained(tiny_bert_dir).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).last_hidden_state.mean(dim=1)
    assert torch.allclose(loaded.model(ids, mask), ref, atol=1e-5)


# ------------------------------------------------------------------ CPU paths
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
def test_gemm_epilogues_equal_the_torch_ops(act, gemm):
    """With a packed GEMM, a projection's activation and residual add (oneDNN: in the GEMM's
    epilogue) give what F.linear followed by the torch activation / add gives."""
    from bucketserve.kernels.cpu_plan import CpuPlanError, resolve_cpu_plan
    from bucketserve.models.bert import _ACTIVATIONS, _Linear
    from bucketserve.models.llama import pack_linear_weights

    torch.manual_seed(0)
    lin = _Linear(48, 96, bias=True)
    lin.weight.data, lin.bias.data = torch.randn(96, 48) / 7, torch.randn(96)
    x, residual = torch.randn(37, 48), torch.randn(37, 96)
    want_act = _ACTIVATIONS[act](F.linear(x, lin.weight, lin.bias))
    want_add = residual + F.linear(x, lin.weight, lin.bias)
    try:
        plan = resolve_cpu_plan(gemm=gemm)
    except CpuPlanError:
        pytest.skip(f"this torch build has no packed {gemm} sgemm")
    assert pack_linear_weights(lin, lin.weight, plan) is not None and lin.gemm == gemm
    with torch.inference_mode():
        torch.testing.assert_close(lin.activated(x, act), want_act, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.plus(x, residual), want_add, rtol=1e-5, atol=1e-5)



def test_two_cpu_workers_match_sentence_transformers(ours, mixed_texts, reference,
                                                     tiny_bert_dir):
    """The served CPU batcher (build_batcher): two workers, whose forwards run side by side
    on shares of the torch threads, give every input sentence-transformers' vector (the
    first two forwards wait for each other, so both workers run); with a latency SLO, one
    worker."""
    import threading
    from dataclasses import replace

    from bucketserve.buckets import load_buckets
    from bucketserve.engine.embedding_batcher import build_batcher

    batcher = build_batcher(ours.model, 0, load_buckets().check_model(embedding_max_len=256))
    assert batcher.workers == (2 if torch.get_num_threads() >= 2 else 1)
    batcher.workers = 2  # also where torch has one thread (each forward then runs on it)
    pair, calls, encode = threading.Barrier(2, timeout=60), [], batcher.runner.encode

    def first_two_overlap(ids, mask):
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            pair.wait()
        return encode(ids, mask)

    batcher.runner.encode = first_two_overlap
    token_ids = ours.tokenizer.encode_batch(mixed_texts)

    async def run():
        batcher.start()
        try:
            return await asyncio.gather(*[batcher.embed([ids]) for ids in token_ids])
        finally:
            await batcher.shutdown()

    got = [torch.from_numpy(v[0]) for v in asyncio.run(run())]
    assert len(set(calls)) == 2
    _check(got, reference, mixed_texts)
    tiny = load_embedding_model(str(tiny_bert_dir))
    buckets = load_buckets().check_model(embedding_max_len=100)
    slo = replace(buckets, embedding=replace(buckets.embedding, latency_slo_ms=200.0))
    assert build_batcher(tiny.model, 0, slo).workers == 1
