"""Offline embeddings throughput: bucketserve's encoder path vs SentenceTransformer.encode.

Same run, same corpus, same machine state: a deterministic mixed-length corpus (default 2,000
texts of 8..256 word pieces, uniform, random in-vocabulary words from a seeded RNG) goes
(a) through bucketserve: tokenize -> EmbeddingBatcher (length buckets; each batch computed at
    its longest row, as the served CPU path does) -> our BertEmbeddingModel, all texts
    submitted at once;
(b) through SentenceTransformer(dir).encode(texts, batch_size=32) (which sorts by length).
The two alternate for --repeats rounds; the best round of each is compared (the CPU is shared,
so the best round is the least disturbed one). Prints texts/s, the ratio, padding waste of
both, and the smallest cosine between the two systems' vectors.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/embeddings_offline.py [--n 2000] [--repeats 2]
        [--boundaries 16,32,...] [--batch-tokens 8192] [--max-merged-padding F] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# bucketserve sets this on import; set it before torch loads OpenMP, here and in every server
# this script starts, so that every system measured runs under the same OpenMP wait policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bucketserve.buckets import load_buckets  # noqa: E402
from bucketserve.engine.embedding_batcher import EmbeddingBatcher  # noqa: E402
from bucketserve.engine.embedding_runner import FunctionRunner  # noqa: E402
from bucketserve.models.bert_loader import (  # noqa: E402
    EmbeddingTokenizer,
    LoadedEncoder,
    load_embedding_model,
)


def make_corpus(tokenizer: EmbeddingTokenizer, n: int, lo: int = 8, hi: int = 256,
                seed: int = 0) -> list[str]:
    """n texts whose token counts ([CLS] and [SEP] included) are uniform in lo..hi."""
    rng = random.Random(seed)
    vocab = sorted(w for w in tokenizer._tok.get_vocab() if w.isascii() and w.isalpha()
                   and len(w) >= 3)
    # Words that are one word piece on their own, so a text of k words has k + 2 tokens.
    words = [w for w, ids in zip(vocab, tokenizer.encode_batch(vocab), strict=True)
             if len(ids) == 3]
    texts = []
    for _ in range(n):
        target = rng.randint(lo, hi)
        text = " ".join(rng.choice(words) for _ in range(target - 2))
        texts.append(text)
    lengths = [len(ids) for ids in tokenizer.encode_batch(texts)]
    assert min(lengths) >= lo and max(lengths) <= hi, (min(lengths), max(lengths))
    return texts


def sorted_batch_waste(lengths: list[int], batch_size: int) -> float:
    """Padding waste of length-sorted batches padded to their longest (what ST.encode does)."""
    order = sorted(lengths, reverse=True)
    computed = sum(max(order[i:i + batch_size]) * len(order[i:i + batch_size])
                   for i in range(0, len(order), batch_size))
    return 1.0 - sum(lengths) / computed


def run_ours(loaded: LoadedEncoder, texts: list[str], batcher_kw: dict
             ) -> tuple[float, torch.Tensor, EmbeddingBatcher]:
    async def go() -> tuple[list, EmbeddingBatcher]:
        # the served CPU path's runner (embedding_batcher.build_batcher): a batch is computed
        # at its longest row
        pad = loaded.config.pad_token_id
        batcher = EmbeddingBatcher(FunctionRunner(loaded.model, pad, trim=True), **batcher_kw)
        batcher.start()
        try:
            ids = loaded.tokenizer.encode_batch(texts)
            return await batcher.embed(ids), batcher
        finally:
            await batcher.shutdown()

    t0 = time.perf_counter()
    vectors, batcher = asyncio.run(go())
    return time.perf_counter() - t0, torch.from_numpy(np.stack(vectors)), batcher


def run_st(st, texts: list[str]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = st.encode(texts, batch_size=32, convert_to_tensor=True)
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--buckets", default=None, help="buckets TOML (default: the shipped one)")
    p.add_argument("--boundaries", default=None,
                   help="comma-separated embedding boundaries overriding the TOML's")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="max_batch_tokens overriding the TOML's")
    p.add_argument("--max-merged-padding", type=float, default=None,
                   help="[embedding] max_merged_padding overriding the TOML's (0: no merging)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    load_at_start = os.getloadavg()  # (1, 5, 15 min) before this script loads anything
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    loaded = load_embedding_model("all-minilm-l6-v2")
    cfg = load_buckets(args.buckets).check_model(embedding_max_len=loaded.max_seq_length)
    emb = cfg.embedding
    boundaries = (tuple(int(b) for b in args.boundaries.split(",")) if args.boundaries
                  else emb.boundaries)
    batcher_kw = dict(boundaries=boundaries, preferred_batch_size=emb.batch_size("cpu"),
                      max_batch_tokens=args.batch_tokens or emb.batch_tokens("cpu"),
                      max_queue_delay_ms=emb.max_queue_delay_ms,
                      max_merged_padding=(emb.merged_padding("cpu") if args.max_merged_padding
                                          is None else args.max_merged_padding))
    st = SentenceTransformer(str(loaded.path), device="cpu")
    texts = make_corpus(loaded.tokenizer, args.n)
    lengths = [len(ids) for ids in loaded.tokenizer.encode_batch(texts)]
    print(f"corpus: {len(texts)} texts, tokens {min(lengths)}..{max(lengths)}, "
          f"mean {statistics.mean(lengths):.1f}; torch threads {torch.get_num_threads()}; "
          f"buckets {list(boundaries)}, preferred batch {batcher_kw['preferred_batch_size']}, "
          f"max_batch_tokens {batcher_kw['max_batch_tokens']}, max_merged_padding "
          f"{batcher_kw['max_merged_padding']}", flush=True)

    run_ours(loaded, texts[:64], batcher_kw)  # warm-up both paths
    run_st(st, texts[:64])
    ours_s, st_s = [], []
    for r in range(args.repeats):
        t, ours_vecs, batcher = run_ours(loaded, texts, batcher_kw)
        ours_s.append(t)
        t2, st_vecs = run_st(st, texts)
        st_s.append(t2)
        print(f"round {r}: bucketserve {len(texts) / t:.1f} texts/s, "
              f"sentence-transformers {len(texts) / t2:.1f} texts/s", flush=True)

    min_cos = F.cosine_similarity(ours_vecs, st_vecs.float(), dim=1).min().item()
    result = {
        "bench": "embeddings_offline", "n_texts": len(texts),
        "torch_threads": torch.get_num_threads(), "boundaries": list(boundaries),
        "max_merged_padding": batcher_kw["max_merged_padding"],
        "load_average_at_start": load_at_start,
        "bucketserve_texts_per_s": len(texts) / min(ours_s),
        "st_texts_per_s": len(texts) / min(st_s),
        "ratio": min(st_s) / min(ours_s),
        "median_round_ratio": statistics.median(s / o for s, o in zip(st_s, ours_s, strict=True)),
        "bucketserve_padding_waste": batcher.stats.padding_waste,
        "st_padding_waste": sorted_batch_waste(lengths, 32),
        "bucketserve_batches": batcher.stats.num_batches,
        "bucketserve_merged_batches": batcher.stats.merged_batches,
        "min_cosine_vs_st": min_cos,
        "rounds_s": {"bucketserve": ours_s, "st": st_s},
    }
    print(f"bucketserve {result['bucketserve_texts_per_s']:.1f} texts/s vs "
          f"SentenceTransformer.encode(batch_size=32) {result['st_texts_per_s']:.1f} texts/s: "
          f"{result['ratio']:.2f}x (median per-round ratio {result['median_round_ratio']:.2f}x); "
          f"padding waste {result['bucketserve_padding_waste']:.1%} "
          f"(ST {result['st_padding_waste']:.1%}); min cosine {min_cos:.6f}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
