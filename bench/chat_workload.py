"""Multi-turn chat workload for prefix caching: time to first token with caching on vs off.

The workload (seeded): C conversations of T turns that all start with the same long system
prompt. Each turn adds a user message to the conversation's history and streams the reply
(greedy); the next turn is sent once the reply has arrived, with the reply appended as the
assistant's message. At most `--concurrency` conversations are in flight at once. Every
turn's prompt therefore starts with the system prompt and, from turn 2 on, with the whole
earlier conversation: the traffic that prefix caching is for.

Measured per request on the client: time to first token (request sent -> first streamed
content), end-to-end latency; per run: output tokens/s over the run's wall time and the
prefix-cache hit rate in tokens, from the server's /metrics (the difference over the run,
so the server's warm-up is not counted): bucketserve_prefix_cache_{hits,queries}_total, or
vLLM's vllm:prefix_cache_{hits,queries}_total; `--metrics none` skips it.

Two ways to run it:

    # our server, started twice (prefix caching on, then off), one after the other
    python bench/chat_workload.py --out bench/results/chat_workload_cpu.json

    # any OpenAI-compatible server already running, e.g. vLLM (with its own prefix caching)
    python bench/chat_workload.py --base-url http://127.0.0.1:8000 --model MODEL \\
        --label vllm --metrics vllm --conversations 64 --turns 4 --concurrency 64

`--write-jsonl FILE` also writes the scripted conversations (system prompt, user turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

# plain English words: text that tokenizes like prose (about 1.2 tokens a word)
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy process music market
sense nation plan college interest death experience effect use class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure
street image phone data picture practice piece land product doctor wall patient worker news test
movie north love support technology step baby computer type attention film tree source organization
hair window evidence population site ability stage period century rule language""".split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_workload(seed: int, conversations: int, turns: int, system_words: int,
                  user_words: tuple[int, int]) -> tuple[str, list[list[str]]]:
    """The system prompt and, per conversation, its user messages (one per turn)."""
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < system_words:
        sentences.append(words(rng, rng.randint(8, 20)).capitalize() + ".")
    system = "You are a helpful assistant for a research team. Background notes follow. " + \
        " ".join(sentences)
    convs = []
    for c in range(conversations):
        msgs = []
        for t in range(turns):
            body = words(rng, rng.randint(*user_words))
            msgs.append(f"Question {t + 1} of conversation {c}: tell me about {body}?")
        convs.append(msgs)
    return system, convs


# ---------------------------------------------------------------------------------- client


async def one_turn(client: httpx.AsyncClient, base_url: str, model: str, messages: list[dict],
                   max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage = None
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    e2e = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "text": "".join(text),
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}


