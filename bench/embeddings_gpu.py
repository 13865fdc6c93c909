"""GPU embeddings: bucketserve vs sentence-transformers (fp16) vs vLLM's pooling runner.

Corpus: N texts (default 20,000) of 8..250 random in-vocabulary words (uniform length, seeded),
the words drawn from the model's vocab.txt (alphabetic ASCII, over 2 letters).

offline  texts in, vectors out, tokenization counted; each system in its own process, one
         warm-up, then 3 timed runs, median reported:
           bucketserve  tokenizer -> EmbeddingBatcher (CUDA graph per (batch, length bucket))
           st           SentenceTransformer(dir).half().encode, batch 32 / 128 / 512: the best
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
    from bucketserve.models.bert_loader import resolve_embedding_model

    return resolve_embedding_model(MODEL)[1]


def corpus(n: int, seed: int = 0) -> list[str]:
    """n texts of 8..250 random words from the model's vocabulary (seeded)."""
    with open(model_dir() / "vocab.txt", encoding="utf-8") as f:
        words = [w.strip() for w in f]
    words = [w for w in words if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 250))) for _ in range(n)]


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


def run_ours(texts: list[str], args: argparse.Namespace, out: dict) -> object:
    import numpy as np
    import torch

    from bucketserve.buckets import load_buckets
    from bucketserve.engine.embedding_batcher import build_batcher, embed_texts
    from bucketserve.models.bert_loader import load_embedding_model

    loaded = load_embedding_model(MODEL, device="cuda", dtype=getattr(torch, args.dtype))
    buckets = load_buckets(args.buckets).check_model(embedding_max_len=loaded.max_seq_length)
    t0 = time.perf_counter()
    batcher = build_batcher(loaded.model, loaded.config.pad_token_id, buckets)
    graphs = batcher.runner
    report = graphs.report
    out["capture"] = {"graphs": report.num_graphs, "capture_s": report.seconds,
                      "pool_mib": report.pool_bytes / 2**20,
                      "build_s": time.perf_counter() - t0}
    out["batch_size"] = batcher.preferred_batch_size
    result: list = []

    async def go(part: list[str]) -> None:
        batcher.start()
        try:
            result[:] = [await embed_texts(batcher, loaded.tokenizer.encode_batch, part,
                                           args.chunk)]
        finally:
            await batcher.shutdown()

    asyncio.run(go(texts[:2048]))  # warm-up
    # Where the time goes: tokenization alone (same chunks, one thread, as embed_texts), and
    # the batcher alone on token ids tokenized beforehand.
    t0 = time.perf_counter()
    ids = [x for i in range(0, len(texts), args.chunk)
           for x in loaded.tokenizer.encode_batch(texts[i:i + args.chunk])]
    out["tokenize_only_s"] = time.perf_counter() - t0

    async def pre() -> None:
        batcher.start()
        try:
            await batcher.embed(ids)
        finally:
            await batcher.shutdown()

    out["pretokenized_s"] = _timed(lambda: asyncio.run(pre()), 1)[0]
    stats = batcher.stats
    before = (stats.computed_tokens, stats.useful_tokens, stats.num_batches)
    times = _timed(lambda: asyncio.run(go(texts)), args.repeats)
    computed = stats.computed_tokens - before[0]
    useful = stats.useful_tokens - before[1]
    out["padding_waste"] = 1.0 - useful / computed
    out["batches_per_run"] = (stats.num_batches - before[2]) / args.repeats
    out["graph_batches"] = graphs.num_graph_batches
    out["eager_batches"] = graphs.num_eager_batches
    out["times_s"] = times
    return np.stack(result[0])


def run_st(texts: list[str], args: argparse.Namespace, out: dict) -> object:
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir()), device="cuda").float()  # whatever the file holds
    ref = st.encode(texts, batch_size=128, convert_to_numpy=True)  # float32 reference
    st.half()
    best = None
    for bs in args.st_batches:
        st.encode(texts[:1024], batch_size=bs)
        times = _timed(lambda bs=bs: st.encode(texts, batch_size=bs, convert_to_tensor=True),
                       args.repeats)
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
                   "--st-batches", ",".join(map(str, args.st_batches))]
            cmd += ["--buckets", args.buckets] if args.buckets else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                results[system] = {"error": proc.stderr[-3000:]}
                print(f"{system}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
                continue
            results[system] = json.loads(lines[-1][len("RESULT "):])
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
        bodies.append(json.dumps({"model": model, "input": inp,
                                  "encoding_format": encoding}).encode())
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


def _wait_ready(base_url: str, proc: subprocess.Popen, limit_s: float = 600.0) -> None:
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < limit_s:
        if proc.poll() is not None:
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
        model = MODEL
        toml = Path(tempfile.mkdtemp()) / "buckets.toml"
        toml.write_text("[kv_cache]\ngpu_memory_fraction = 0.3\n")
        cmd = [sys.executable, "-m", "bucketserve.server.cli", "serve", "--device", args.device,
               "--port", str(args.port), "--buckets", str(toml), "--log-level", "warning"]
        proc = subprocess.Popen(cmd + args.serve_args)
        _wait_ready(base_url, proc)
    try:
        results: dict = {"bench": "embeddings_gpu_online", "base_url": base_url,
                         "encoding_format": args.encoding, "seconds_per_round": args.seconds}
        # warm-up: a few seconds of the heavier shape
        online_round(base_url, model, texts, 16, 32, 3.0, args.procs, args.encoding)
        for clients, per in ((64, 1), (16, 32)):
            r = online_round(base_url, model, texts, clients, per, args.seconds, args.procs,
                             args.encoding)
            results[f"{clients}x{per}"] = r
            print(json.dumps(r), flush=True)
        return results
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("offline", "online", "_child"))
    p.add_argument("system", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=20000, help="texts in the corpus")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--buckets", default=None, help="buckets TOML for bucketserve")
    p.add_argument("--chunk", type=int, default=1024, help="texts tokenized per chunk (ours)")
    p.add_argument("--vllm", action="store_true", help="also vLLM's LLM.embed (offline)")
    p.add_argument("--st-batches", type=lambda t: [int(x) for x in t.split(",")],
                   default=list(ST_BATCHES), help="sentence-transformers batch sizes tried")
    p.add_argument("--systems", default="bucketserve,st", help="offline systems (and --vllm)")
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--base-url", default=None, help="online: server to load")
    p.add_argument("--model", default=MODEL, help="online: model name sent in requests")
    p.add_argument("--launch", action="store_true", help="online: start bucketserve serve")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--device", default="cuda", help="online --launch: bucketserve's device")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="online --launch: extra arguments for bucketserve serve")
    p.add_argument("--seconds", type=float, default=10.0, help="online: seconds per round")
    p.add_argument("--procs", type=int, default=4, help="online: client processes")
    p.add_argument("--encoding", default="base64", choices=("base64", "float"))
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    if args.mode == "_child":
        child(args.system, args)
        return
    if args.mode == "online" and not (args.launch or args.base_url):
        p.error("online needs --launch or --base-url")
    result = offline(args) if args.mode == "offline" else online(args)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
