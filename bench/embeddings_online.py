"""Online embeddings throughput: 16 concurrent clients, one text per request, against the real
`bucketserve serve` (dynamic length-bucketed batching) and against one-forward-per-request
baseline servers, in the same run.

Baselines (each a minimal FastAPI + uvicorn server started by this script, same HTTP stack and
the same OpenAI response as bucketserve; requests are served one forward at a time under a
lock, in uvicorn's thread pool so the event loop stays free):
  st-per-request    SentenceTransformer(dir).encode([text]): one forward per request (the
                    baseline the targets are stated against);
  ours-per-request  bucketserve's own encoder on the exact-length [1, n] input (no padding, no
                    batching): isolates what batching alone brings.
Clients: one asyncio process, 16 workers, each sending the next text of a deterministic
mixed-length corpus (8..256 word pieces, as in embeddings_offline.py) and waiting for the answer
(encoding_format base64, as the openai client sends by default). Systems alternate for
--repeats rounds; printed: the ratio of each system's best round, and the median over rounds
of the per-round ratio. bucketserve's padding waste and batch
sizes come from its /metrics, counted over the measured rounds only.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/embeddings_online.py [--n 600] [--clients 16]
        [--repeats 2] [--buckets FILE] [--boundaries 16,32,...] [--max-merged-padding F]
        [--baselines st-per-request,ours-per-request] [--other-bucketserve before=CHECKOUT]
        [--isa avx2]

--isa avx2 runs every server (bucketserve and the baselines) with PyTorch's, oneDNN's and MKL's
kernels held to AVX2 (ISA_ENV), as on a machine without AVX-512; the JSON records the setting,
the variables and the capability PyTorch reports under them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# bucketserve sets this on import; set it before torch loads OpenMP, here and in every server
# this script starts, so that every system measured runs under the same OpenMP wait policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx  # noqa: E402
from pydantic import BaseModel  # noqa: E402

MODEL = "all-minilm-l6-v2"
# --isa avx2: the environment of every server this script starts
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
STARTUP_LIMIT_S = 900.0
# The LLM the server also loads gets a tiny KV pool: the bench only exercises embeddings.
SERVER_TOML = "[kv_cache]\ncpu_memory_gib = 0.1\n"


# ------------------------------------------------------------------ baseline server
class Body(BaseModel):  # module level: FastAPI must resolve it as the request body
    input: str
    model: str | None = None
    encoding_format: str = "float"


def serve_baseline(mode: str, port: int) -> None:
    import numpy as np
    import torch
    import uvicorn
    from fastapi import FastAPI

    from bucketserve.models.bert_loader import load_embedding_model

    loaded = load_embedding_model(MODEL)
    if mode == "st-per-request":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(loaded.path), device="cpu")

        def forward(text: str) -> tuple[np.ndarray, int]:
            # usage is left at 0: counting tokens would tokenize a second time
            return st.encode([text], batch_size=1)[0], 0
    elif mode == "ours-per-request":
        def forward(text: str) -> tuple[np.ndarray, int]:
            ids = torch.tensor([loaded.tokenizer.encode(text)])
            vec = loaded.model(ids, torch.ones_like(ids, dtype=torch.bool))[0]
            return vec.numpy(), ids.shape[1]
    else:
        raise SystemExit(f"unknown baseline {mode}")

    lock = threading.Lock()  # one forward at a time: the model uses all torch threads
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(body: Body) -> dict:
        with lock:
            vec, n = forward(body.input)
        vec = np.ascontiguousarray(vec, dtype="<f4")
        emb = (base64.b64encode(vec.tobytes()).decode() if body.encoding_format == "base64"
               else vec.tolist())
        return {"object": "list", "model": MODEL,
                "data": [{"object": "embedding", "index": 0, "embedding": emb}],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    forward("warm up")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, cmd: list[str], port: int, logdir: Path,
          pythonpath: str | None = None) -> subprocess.Popen:
    log = open(logdir / f"{name}.log", "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=pythonpath)
    proc.bench_name = name  # type: ignore[attr-defined]
    proc.bench_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


def wait_healthy(proc: subprocess.Popen, logdir: Path) -> None:
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while True:
        if proc.poll() is not None:
            log = (logdir / f"{proc.bench_name}.log").read_text(errors="replace")  # type: ignore[attr-defined]
            raise SystemExit(f"{proc.bench_name} exited ({proc.returncode}):\n{log[-3000:]}")  # type: ignore[attr-defined]
        try:
            if httpx.get(proc.bench_url + "/health", timeout=5).status_code == 200:  # type: ignore[attr-defined]
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{proc.bench_name} not healthy after {STARTUP_LIMIT_S} s")  # type: ignore[attr-defined]
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(bucketserve_embedding_[^ ]*) ([^ ]+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


# ------------------------------------------------------------------ load generator
async def load(url: str, texts: list[str], clients: int) -> tuple[float, list[float]]:
    """Send every text once with `clients` concurrent workers; (seconds, latencies)."""
    next_index = 0
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(texts):
                text = texts[next_index]
                next_index += 1
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json={
                    "input": text, "model": MODEL, "encoding_format": "base64"})
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")
                assert len(base64.b64decode(r.json()["data"][0]["embedding"])) == 384 * 4

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(clients)])
        return time.perf_counter() - t0, latencies


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=600, help="texts per round and system")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--buckets", default=None,
                   help="buckets TOML for bucketserve (default: the shipped defaults)")
    p.add_argument("--boundaries", default=None,
                   help="comma-separated [embedding] boundaries for bucketserve (overrides --buckets)")
    p.add_argument("--max-merged-padding", type=float, default=None,
                   help="[embedding] max_merged_padding for bucketserve (overrides --buckets)")
    p.add_argument("--baselines", default="st-per-request,ours-per-request")
    p.add_argument("--other-bucketserve", action="append", default=[], metavar="NAME=CHECKOUT",
                   help="also serve bucketserve from this checkout (e.g. the code before a "
                        "change), measured in the same rounds as a baseline named NAME")
    p.add_argument("--isa", choices=["native", *ISA_ENV], default="native",
                   help="hold every server's CPU kernels to this instruction set (ISA_ENV)")
    p.add_argument("--json", default=None)
    p.add_argument("--serve-baseline", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_baseline:
        serve_baseline(args.serve_baseline, args.port)
        return

    load_at_start = os.getloadavg()  # (1, 5, 15 min) before this script's servers start
    os.environ.update(ISA_ENV.get(args.isa, {}))  # every server's environment copies ours
    capability = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        capture_output=True, text=True, check=True).stdout.strip()
    print(f"isa {args.isa}: PyTorch's CPU capability in the servers' environment: {capability}")
    from embeddings_offline import make_corpus

    from bucketserve.models.bert_loader import load_embedding_model

    tokenizer = load_embedding_model(MODEL).tokenizer
    texts = make_corpus(tokenizer, args.n, seed=1)
    logdir = Path(tempfile.mkdtemp(prefix="emb-online-"))
    toml = logdir / "buckets.toml"
    user_toml = Path(args.buckets).read_text() + "\n" if args.buckets else ""
    overrides = []
    if args.boundaries:
        overrides.append(f"boundaries = [{args.boundaries}]")
    if args.max_merged_padding is not None:
        overrides.append(f"max_merged_padding = {args.max_merged_padding}")
    if overrides:
        if "[embedding]" in user_toml:
            raise SystemExit("give [embedding] keys in the --buckets file or with --boundaries / "
                             "--max-merged-padding, not both")
        user_toml += "[embedding]\n" + "\n".join(overrides) + "\n"
    toml.write_text(user_toml + ("" if "[kv_cache]" in user_toml else SERVER_TOML))
    bucketserve = [str(Path(sys.executable).with_name("bucketserve"))]
    if not Path(bucketserve[0]).exists():
        bucketserve = [sys.executable, "-m", "bucketserve.server.cli"]
    procs = {}
    port = free_port()
    procs["bucketserve"] = start("bucketserve", [*bucketserve, "serve", "--port", str(port),
                                                 "--buckets", str(toml), "--embedding-model",
                                                 MODEL, "--log-level", "warning"], port, logdir)
    for spec in args.other_bucketserve:
        name, checkout = spec.split("=", 1)
        port = free_port()
        procs[name] = start(name, [sys.executable, "-c", "import sys; from bucketserve.server."
                                   "cli import main; sys.exit(main())", "serve", "--port",
                                   str(port), "--buckets", str(toml), "--embedding-model", MODEL,
                                   "--log-level", "warning"], port, logdir,
                            pythonpath=str(Path(checkout).resolve()))
    for mode in [b for b in args.baselines.split(",") if b]:
        port = free_port()
        procs[mode] = start(mode, [sys.executable, __file__, "--serve-baseline", mode,
                                   "--port", str(port)], port, logdir)
    try:
        for proc in procs.values():
            wait_healthy(proc, logdir)
        print(f"{len(texts)} texts per round, {args.clients} clients, servers: {list(procs)}; "
              f"logs in {logdir}", flush=True)
        for proc in procs.values():  # warm-up
            asyncio.run(load(proc.bench_url, texts[:32], args.clients))  # type: ignore[attr-defined]
        rounds: dict[str, list[float]] = {name: [] for name in procs}
        bucketserve_s = 0.0
        lat: dict[str, list[float]] = {}
        before = scrape(procs["bucketserve"].bench_url)  # type: ignore[attr-defined]
        for r in range(args.repeats):
            for name, proc in procs.items():
                secs, latencies = asyncio.run(load(proc.bench_url, texts, args.clients))  # type: ignore[attr-defined]
                rounds[name].append(secs)
                if name == "bucketserve":
                    bucketserve_s += secs
                if secs == min(rounds[name]):
                    lat[name] = latencies
                print(f"round {r}: {name:18s} {len(texts) / secs:7.1f} texts/s", flush=True)
        after = scrape(procs["bucketserve"].bench_url)  # type: ignore[attr-defined]
    finally:
        for proc in procs.values():
            stop(proc)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    computed = delta("bucketserve_embedding_computed_tokens_total")
    useful = delta("bucketserve_embedding_useful_tokens_total")
    batches = delta("bucketserve_embedding_batch_size_count")
    result: dict = {"bench": "embeddings_online", "n_texts": len(texts), "clients": args.clients,
                    "boundaries": args.boundaries, "max_merged_padding": args.max_merged_padding,
                    "load_average_at_start": load_at_start, "isa": args.isa,
                    "isa_env": ISA_ENV.get(args.isa, {}), "aten_cpu_capability": capability,
                    "texts_per_s": {}, "p50_latency_s": {}, "p99_latency_s": {}}
    for name, secs in rounds.items():
        result["texts_per_s"][name] = len(texts) / min(secs)
        result["p50_latency_s"][name] = pct(lat[name], 0.5)
        result["p99_latency_s"][name] = pct(lat[name], 0.99)
    result["median_texts_per_s"] = {name: len(texts) / statistics.median(secs)
                                    for name, secs in rounds.items()}
    ours = result["texts_per_s"]["bucketserve"]
    result["ratios"] = {f"bucketserve/{b}": ours / v
                        for b, v in result["texts_per_s"].items() if b != "bucketserve"}
    # Each round runs the systems back to back, so a per-round ratio is less exposed to the
    # load of other processes drifting between rounds than the ratio of best rounds.
    result["median_round_ratios"] = {
        f"bucketserve/{b}": statistics.median(
            s / o for s, o in zip(secs, rounds["bucketserve"], strict=True))
        for b, secs in rounds.items() if b != "bucketserve"}
    result["padding_waste"] = 1.0 - useful / computed if computed else None
    result["mean_batch_size"] = delta("bucketserve_embedding_batch_size_sum") / batches if batches else None
    result["merged_batches"] = delta("bucketserve_embedding_merged_batches_total")
    result["encoder_busy_fraction"] = (delta("bucketserve_embedding_encoder_seconds_total")
                                       / bucketserve_s)
    result["rounds_s"] = rounds
    for name, v in result["texts_per_s"].items():
        print(f"{name:18s} {v:7.1f} texts/s  p50 {result['p50_latency_s'][name] * 1000:6.0f} ms"
              f"  p99 {result['p99_latency_s'][name] * 1000:6.0f} ms")
    print("ratios of best rounds: " + ", ".join(f"{k} {v:.2f}x"
                                               for k, v in result["ratios"].items()))
    print("median of per-round ratios: " + ", ".join(
        f"{k} {v:.2f}x" for k, v in result["median_round_ratios"].items()))
    if computed:
        print(f"bucketserve padding waste {result['padding_waste']:.1%}, mean batch size "
              f"{result['mean_batch_size']:.2f} over {batches:.0f} batches "
              f"({result['merged_batches']:.0f} merged), encoder busy "
              f"{result['encoder_busy_fraction']:.0%} of the measured time")
    else:
        print("bucketserve /metrics has no embedding counters (is the collector registered?)")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
