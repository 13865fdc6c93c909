"""GPU embeddings: bucketserve vs sentence-transformers (fp16) vs vLLM's pooling runner.

Corpus: N texts (default 20,000) of 8..250 random in-vocabulary words (uniform length, seeded),
the words drawn from the model's vocab.txt (alphabetic ASCII, over 2 letters).

offline  texts in, vectors out, tokenization counted; each system in its own process, one
         warm-up, then 3 timed runs, median reported:
           bucketserve  tokenizer -> EmbeddingBatcher (CUDA graph per (batch, length bucket))
           st           SentenceTransformer(dir).half().encode, batch 32 / 128 / 512: the best
                        (512 timed --repeats times, the others --st-other-repeats, default 1)
           vllm         vllm.LLM(model=dir, runner="pooling").embed (with --vllm; skipped when
                        vllm does not import)
         plus the smallest cosine, over every text, of each system against
         sentence-transformers in float32, and bucketserve's padding waste from its metrics.
online   through HTTP against any OpenAI-compatible /v1/embeddings base URL: 64 clients x 1 text,
         then 16 clients x 32 texts (closed loop: each client sends its next request when the
         last one answered); throughput and p50 / p99 latency. --launch starts
         `bucketserve serve --device cuda` itself; vLLM's server is started by hand:
           vllm serve MODEL_DIR --runner pooling --dtype float16 --port 8100
         then  bench/embeddings_gpu.py online --base-url http://127.0.0.1:8100 --model MODEL_DIR

    python bench/embeddings_gpu.py offline [--n 20000] [--vllm] [--json FILE]
    python bench/embeddings_gpu.py online (--launch | --base-url URL) [--model NAME] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "all-minilm-l6-v2"
ST_BATCHES = (32, 128, 512)


def model_dir() -> Path:
    """The model directory: $EMB_MODEL_DIR (--model-dir), else the packaged all-MiniLM-L6-v2."""
    if os.environ.get("EMB_MODEL_DIR"):
        return Path(os.environ["EMB_MODEL_DIR"])
    from bucketserve.models.bert_loader import resolve_embedding_model

    return resolve_embedding_model(MODEL)[1]


def corpus(n: int, seed: int = 0) -> list[str]:
    """n texts of 8..250 random words from the model's vocabulary (seeded)."""
    with open(model_dir() / "vocab.txt", encoding="utf-8") as f:
        words = [w.strip() for w in f]
    words = [w for w in words if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 250))) for _ in range(n)]


# ---------------------------------------------------------------------------- offline host path
# Tokenization in worker processes, for offline embedding (embed_texts): each worker tokenizes a
# chunk of texts and hands back one packed int32 array, so the Python ints a tokenization makes
# (one per token id) are made in the workers, not in the process that runs the batcher, whose
# one GIL the batcher's own host work needs.
_WORKER = None


def encode_packed(tokenizer, texts: list[str], max_length: int | None = None) -> tuple:
    """tokenizer.encode_batch as (every text's ids one after the other, int32; lengths)."""
    import itertools

    import numpy as np

    ids = tokenizer.encode_batch(texts, max_length)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                       count=int(lengths.sum()))
    return flat, lengths


def unpack(flat, lengths) -> list:
    """encode_packed's result as one 1-D int32 view per text."""
    import numpy as np

    ends = np.cumsum(lengths).tolist()
    return [flat[a:b] for a, b in zip([0] + ends[:-1], ends, strict=True)]


def _worker_init(path: str, do_lower_case: bool, threads: int) -> None:
    global _WORKER
    from bucketserve.models.embedding_tokenizer import EmbeddingTokenizer

    # tokenizers' Rust thread pool starts at the first parallel encode and reads this then
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    _WORKER = EmbeddingTokenizer(path, do_lower_case)


def _worker_encode(texts: list[str], max_length: int | None) -> tuple:
    return encode_packed(_WORKER, texts, max_length)


