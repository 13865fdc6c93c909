"""Issue 18 must-show 3: what guided decoding costs under load, and whether grammar compilation
stalls other streams. One server (bucketserve, or any OpenAI server such as vLLM given by
--server-cmd), the mixed workload of `bucketserve bench` split in two halves sent at the same
time by two load clients: run B "schema" (the second half carries a JSON-schema
response_format, every request a different schema, so each one compiles; ignore_eos off: each
ends where its document ends), then run A "plain" on the same requests without schemas, each
second-half request given max_tokens = the tokens its schema run made, so that both runs make
the same tokens and the ratio is the grammar's cost alone (compilation, masks, the host round
trip a mask needs). Reported per run: output tok/s and ITL p99 of all streams and of the free-text
half; then the ratios B / A (targets: tok/s >= 0.9x, ITL p99 <= 1.2x).

H200 (1B shape, random weights): start each server on the same model directory, e.g.
  python bench/structured_gpu.py --server-cmd "bucketserve serve --model /tmp/model-llama-1b
      --device cuda --port 8000" --out /tmp/structured_bucketserve.json
  python bench/structured_gpu.py --server-cmd "vllm serve /tmp/model-llama-1b --port 8000
      --no-enable-prefix-caching" --out /tmp/structured_vllm.json
(bench/online_gpu_vs_vllm.sh shows how the random-weight 1B directory is made.)
Dry run on a CPU (the default model, a few requests, to check the flow):
  PYTHONPATH=$PWD python bench/structured_gpu.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SCHEMA_COUNT = 4096  # distinct schemas: field names vary, so none is a cache hit


def schema(i: int) -> dict:
    """A bounded schema, different for every i (the names carry i)."""
    return {"type": "object", "properties": {
        f"name_{i}": {"type": "string", "maxLength": 24},
        f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 10**6},
        f"tags_{i}": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        f"kind_{i}": {"enum": ["alpha", "beta", "gamma"]}},
        "required": [f"name_{i}", f"count_{i}", f"tags_{i}", f"kind_{i}"]}


def wait_healthy(base: str, proc: subprocess.Popen, limit_s: float = 900.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError("server not healthy in time")


def bench_half(base: str, args, half: str, schema_offset: int | None, out: Path,
               lengths: dict[int, int] | None = None) -> subprocess.Popen:
    """One load client: `bucketserve bench` on half of the streams. With schema_offset, every
    request carries a JSON schema (a per-request extra: the workload's JSONL `extra` field) and
    ends where its JSON document ends (ignore_eos off, as users send it). With `lengths`
    (request index -> output tokens), those requests get exactly that many tokens."""
    workload = out.with_suffix(".jsonl")
    gen = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url", base, "--dry-run",
           "--num-requests", str(args.requests // 2), "--prompt-len", args.prompt_len,
           "--output-len", args.output_len, "--endpoint", "chat", "--prompt-kind", "text",
           "--seed", str(1 if half == "b" else 0), "--save-trace", str(workload)]
    subprocess.run(gen, check=True, stdout=subprocess.DEVNULL)
    if schema_offset is not None or lengths:
        lines = [json.loads(x) for x in workload.read_text().splitlines() if x.strip()]
        for j, d in enumerate(lines):
            if schema_offset is not None:
                d["extra"] = {"ignore_eos": False, "response_format": {
                    "type": "json_schema", "json_schema": {
                        "name": "s", "schema": schema(schema_offset + j), "strict": True}}}
            elif j in lengths:
                d["output_tokens"] = lengths[j]
        workload.write_text("".join(json.dumps(d) + "\n" for d in lines))
    cmd = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url", base, "--workload",
           str(workload), "--concurrency", str(args.streams // 2), "--out", str(out),
           "--per-request-out", str(out.with_suffix(".requests.jsonl"))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def output_lengths(per_request: Path) -> dict[int, int]:
    """Request index -> completion tokens of the requests that completed."""
    out = {}
    for line in per_request.read_text().splitlines():
        r = json.loads(line)
        if r.get("usage_completion_tokens"):
            out[r["i"]] = r["usage_completion_tokens"]
    return out


def run_pair(base: str, args, with_schema: bool, tag: str, tmp: Path, offset: int,
             lengths: dict[int, int] | None = None) -> dict:
    a = bench_half(base, args, "a", None, tmp / f"{tag}_a.json")
    b = bench_half(base, args, "b", offset if with_schema else None, tmp / f"{tag}_b.json",
                   lengths)
    for h, p in (("a", a), ("b", b)):
        # exit status 1: some requests failed (the summary says which); no summary: it crashed
        if p.wait() != 0 and not (tmp / f"{tag}_{h}.json").exists():
            raise RuntimeError(f"load client failed ({tag}, half {h})")
    sa, sb = (json.loads((tmp / f"{tag}_{h}.json").read_text()) for h in ("a", "b"))
    for h, r in (("a", sa), ("b", sb)):
        if r["errors"]:
            print(f"{tag} half {h}: {r['errors']} errors, e.g. {r['error_samples'][:3]}", flush=True)
    return {"free_half": sa, "second_half": sb,
            "output_tok_s": sa["output_throughput"] + sb["output_throughput"],
            "free_itl_p99_ms": sa["itl_ms"].get("p99"),
            "errors": sa["errors"] + sb["errors"],
            "second_half_lengths": output_lengths(tmp / f"{tag}_b.requests.jsonl")}


def summarize(plains: list[dict], schemas: list[dict]) -> dict:
    """Medians over the repeats of each run kind, and their ratios (schema / plain)."""
    tok_p = statistics.median(r["output_tok_s"] for r in plains)
    tok_s = statistics.median(r["output_tok_s"] for r in schemas)
    itl = [statistics.median(r["free_itl_p99_ms"] for r in runs)
           if all(r["free_itl_p99_ms"] for r in runs) else None for runs in (plains, schemas)]
    return {"plain": plains[len(plains) // 2], "schema": schemas[len(schemas) // 2],
            "plain_runs": plains, "schema_runs": schemas,
            "plain_tok_s": tok_p, "schema_tok_s": tok_s,
            "plain_free_itl_p99_ms": itl[0], "schema_free_itl_p99_ms": itl[1],
            "tok_s_ratio": tok_s / tok_p,
            "free_itl_p99_ratio": itl[1] / itl[0] if itl[0] and itl[1] else None,
            "errors": [r["errors"] for r in plains + schemas]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-cmd", default=None, help="starts the server (else: --base-url)")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=1024, help="requests (half get schemas)")
    ap.add_argument("--streams", type=int, default=256, help="concurrent streams, half per client")
    ap.add_argument("--prompt-len", default="loguniform:16:1024")
    ap.add_argument("--output-len", default="uniform:16:256")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed plain / schema pairs (medians)")
    ap.add_argument("--warmup", type=int, default=1, help="1: one untimed pair of each kind first")
    ap.add_argument("--dry-run", action="store_true", help="CPU: default model, 8 streams")
    ap.add_argument("--dry-output-len", default="uniform:8:24", help="--dry-run's output lengths")
    args = ap.parse_args()
    proc = None
    if args.dry_run:
        args.requests, args.streams = 8, 8
        args.prompt_len, args.output_len = "uniform:8:32", args.dry_output_len
        args.repeats, args.warmup = 1, 0
        args.server_cmd = args.server_cmd or (f"{sys.executable} -m bucketserve.server.cli serve "
                                              "--port 8765 --embedding-model none")
        args.base_url = "http://127.0.0.1:8765"
    if args.server_cmd:
        proc = subprocess.Popen(shlex.split(args.server_cmd))
    try:
        if proc is not None:
            wait_healthy(args.base_url, proc)
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            if args.warmup:  # untimed: one free pair and one schema pair, schemas of their own
                run_pair(args.base_url, args, False, "warm_plain", tmp, 0)
                run_pair(args.base_url, args, True, "warm_schema", tmp, SCHEMA_COUNT * 8)
            plains, schemas = [], []
            for r in range(args.repeats):  # fresh schemas every repeat: none is a cache hit
                schemas.append(run_pair(args.base_url, args, True, f"schema{r}", tmp,
                                        SCHEMA_COUNT * (r + 1)))
                # the same requests without schemas, each making as many tokens as its schema
                # run made (a JSON document ends early; free text runs to max_tokens)
                plains.append(run_pair(args.base_url, args, False, f"plain{r}", tmp, 0,
                                       schemas[-1]["second_half_lengths"]))
        report = summarize(plains, schemas)
        print(json.dumps({k: report[k] for k in ("tok_s_ratio", "free_itl_p99_ratio")}))
        print(f"plain: {report['plain_tok_s']:.0f} tok/s, free-half ITL p99 "
              f"{report['plain_free_itl_p99_ms']} ms; schema: {report['schema_tok_s']:.0f} tok/s, "
              f"free-half ITL p99 {report['schema_free_itl_p99_ms']} ms (medians of "
              f"{args.repeats}); errors {report['errors']}")
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
