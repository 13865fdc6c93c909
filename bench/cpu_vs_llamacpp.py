"""CPU, one run: bucketserve's quantized weights (q4_1, int8) and float32 vs llama.cpp's server,
served, on the same GGUF file.

Every system serves SmolLM2-135M-Instruct from the shipped GGUF (Q4_1 projections, Q8_0
embedding): bucketserve with --quantization q4_1 (the GGUF's own blocks), int8 (per-channel
int8 weights from the dequantized file) and none (float32), and llama.cpp's `llama-server`
(built from the llama-cpp-python sdist: docs/quantization.md says how) with continuous batching and 16
slots (-np 16 -cb, a context of 16 x 2048 tokens, prompt cache and its RAM cache off). All
servers are started first, then driven one at a time by the shared load client
(../shared/bench/loadgen.py: streaming completions, closed loop at --concurrency, EOS
ignored), each workload --runs times after a warm-up, the systems interleaved per run so
that a change in the machine's load falls on all of them; medians of output tokens/s, ITL
p50 and TTFT p50. Prefix caching is off on both sides. Records the CPU model and flags and
the load average before each run. Run it under `flock -x /work/cpu.lock`.

    PYTHONPATH=. python bench/cpu_vs_llamacpp.py --llama-server PATH/llama-server \\
        --out bench/results/cpu_vs_llamacpp_amd.json [--env-avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_vs_vllm import (
    ROOT,
    WORKLOADS,
    cpu_info,
    free_port,
    launch,
    load_avg,
    loadgen,
    no_prefix_cache_toml,
    stop,
)

MODEL = "smollm2-135m-instruct"  # the name both servers answer to
# bucketserve systems: "bucketserve-<--quantization>"
QUANT = {"bucketserve-q4_1": "q4_1", "bucketserve-int8": "int8", "bucketserve-fp32": "none"}
# --env-avx2: the AVX2 kernels on an AVX-512 host (PyTorch's, oneDNN's, MKL's and ours)
# (`serve --cpu-isa avx2` sets the same environment itself; here it is recorded with the run)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
CTX_PER_SLOT = 2048  # the longest request: 1024 prompt + 256 output tokens


def gguf_path() -> Path:
    from bucketserve.models.registry import resolve

    return resolve(MODEL).path


def start(system: str, args, tmp: Path) -> tuple[subprocess.Popen, int, dict]:
    port = free_port()
    env = dict(os.environ)
    if system == "llamacpp":
        cmd = [args.llama_server, "-m", str(gguf_path()), "--host", "127.0.0.1", "--port",
               str(port), "-np", str(args.concurrency), "-cb",
               "-c", str(CTX_PER_SLOT * args.concurrency), "-t", str(args.threads),
               "-tb", str(args.threads), "--no-cache-prompt", "--cache-ram", "0",
               "--no-webui", "--alias", MODEL]
    else:
        cmd = [sys.executable, "-m", "bucketserve.server.cli", "serve", "--port", str(port),
               "--model", MODEL, "--embedding-model", "none", "--dtype", "float32",
               "--quantization", QUANT[system], "--log-level", "info",
               "--buckets", str(no_prefix_cache_toml(tmp))]
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        if args.env_avx2:
            cmd += ["--cpu-isa", "avx2"]
            env.update(AVX2_ENV)
            env["XDG_CACHE_HOME"] = str(tmp / "cache")  # a fresh build of our kernels for AVX2
    return launch(system, cmd, env, port, MODEL, args, tmp)


def summary(s: dict) -> dict:
    return {"output_tok_s": round(s["output_throughput"], 1),
            "itl_p50_ms": round(s["itl_ms"]["p50"], 1), "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1),
            "ttft_p99_ms": round(s["ttft_ms"]["p99"], 1), "duration_s": round(s["duration_s"], 2),
            "errors": s["errors"], "completed": s["completed"],
            "output_tokens": s["total_output_tokens"],
            "expected_output_tokens": s["expected_output_tokens"]}


def kernel_lines(log: Path) -> list[str]:
    """The start-up log lines that name the CPU kernels (bucketserve's quantization plan,
    llama.cpp's system info)."""
    keep = ("quantization:", "CPU GEMM", "system_info", "CPU :", "AVX")
    return [line.strip()[:400] for line in log.read_text(errors="replace").splitlines()
            if any(k in line for k in keep)][:6]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--client-python", default=sys.executable,
                    help="python with aiohttp + numpy for the load client")
    ap.add_argument("--systems", default="bucketserve-q4_1,bucketserve-int8,bucketserve-fp32,llamacpp")
    ap.add_argument("--workloads", default="mixed,short")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp's -t / -tb (bucketserve uses every core by default)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests (smoke runs)")
    ap.add_argument("--env-avx2", action="store_true",
                    help="bucketserve with its AVX2 kernels forced (llama.cpp: pass an AVX2 build)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    systems = args.systems.split(",")
    workloads = [WORKLOADS / f"{w}.jsonl" for w in args.workloads.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="cpu_vs_llamacpp_"))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_info(),
                 "env_avx2": AVX2_ENV if args.env_avx2 else None,
                 "concurrency": args.concurrency, "runs": args.runs, "systems": {},
                 "llama_server_version": subprocess.run(
                     [args.llama_server, "--version"], capture_output=True, text=True,
                     check=False).stderr.strip()[-300:]}
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for system in systems:
            proc, port, info = start(system, args, tmp)
            servers[system] = (proc, port)
            res["systems"][system] = {**info, **{wl.stem: {"runs": []} for wl in workloads}}
        for r in range(args.runs):
            for wl in workloads:
                for system in systems:
                    la = load_avg()
                    s = loadgen(args.client_python, servers[system][1], MODEL, wl,
                                args.concurrency, tmp / f"{system}_{wl.stem}_{r}.json",
                                f"{system} {wl.stem} run {r}", limit=args.limit)
                    run = {**summary(s), "load_avg_1m_start": la}
                    res["systems"][system][wl.stem]["runs"].append(run)
                    print(f"{system} {wl.stem} run {r}: {run}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    for system in systems:
        out = res["systems"][system]
        out["kernels"] = kernel_lines(tmp / f"{system}_server.log")
        for wl in workloads:
            runs = out[wl.stem]["runs"]
            out[wl.stem]["median"] = {k: statistics.median(x[k] for x in runs) for k in
                                      ("output_tok_s", "itl_p50_ms", "ttft_p50_ms")}
    peer = res["systems"].get("llamacpp")
    print("\n| system | workload | output tok/s | vs llama.cpp | ITL p50 ms | TTFT p50 ms |")
    print("|---|---|---|---|---|---|")
    for system in systems:
        for wl in workloads:
            m = res["systems"][system][wl.stem]["median"]
            ratio = (f"{m['output_tok_s'] / peer[wl.stem]['median']['output_tok_s']:.2f}x"
                     if peer else "")
            print(f"| {system} | {wl.stem} | {m['output_tok_s']:.1f} | {ratio} | "
                  f"{m['itl_p50_ms']:.1f} | {m['ttft_p50_ms']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