class TokenizerProcesses:
    """An EmbeddingTokenizer in `processes` worker processes (spawned, `threads` Rust threads
    each): `submit(texts)` gives a concurrent Future of encode_packed's (flat, lengths).
    Start-up costs a process start per worker, so build it once and `close` it at the end."""

    def __init__(self, tokenizer, processes: int, threads: int | None = None) -> None:
        import concurrent.futures

        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.threads = threads or max(1, (os.cpu_count() or 1) // processes)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=mp.get_context("spawn"), initializer=_worker_init,
            initargs=(str(tokenizer.path), tokenizer.do_lower_case, self.threads))
        # start every worker now (not at the first timed chunk)
        for f in [self._pool.submit(_worker_encode, ["warm up"], None) for _ in range(processes)]:
            f.result()

    def submit(self, texts: list[str], max_length: int | None = None):
        return self._pool.submit(_worker_encode, list(texts), max_length)

    def encode_batch(self, texts: list[str], max_length: int | None = None) -> list:
        return unpack(*self.submit(texts, max_length).result())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TokenizerProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def embed_texts(batcher, tokenize, texts: list[str], chunk: int = 1024) -> list:
    """Offline: vectors for many texts, tokenization included, in text order.

    `tokenize` is a function (texts -> token ids per text), run on chunks in order on one
    helper thread (the tokenizers library encodes a batch on all cores, the GIL released), or
    a TokenizerProcesses, whose worker processes tokenize several chunks at once and hand back
    packed arrays. Either way the batcher already encodes the chunks before while later ones
    are tokenized, so tokenizing and encoding overlap instead of adding up."""
    import concurrent.futures

    packed = isinstance(tokenize, TokenizerProcesses)  # every chunk submitted at once
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
        futures = [tokenize.submit(part) if packed else pool.submit(tokenize, part)
                   for part in (list(texts[i:i + chunk]) for i in range(0, len(texts), chunk))]

        async def one(future: concurrent.futures.Future) -> list:
            ids = await asyncio.wrap_future(future)
            return await batcher.embed(unpack(*ids) if packed else ids)

        parts = await asyncio.gather(*(one(f) for f in futures))
    return [v for part in parts for v in part]


