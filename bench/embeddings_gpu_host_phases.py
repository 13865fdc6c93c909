"""Where the offline batcher path on pre-tokenized ids spends its host time on a GPU.

Builds the served batcher (CUDA graphs, shipped [embedding] settings) for all-MiniLM-L6-v2 in
fp16, tokenizes the 20,000-text corpus of bench/embeddings_gpu.py once, then runs
`batcher.embed(ids)` --runs times with timers around the worker's phases (pop_batch, launch,
collect, batch_done, record_batch, the whole completion) and prints one JSON line per run.
PYTHONPATH=DIR puts another checkout's `bucketserve` first on the path (an older commit as a
control, e.g. `git archive <commit> bucketserve | tar -x -C DIR`).

    EMB_MODEL_DIR=<MiniLM dir> PYTHONPATH=. python3 bench/embeddings_gpu_host_phases.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(obj: object, name: str, acc: dict[str, float], key: str) -> None:
    """Wraps obj.name so that its calls add their seconds to acc[key]."""
    fn: Callable = getattr(obj, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--device", default="cuda", help="cpu: the eager runner (a smoke test)")
    a = ap.parse_args()
    import torch
    from embeddings_gpu import corpus, model_dir

    import bucketserve
    from bucketserve.buckets import load_buckets
    from bucketserve.engine.embedding_batcher import build_batcher
    from bucketserve.models.bert_loader import load_embedding_model

    print("code", bucketserve.__file__, flush=True)
    loaded = load_embedding_model(str(model_dir()), device=a.device,
                                  dtype=torch.float16 if a.device == "cuda" else torch.float32)
    buckets = load_buckets(None).check_model(embedding_max_len=loaded.max_seq_length)
    batcher = build_batcher(loaded.model, loaded.config.pad_token_id, buckets)
    ids = loaded.tokenizer.encode_batch(corpus(a.n))
    acc: dict[str, float] = {}
    for obj, name in ((batcher.runner, "launch"), (batcher.runner, "collect"),
                      (batcher.queue, "pop_batch"), (batcher.queue, "batch_done"),
                      (batcher, "_complete"), (batcher.stats, "record_batch")):
        timed(obj, name, acc, "complete(all)" if name == "_complete" else name)

    async def run() -> None:
        batcher.start()
        try:
            await batcher.embed(ids)
        finally:
            await batcher.shutdown()

    for _ in range(a.runs):
        acc.clear()
        before = batcher.stats.num_batches
        t0 = time.perf_counter()
        asyncio.run(run())
        wall = time.perf_counter() - t0
        row = {"wall_s": round(wall, 4), "batches": batcher.stats.num_batches - before}
        row.update({k: round(v, 4) for k, v in acc.items()})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