async def run_workload(base_url: str, model: str, system: str, convs: list[list[str]],
                       concurrency: int, max_tokens: int) -> tuple[list[dict], float, list[list[str]]]:
    """Runs every conversation; returns per-request records, the wall time and the replies."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(convs)):
        queue.put_nowait(i)
    records: list[dict] = []
    replies: list[list[str]] = [[] for _ in convs]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                c = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            history = [{"role": "system", "content": system}]
            for t, user in enumerate(convs[c]):
                history.append({"role": "user", "content": user})
                rec = await one_turn(client, base_url, model, history, max_tokens)
                history.append({"role": "assistant", "content": rec["text"]})
                replies[c].append(rec.pop("text"))
                rec.update(conversation=c, turn=t)
                records.append(rec)

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(min(concurrency, len(convs)))))
        wall = time.perf_counter() - t0
    return records, wall, replies


# --------------------------------------------------------------------------------- metrics

METRIC_NAMES = {
    "bucketserve": ("bucketserve_prefix_cache_hits_total", "bucketserve_prefix_cache_queries_total"),
    "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
}


def scrape(base_url: str, kind: str) -> dict[str, float] | None:
    """{"hits": h, "queries": q} summed over label sets, or None when not available."""
    if kind == "none":
        return None
    try:
        text = httpx.get(base_url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    kinds = list(METRIC_NAMES) if kind == "auto" else [kind]
    for k in kinds:
        hits_name, queries_name = METRIC_NAMES[k]
        got = {"hits": 0.0, "queries": 0.0}
        found = False
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([^ ]+)", line)
            if not m:
                continue
            if m.group(1) == hits_name:
                got["hits"] += float(m.group(3))
                found = True
            elif m.group(1) == queries_name:
                got["queries"] += float(m.group(3))
        if found:
            return got
    return None


def summarize(label: str, records: list[dict], wall: float, before, after) -> dict:
    ttft = sorted(r["ttft_s"] for r in records)
    e2e = sorted(r["e2e_s"] for r in records)
    out_tokens = sum(r["completion_tokens"] or 0 for r in records)
    prompt_tokens = [r["prompt_tokens"] for r in records if r["prompt_tokens"] is not None]

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)

    result = {
        "label": label,
        "requests": len(records),
        "wall_s": round(wall, 2),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p90_s": pct(ttft, 0.9),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "ttft_first_turn_p50_s": round(statistics.median(
            r["ttft_s"] for r in records if r["turn"] == 0), 4),
        "ttft_later_turns_p50_s": round(statistics.median(
            [r["ttft_s"] for r in records if r["turn"] > 0] or [float("nan")]), 4),
        "e2e_p50_s": round(statistics.median(e2e), 4),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "prompt_tokens_mean": round(statistics.fmean(prompt_tokens), 1) if prompt_tokens else None,
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }
    cached = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    if cached and prompt_tokens:
        result["usage_cached_tokens_rate"] = round(sum(cached) / sum(prompt_tokens), 4)
    if before is not None and after is not None:
        q = after["queries"] - before["queries"]
        h = after["hits"] - before["hits"]
        result.update(prefix_cache_query_tokens=int(q), prefix_cache_hit_tokens=int(h),
                      prefix_cache_hit_rate=round(h / q, 4) if q else 0.0)
    return result


# ---------------------------------------------------------------------------- our server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_bucketserve(workdir: Path, caching: bool, args) -> tuple[subprocess.Popen, str, Path]:
    buckets = workdir / f"buckets-{'on' if caching else 'off'}.toml"
    buckets.write_text(args.buckets_extra + "\n[kv_cache]\n"
                       f"prefix_caching = {'true' if caching else 'false'}\n")
    log_path = workdir / f"server-{'on' if caching else 'off'}.log"
    port = free_port()
    script = Path(sys.executable).with_name("bucketserve")
    cmd = [str(script)] if script.exists() else [
        sys.executable, "-c", "import sys; from bucketserve.server.cli import main; sys.exit(main())"]
    cmd += ["serve", "--host", "127.0.0.1", "--port", str(port), "--buckets", str(buckets),
            "--embedding-model", "none", "--model", args.model, "--device", args.device,
            "--dtype", args.dtype]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base, log_path
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server not healthy after 900 s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure(base_url: str, label: str, model: str, system: str, convs, args) -> tuple[dict, list]:
    before = scrape(base_url, args.metrics)
    records, wall, replies = asyncio.run(run_workload(base_url, model, system, convs,
                                                      args.concurrency, args.max_tokens))
    after = scrape(base_url, args.metrics)
    result = summarize(label, records, wall, before, after)
    print(json.dumps(result), flush=True)
    return result, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None,
                    help="an OpenAI-compatible server already running (e.g. vLLM): one run "
                         "against it; without it, bucketserve is started with caching on, then off")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model name sent in requests (and passed to `bucketserve serve`)")
    ap.add_argument("--label", default=None, help="name of the run in the results (--base-url)")
    ap.add_argument("--metrics", choices=("auto", "bucketserve", "vllm", "none"), default="auto",
                    help="where the hit rate comes from; none: skip /metrics")
    ap.add_argument("--caching", choices=("both", "on", "off"), default="both",
                    help="which bucketserve runs to start (without --base-url)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--buckets-extra", default="",
                    help="TOML prepended to the started servers' buckets file ([kv_cache] excluded)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    ap.add_argument("--system-words", type=int, default=930,
                    help="system prompt length in words (930: about 1,000 SmolLM2 tokens)")
    ap.add_argument("--user-words", type=int, nargs=2, default=(20, 50), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-jsonl", type=Path, default=None,
                    help="also write the scripted conversations, one JSON object a line")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chat_workload_cpu.json")
    args = ap.parse_args()

    system, convs = make_workload(args.seed, args.conversations, args.turns, args.system_words,
                                  tuple(args.user_words))
    if args.write_jsonl:
        with args.write_jsonl.open("w") as f:
            for c, msgs in enumerate(convs):
                f.write(json.dumps({"conversation": c, "system": system, "user_turns": msgs}) + "\n")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "write_jsonl")}
    result: dict = {
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "concurrency": args.concurrency, "system_words": args.system_words,
                     "user_words": list(args.user_words), "max_tokens": args.max_tokens,
                     "seed": args.seed, "temperature": 0.0},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()},
        "runs": [],
    }
    if args.base_url:
        run, _ = measure(args.base_url.rstrip("/"), args.label or args.base_url, args.model,
                         system, convs, args)
        result["runs"].append(run)
    else:
        replies = {}
        with tempfile.TemporaryDirectory() as tmp:
            for caching in {"both": (True, False), "on": (True,), "off": (False,)}[args.caching]:
                label = f"bucketserve prefix_caching={'on' if caching else 'off'}"
                t0 = time.perf_counter()
                proc, base, _ = start_bucketserve(Path(tmp), caching, args)
                print(f"{label}: server up in {time.perf_counter() - t0:.1f} s", flush=True)
                try:
                    run, replies[caching] = measure(base, label, args.model, system, convs, args)
                finally:
                    stop(proc)
                result["runs"].append(run)
        if len(replies) == 2:
            # greedy: caching must not change a single reply
            result["replies_identical"] = replies[True] == replies[False]
            on, off = result["runs"]
            result["ttft_p50_speedup"] = round(off["ttft_p50_s"] / on["ttft_p50_s"], 2)
            result["output_throughput_ratio"] = round(on["output_tokens_per_s"] /
                                                      off["output_tokens_per_s"], 2)
            print(f"TTFT p50: {on['ttft_p50_s']:.3f} s with caching vs {off['ttft_p50_s']:.3f} s "
                  f"without ({result['ttft_p50_speedup']}x); hit rate "
                  f"{on.get('prefix_cache_hit_rate')}; replies identical: "
                  f"{result['replies_identical']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