# ---------------------------------------------------------------------------- offline, per system
def _timed(fn, repeats: int) -> list[float]:
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _replay_s(runner: object, shapes: list[tuple[int, int]], repeats: int = 3) -> float:
    """Device time of a run's batches alone: the same (rows, length) shapes replayed back to
    back from the buffers as they are, no host work between them (median of `repeats`)."""
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(runner.stream), torch.inference_mode():
            for rows, length in shapes:
                graph = runner.graphs.get((rows, length))
                if graph is not None:
                    graph.replay()
                else:
                    runner._forward(rows, length)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_ours(texts: list[str], args: argparse.Namespace, out: dict) -> object:
    import numpy as np
    import torch

    from bucketserve.buckets import load_buckets
    from bucketserve.engine.embedding_batcher import build_batcher
    from bucketserve.models.bert_loader import load_embedding_model

    loaded = load_embedding_model(str(model_dir()), device="cuda",
                                  dtype=getattr(torch, args.dtype))
    buckets = load_buckets(args.buckets).check_model(embedding_max_len=loaded.max_seq_length)
    t0 = time.perf_counter()
    batcher = build_batcher(loaded.model, loaded.config.pad_token_id, buckets)
    graphs = batcher.runner
    report = graphs.report
    out["capture"] = {"graphs": report.num_graphs, "capture_s": report.seconds,
                      "pool_mib": report.pool_bytes / 2**20,
                      "build_s": time.perf_counter() - t0}
    out["batch_size"] = batcher.queue.preferred_batch_size
    out["max_merged_padding"] = batcher.queue.max_merged_padding
    out["chunk"] = args.chunk
    out["cpu_count"] = os.cpu_count()
    result: list = []
    procs_by_n: dict[int, object] = {}

    def tokenizer(n: int) -> object:
        """n == 0: the tokenizer's batch call on one helper thread; n > 0: n processes."""
        if n == 0:
            return loaded.tokenizer.encode_batch
        if n not in procs_by_n:
            procs_by_n[n] = TokenizerProcesses(loaded.tokenizer, n)
        return procs_by_n[n]

    def run(tok: object, part: list[str]) -> None:
        async def go() -> None:
            batcher.start()
            try:
                result[:] = [await embed_texts(batcher, tok, part, args.chunk)]
            finally:
                await batcher.shutdown()

        asyncio.run(go())

    def tokenize_only(tok: object) -> float:
        t0 = time.perf_counter()
        parts = [texts[i:i + args.chunk] for i in range(0, len(texts), args.chunk)]
        if isinstance(tok, TokenizerProcesses):
            futures = [tok.submit(p) for p in parts]
            _ = [unpack(*f.result()) for f in futures]
        else:
            _ = [x for p in parts for x in tok(p)]
        return time.perf_counter() - t0

    variants = args.tokenizer_procs
    out["tokenizer_procs"] = variants[0]
    run(tokenizer(variants[0]), texts[:2048])  # warm-up
    # Where the time goes: the batcher alone on token ids tokenized beforehand; the device
    # alone (the same batches' graphs replayed back to back); tokenization alone per variant.
    ids = loaded.tokenizer.encode_batch(texts)

    async def pre() -> None:
        batcher.start()
        try:
            await batcher.embed(ids)
        finally:
            await batcher.shutdown()

    shape_log: list[tuple[int, int]] = []  # (rows, length) of each batch, as computed
    launch = graphs.launch

    def logged(rows: list, length: int) -> object:
        ticket = launch(rows, length)
        shape_log.append((ticket.padded_rows, ticket.length))
        return ticket

    graphs.launch = logged
    out["pretokenized_s"] = _timed(lambda: asyncio.run(pre()), 1)[0]
    del graphs.launch  # the class's own again
    out["device_only_s"] = _replay_s(graphs, shape_log)
    stats = batcher.stats
    out["variants"] = {}
    for n in variants:
        tok = tokenizer(n)
        run(tok, texts[:2048])
        v = {"tokenize_only_s": tokenize_only(tok)}
        before = (stats.computed_tokens, stats.useful_tokens, stats.num_batches)
        times = _timed(lambda tok=tok: run(tok, texts), args.repeats)
        computed = stats.computed_tokens - before[0]
        v["padding_waste"] = 1.0 - (stats.useful_tokens - before[1]) / computed
        v["batches_per_run"] = (stats.num_batches - before[2]) / args.repeats
        v["times_s"] = times
        v["texts_per_s"] = len(texts) / statistics.median(times)
        out["variants"]["thread" if n == 0 else f"procs{n}"] = v
        print(f"  tokenizer {'thread' if n == 0 else f'{n} processes'}: {json.dumps(v)}",
              file=sys.stderr, flush=True)
        if n == variants[0]:
            vecs = np.stack(result[0])
            out["padding_waste"] = v["padding_waste"]
            out["batches_per_run"] = v["batches_per_run"]
            out["times_s"] = times
    for p in procs_by_n.values():
        p.close()
    out["graph_batches"] = graphs.num_graph_batches
    out["eager_batches"] = graphs.num_eager_batches
    # the batcher's own metrics (what /metrics reports), over everything this process ran
    out["metrics_padding_waste"] = stats.padding_waste
    return vecs


def run_st(texts: list[str], args: argparse.Namespace, out: dict) -> object:
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir()), device="cuda").float()  # whatever the file holds
    ref = st.encode(texts, batch_size=128, convert_to_numpy=True)  # float32 reference
    out["weights_dtype"] = _weights_dtype()
    st.half()
    best = None
    for bs in args.st_batches:
        st.encode(texts[:1024], batch_size=bs)
        # the largest size (the best in every run so far) gets the full repeats, the others
        # --st-other-repeats (time: batch 32 takes ~16 s a run on the H200)
        reps = args.repeats if bs == max(args.st_batches) else args.st_other_repeats
        times = _timed(lambda bs=bs: st.encode(texts, batch_size=bs, convert_to_tensor=True),
                       reps)
        out[f"bs{bs}_times_s"] = times
        if best is None or statistics.median(times) < statistics.median(best[1]):
            best = (bs, times)
    out["best_batch"], out["times_s"] = best
    vecs = st.encode(texts, batch_size=best[0], convert_to_tensor=True).float().cpu().numpy()
    torch.save(torch.from_numpy(ref), os.path.join(args.tmp, "ref_fp32.pt"))
    return vecs


def run_vllm(texts: list[str], args: argparse.Namespace, out: dict) -> object:
    import numpy as np

    try:
        from vllm import LLM
    except ImportError as exc:
        out["skipped"] = f"vllm does not import: {exc}"
        return None
    kw = dict(model=str(model_dir()), dtype="float16", seed=0, gpu_memory_utilization=0.5)
    try:
        llm = LLM(runner="pooling", **kw)
    except TypeError:  # older vLLM: the pooling runner is chosen by task
        llm = LLM(task="embed", **kw)
    out["vllm_version"] = __import__("vllm").__version__
    llm.embed(texts[:1024], use_tqdm=False)
    result: list = []
    out["times_s"] = _timed(lambda: result.__setitem__(
        slice(None), [llm.embed(texts, use_tqdm=False)]), args.repeats)
    return np.array([o.outputs.embedding for o in result[0]], dtype=np.float32)


def _weights_dtype() -> str:
    """The dtype the weights file holds (the fp32 oracle needs float32 weights)."""
    from safetensors import safe_open

    try:
        with safe_open(str(model_dir() / "model.safetensors"), "np") as f:
            return str(f.get_slice(next(iter(f.keys()))).get_dtype())
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"unknown ({exc})"


SYSTEMS = {"bucketserve": run_ours, "st": run_st, "vllm": run_vllm}


def child(system: str, args: argparse.Namespace) -> None:
    import numpy as np

    texts = corpus(args.n)
    out: dict = {"system": system, "n": len(texts)}
    vecs = SYSTEMS[system](texts, args, out)
    if vecs is not None:
        np.save(os.path.join(args.tmp, f"vecs_{system}.npy"), vecs)
        out["texts_per_s"] = len(texts) / statistics.median(out["times_s"])
    print("RESULT " + json.dumps(out), flush=True)


def offline(args: argparse.Namespace) -> dict:
    import numpy as np

    systems = args.systems.split(",") + (["vllm"] if args.vllm else [])
    results: dict = {"bench": "embeddings_gpu_offline", "n": args.n, "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        for system in systems:
            cmd = [sys.executable, __file__, "_child", system, "--n", str(args.n),
                   "--repeats", str(args.repeats), "--dtype", args.dtype, "--tmp", tmp,
                   "--chunk", str(args.chunk),
                   "--tokenizer-procs", ",".join(map(str, args.tokenizer_procs)),
                   "--st-batches", ",".join(map(str, args.st_batches)),
                   "--st-other-repeats", str(args.st_other_repeats)]
            cmd += ["--buckets", args.buckets] if args.buckets else []
            env = dict(os.environ)
            if system == "vllm" and os.environ.get("VLLM_SITE"):  # vLLM's own packages: its child only
                env["PYTHONPATH"] = os.pathsep.join(
                    x for x in (os.environ["VLLM_SITE"], env.get("PYTHONPATH")) if x)
                env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
                env.setdefault("VLLM_NO_USAGE_STATS", "1")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            print(proc.stderr[-4000:] if system == "bucketserve" else "", end="",
                  file=sys.stderr, flush=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                results[system] = {"error": proc.stderr[-3000:]}
                print(f"{system}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
                continue
            results[system] = json.loads(lines[-1][len("RESULT "):])
            results[system]["process_s"] = time.perf_counter() - t0
            print(f"{system}: {json.dumps(results[system])}", flush=True)
        ref_path = Path(tmp) / "ref_fp32.pt"
        if ref_path.exists():
            import torch

            ref = torch.load(ref_path).numpy()
            ref /= np.linalg.norm(ref, axis=1, keepdims=True)
            for system in systems:
                path = Path(tmp) / f"vecs_{system}.npy"
                if path.exists():
                    v = np.load(path)
                    v = v / np.linalg.norm(v, axis=1, keepdims=True)
                    results[system]["min_cosine_vs_st_fp32"] = float((v * ref).sum(1).min())
    ours = results.get("bucketserve", {}).get("texts_per_s")
    for peer in ("st", "vllm"):
        rate = results.get(peer, {}).get("texts_per_s")
        if ours and rate:
            results[f"ratio_vs_{peer}"] = ours / rate
    return results


# ---------------------------------------------------------------------------- shapes
def shapes(args: argparse.Namespace) -> dict:
    """Cosine against sentence-transformers fp32 at every (batch, length) shape the shipped
    config captures, each batch with padding rows where its size allows one (n = B - 1 rows
    computed at B), and every length bucket through the eager forward (the fallback above the
    captured sizes). Rows: corpus texts of that bucket, topped up with random in-vocabulary
    ids of lengths in the bucket's range (the corpus has none over ~260 tokens)."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from bucketserve.buckets import load_buckets
    from bucketserve.engine.embedding_batcher import build_batcher
    from bucketserve.models.bert_loader import load_embedding_model

    loaded = load_embedding_model(str(model_dir()), device="cuda",
                                  dtype=getattr(torch, args.dtype))
    buckets = load_buckets(args.buckets).check_model(embedding_max_len=loaded.max_seq_length)
    runner = build_batcher(loaded.model, loaded.config.pad_token_id, buckets).runner
    st = SentenceTransformer(str(model_dir()), device="cuda").float()
    spec = runner.spec
    need = {L: max([b for b, length in runner.shapes if length == L] + [runner.max_rows])
            for L in spec.boundaries}
    pools: dict[int, list[list[int]]] = {L: [] for L in spec.boundaries}
    for ids in loaded.tokenizer.encode_batch(corpus(args.n)):
        L = spec.lookup(len(ids))
        if len(pools[L]) < need[L]:
            pools[L].append(ids)
    rng = random.Random(0)
    for i, L in enumerate(spec.boundaries):
        low, _, high = spec.profile(i)
        while len(pools[L]) < need[L]:
            n = rng.randint(max(low, 3), high)
            pools[L].append([101] + [rng.randint(1000, 29000) for _ in range(n - 2)] + [102])

    def reference(rows: list[list[int]]) -> torch.Tensor:
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

    refs = {L: reference(pools[L]) for L in spec.boundaries}
    worst, worst_at, checked, padded_rows, rows_checked = 1.0, None, 0, 0, 0
    per_length: dict[int, float] = {}

    def check(out: np.ndarray, L: int, n: int, where: str) -> None:
        nonlocal worst, worst_at, rows_checked
        cos = torch.nn.functional.cosine_similarity(torch.from_numpy(out), refs[L][:n])
        m = cos.min().item()
        rows_checked += n
        per_length[L] = min(per_length.get(L, 1.0), m)
        if m < worst:
            worst, worst_at = m, where

    for B, L in runner.shapes:
        n = B - 1 if B > 2 else B
        padded = runner.padded_rows(n, L)
        padded_rows += padded - n
        check(runner.collect(runner.launch(pools[L][:n], L)), L, n, f"graph {B}x{L} ({n} rows)")
        checked += 1
    graph_batches = runner.num_graph_batches
    saved, runner.graphs = runner.graphs, {}  # every launch below takes the eager forward
    eager = 0
    try:
        for L in spec.boundaries:
            for n in sorted({1, 3, runner.max_rows}):
                check(runner.collect(runner.launch(pools[L][:n], L)), L, n, f"eager {n}x{L}")
                eager += 1
    finally:
        runner.graphs = saved
    return {"bench": "embeddings_gpu_shapes", "dtype": args.dtype,
            "weights_dtype": _weights_dtype(), "graphs": len(runner.graphs),
            "graph_shapes_checked": checked, "graph_batches": graph_batches,
            "padding_rows": padded_rows, "eager_batches": eager, "rows_checked": rows_checked,
            "min_cosine_vs_st_fp32": worst, "worst_at": worst_at,
            "min_cosine_per_length": {str(k): v for k, v in per_length.items()}}


# ---------------------------------------------------------------------------- summary
def summary(args: argparse.Namespace) -> dict:
    """One table from the JSON files of a run (offline, shapes, online ours / vLLM)."""
    d = Path(args.summary_dir)

    def load(name: str) -> dict:
        f = d / name
        return json.loads(f.read_text()) if f.is_file() else {}

    off, shp = load("emb_offline.json"), load("emb_shapes.json")
    on_ours, on_vllm = load("emb_online_ours.json"), load("emb_online_vllm.json")
    ours = off.get("bucketserve", {})
    rows = [("offline texts/s (median of 3)", "bucketserve", ours.get("texts_per_s"))]
    st, vl = off.get("st", {}), off.get("vllm", {})
    rows.append((f"offline texts/s, ST fp16 best batch {st.get('best_batch')}", "st",
                 st.get("texts_per_s")))
    rows.append(("offline texts/s, vLLM LLM.embed", "vllm", vl.get("texts_per_s")))
    out: dict = {"bench": "embeddings_gpu_summary", "offline": {
        "bucketserve_texts_per_s": ours.get("texts_per_s"),
        "st_fp16_texts_per_s": st.get("texts_per_s"), "st_best_batch": st.get("best_batch"),
        "vllm_texts_per_s": vl.get("texts_per_s"),
        "ratio_vs_st": off.get("ratio_vs_st"), "ratio_vs_vllm": off.get("ratio_vs_vllm"),
        "padding_waste": ours.get("padding_waste"),
        "metrics_padding_waste": ours.get("metrics_padding_waste"),
        "min_cosine_vs_st_fp32": {k: off.get(k, {}).get("min_cosine_vs_st_fp32")
                                  for k in ("bucketserve", "st", "vllm")}}}
    out["shapes"] = {k: shp.get(k) for k in ("graphs", "graph_shapes_checked", "padding_rows",
                                            "eager_batches", "rows_checked",
                                            "min_cosine_vs_st_fp32", "worst_at",
                                            "weights_dtype")}
    out["online"] = {}
    for shape in ("64x1", "16x32"):
        a, b = on_ours.get(shape, {}), on_vllm.get(shape, {})
        r = {"bucketserve_texts_per_s": a.get("texts_per_s"), "bucketserve_p50_ms": a.get("p50_ms"),
             "bucketserve_p99_ms": a.get("p99_ms"), "vllm_texts_per_s": b.get("texts_per_s"),
             "vllm_p50_ms": b.get("p50_ms"), "vllm_p99_ms": b.get("p99_ms")}
        if a.get("texts_per_s") and b.get("texts_per_s"):
            r["ratio"] = a["texts_per_s"] / b["texts_per_s"]
        out["online"][shape] = r

    def f(x: object, fmt: str = ",.0f") -> str:
        return "n/a" if x is None else format(x, fmt)

    o = out["offline"]
    lines = ["| offline (20,000 texts, tokenization counted) | texts/s | ours / it |",
             "|---|---|---|",
             f"| bucketserve | {f(o['bucketserve_texts_per_s'])} | |",
             f"| sentence-transformers fp16, batch {o['st_best_batch']} | "
             f"{f(o['st_fp16_texts_per_s'])} | {f(o['ratio_vs_st'], '.2f')}x |",
             f"| vLLM LLM.embed | {f(o['vllm_texts_per_s'])} | {f(o['ratio_vs_vllm'], '.2f')}x |",
             "", f"padding waste (batcher metrics): {f(o['padding_waste'], '.2%')}; min cosine "
             f"vs ST fp32 over the corpus: " + ", ".join(
                 f"{k} {f(v, '.6f')}" for k, v in o["min_cosine_vs_st_fp32"].items()),
             f"every captured shape: {shp.get('graphs')} graphs, {shp.get('padding_rows')} "
             f"padding rows, {shp.get('eager_batches')} eager batches, min cosine "
             f"{f(shp.get('min_cosine_vs_st_fp32'), '.6f')} (worst at {shp.get('worst_at')}; "
             f"oracle weights {shp.get('weights_dtype')})", "",
             "| online | bucketserve texts/s, p50, p99 | vLLM server texts/s, p50, p99 | ratio |",
             "|---|---|---|---|"]
    for shape, r in out["online"].items():
        lines.append(f"| {shape} | {f(r['bucketserve_texts_per_s'])}, "
                     f"{f(r['bucketserve_p50_ms'], '.1f')} ms, {f(r['bucketserve_p99_ms'], '.1f')} ms"
                     f" | {f(r['vllm_texts_per_s'])}, {f(r['vllm_p50_ms'], '.1f')} ms, "
                     f"{f(r['vllm_p99_ms'], '.1f')} ms | {f(r.get('ratio'), '.2f')}x |")
    out["table"] = "\n".join(lines)
    print(out["table"])
    return out


# ---------------------------------------------------------------------------- online
async def _http_client(host: str, port: int, path: str, bodies: list[bytes], lat: list[float],
                       stop_at: float) -> None:
    """One keep-alive HTTP/1.1 connection sending bodies in turn until stop_at (closed loop)."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n")
    i = 0
    try:
        while time.perf_counter() < stop_at:
            body = bodies[i % len(bodies)]
            i += 1
            t0 = time.perf_counter()
            writer.write(head.format(len(body)).encode() + body)
            status = await reader.readline()
            length = None
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            if length is None:
                raise RuntimeError(f"no content-length in the answer ({status!r})")
            data = await reader.readexactly(length)
            if b" 200 " not in status:
                raise RuntimeError(f"{status!r}: {data[:300]!r}")
            lat.append(time.perf_counter() - t0)
    finally:
        writer.close()


def _client_proc(args: tuple) -> tuple[list[float], float]:
    """One client process: (latencies, seconds from its first send to its last answer)."""
    host, port, path, bodies, clients, seconds = args
    lat: list[float] = []

    async def go() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(_http_client(host, port, path, bodies[c::clients], lat,
                                            t0 + seconds) for c in range(clients)))
        return time.perf_counter() - t0

    return lat, asyncio.run(go())


def online_round(base_url: str, model: str, texts: list[str], clients: int, per_request: int,
                 seconds: float, procs: int, encoding: str) -> dict:
    from urllib.parse import urlparse

    url = urlparse(base_url)
    path = (url.path.rstrip("/") or "") + "/v1/embeddings"
    bodies = []
    for i in range(0, len(texts) - per_request + 1, per_request):
        inp = texts[i] if per_request == 1 else texts[i:i + per_request]
        body = {"input": inp, "encoding_format": encoding}
        if model:  # omitted: the server's one embedding model
            body["model"] = model
        bodies.append(json.dumps(body).encode())
    procs = min(procs, clients)
    shares = [clients // procs + (p < clients % procs) for p in range(procs)]
    jobs = []
    start = 0
    for share in shares:
        jobs.append((url.hostname, url.port or 80, path, bodies[start::procs], share, seconds))
        start += 1
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client_proc, jobs)
    wall = time.perf_counter() - t0
    lat = sorted(x for part, _ in parts for x in part)
    n = len(lat)
    rate = sum(len(part) / elapsed for part, elapsed in parts)  # requests/s, all processes
    return {"clients": clients, "texts_per_request": per_request, "requests": n,
            "requests_per_s": rate, "texts_per_s": rate * per_request,
            "p50_ms": 1000 * lat[n // 2], "p99_ms": 1000 * lat[min(n - 1, int(n * 0.99))],
            "wall_s": wall}


def _wait_ready(base_url: str, proc: subprocess.Popen | None, limit_s: float = 600.0) -> None:
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < limit_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError("the server did not come up")


def online(args: argparse.Namespace) -> dict:
    texts = corpus(args.n)
    proc = None
    base_url = args.base_url
    model = args.model
    if args.launch:
        base_url = f"http://127.0.0.1:{args.port}"
        model = ""
        toml = Path(tempfile.mkdtemp()) / "buckets.toml"
        toml.write_text("[kv_cache]\ngpu_memory_fraction = 0.3\n")
        cmd = [sys.executable, "-m", "bucketserve.server.cli", "serve", "--device", args.device,
               "--port", str(args.port), "--buckets", str(toml), "--log-level", "warning"]
        proc = subprocess.Popen(cmd + args.serve_args)
        _wait_ready(base_url, proc)
    else:  # a server started beside this command may still be loading
        _wait_ready(base_url, None)
    try:
        results: dict = {"bench": "embeddings_gpu_online", "base_url": base_url,
                         "encoding_format": args.encoding, "seconds_per_round": args.seconds,
                         "serve_args": args.serve_args if args.launch else None}
        # warm-up: a few seconds of the heavier shape
        online_round(base_url, model, texts, 16, 32, 3.0, args.procs, args.encoding)
        for clients, per in ((64, 1), (16, 32)):
            # `--rounds` timed rounds per shape; the round of median throughput is reported,
            # with every round's texts/s beside it
            rounds = [online_round(base_url, model, texts, clients, per, args.seconds,
                                   args.procs, args.encoding) for _ in range(args.rounds)]
            rounds.sort(key=lambda x: x["texts_per_s"])
            r = dict(rounds[len(rounds) // 2], rounds=len(rounds),
                     all_texts_per_s=[x["texts_per_s"] for x in rounds])
            results[f"{clients}x{per}"] = r
            print(json.dumps(r), flush=True)
        return results
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("offline", "online", "shapes", "summary", "_child"))
    p.add_argument("system", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--summary-dir", default=None, help="summary: the folder of a run's JSON")
    p.add_argument("--n", type=int, default=20000, help="texts in the corpus")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--buckets", default=None, help="buckets TOML for bucketserve")
    p.add_argument("--chunk", type=int, default=1024, help="texts tokenized per chunk (ours)")
    p.add_argument("--tokenizer-procs", type=lambda t: [int(x) for x in t.split(",")],
                   default=[4, 0],
                   help="ours: tokenizer processes (0: one helper thread); the first is the "
                        "reported figure, the others are measured beside it")
    p.add_argument("--model-dir", default=None,
                   help="model directory (default: $EMB_MODEL_DIR, else the packaged MiniLM)")
    p.add_argument("--vllm", action="store_true", help="also vLLM's LLM.embed (offline)")
    p.add_argument("--st-batches", type=lambda t: [int(x) for x in t.split(",")],
                   default=list(ST_BATCHES), help="sentence-transformers batch sizes tried")
    p.add_argument("--st-other-repeats", type=int, default=1,
                   help="timed runs of the sentence-transformers batch sizes below the largest")
    p.add_argument("--systems", default="bucketserve,st", help="offline systems (and --vllm)")
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--base-url", default=None, help="online: server to load")
    p.add_argument("--model", default="",
                   help="online: model name sent in requests (default: none sent)")
    p.add_argument("--launch", action="store_true", help="online: start bucketserve serve")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--device", default="cuda", help="online --launch: bucketserve's device")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="online --launch: extra arguments for bucketserve serve")
    p.add_argument("--seconds", type=float, default=10.0, help="online: seconds per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="online: timed rounds per shape (the median round is reported)")
    p.add_argument("--procs", type=int, default=4, help="online: client processes")
    p.add_argument("--encoding", default="base64", choices=("base64", "float"))
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    if args.model_dir:
        os.environ["EMB_MODEL_DIR"] = str(Path(args.model_dir).resolve())
    if args.mode == "_child":
        child(args.system, args)
        return
    if args.mode == "online" and not (args.launch or args.base_url):
        p.error("online needs --launch or --base-url")
    result = {"offline": offline, "online": online, "shapes": shapes,
              "summary": summary}[args.mode](args)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
