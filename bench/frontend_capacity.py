#!/usr/bin/env python3
"""What the front end (HTTP server, tokenization, detokenization, SSE) sustains on this CPU.

Each server is the real `bucketserve serve` (real model, tokenizer, limits, every front-end
line), but its engine core is the fake one (engine/fake_core.py, BUCKETSERVE_FAKE_CORE):
every --step-s it gives each running sequence one token without running the model. So the
output tok/s measured here is the front end's, not the engine's; the CPU seconds that each
part used (front-end processes, core, load client) are read from /proc over the timed run.
The key figure is `frontend_cpu_us_per_token`: front-end CPU time per output token, which
a shared, loaded machine disturbs far less than tok/s.

    PYTHONPATH=. python bench/frontend_capacity.py --rounds 2 \\
        --server before=/path/to/old/checkout --server after=$PWD \\
        '--server=after_w2=$PWD;--api-workers 2' --out bench/results/frontend_capacity_cpu.json

Every server is started first; then the load client (`bucketserve bench`, closed loop at
--streams, streaming, ignore_eos, text prompts so that tokenization is measured too) runs
against them in turn, round after round, so a change in the machine's load hits all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.5\n[scheduler]\nmax_running = 256\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    model, flags = None, []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in have]
    return {"cpu_model": model, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "loadavg_start": os.getloadavg()}


class Server:
    def __init__(self, name: str, pythonpath: str, flags: list[str], workdir: Path,
                 step_s: float) -> None:
        self.name, self.port = name, free_port()
        buckets = workdir / "buckets.toml"
        buckets.write_text(BUCKETS)
        env = dict(os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                   BUCKETSERVE_FAKE_CORE=str(step_s))
        cmd = [sys.executable, "-c",
               "import sys; from bucketserve.bench.hooks import main; sys.exit(main())",
               "serve", "--port", str(self.port), "--buckets", str(buckets),
               "--embedding-model", "none", "--log-level", "info", *flags]
        self.log_path = workdir / f"{name}.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, limit_s: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready")

    def core_pid(self) -> int:
        m = re.search(r"engine core ready in process (\d+)", self.log_path.read_text())
        if m is None:
            raise RuntimeError(f"{self.name}: no core pid in its log")
        return int(m.group(1))

    def cpu(self) -> tuple[float, float]:
        """(front-end processes' CPU seconds, the core's), children included."""
        core = self.core_pid()
        front = core_s = 0.0
        top = psutil.Process(self.proc.pid)
        for p in [top, *top.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            if p.pid == core:
                core_s += t.user + t.system
            else:
                front += t.user + t.system
        return front, core_s

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def load(server: Server, a: argparse.Namespace, out: str) -> dict:
    cmd = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url",
           f"http://127.0.0.1:{server.port}", "--num-requests", str(a.num_requests),
           "--prompt-len", a.prompt_len, "--output-len", a.output_len, "--prompt-kind",
           a.prompt_kind, "--concurrency", str(a.streams), "--workers", str(a.client_workers),
           "--seed", "0", "--out", out]
    f0, c0 = server.cpu()
    t0 = time.monotonic()
    client = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client_cpu = 0.0
    procs = {}
    while client.poll() is None:  # children's CPU is only counted once they are waited for
        for p in [client, *client.children(recursive=True)]:
            try:
                t = p.cpu_times()
                procs[p.pid] = t.user + t.system + getattr(t, "children_user", 0.0) \
                    + getattr(t, "children_system", 0.0)
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.2)
    wall = time.monotonic() - t0
    f1, c1 = server.cpu()
    client_cpu = sum(procs.values())
    if client.returncode != 0:
        raise RuntimeError(f"bench failed: {client.stderr.read().decode()[-2000:]}")
    with open(out) as f:
        r = json.load(f)
    toks = r["output_throughput"] * r["duration_s"]
    return {"output_tokens_per_s": r["output_throughput"],
            "requests_per_s": r["request_throughput"], "errors": r["errors"],
            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
            "itl_p50_ms": r["itl_ms"]["p50"], "itl_p99_ms": r["itl_ms"]["p99"],
            "duration_s": r["duration_s"], "wall_s": wall, "output_tokens": toks,
            "frontend_cpu_s": f1 - f0, "core_cpu_s": c1 - c0, "client_cpu_s": client_cpu,
            "frontend_cpu_us_per_token": 1e6 * (f1 - f0) / toks,
            "client_cpu_us_per_token": 1e6 * client_cpu / toks,
            "loadavg": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True,
                    help="NAME=PYTHONPATH[;FLAGS] (space-separated flags of `bucketserve serve`)")
    ap.add_argument("--step-s", type=float, default=0.005, help="the fake core's step period")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=768)
    ap.add_argument("--prompt-len", default="loguniform:16:1024")
    ap.add_argument("--output-len", default="uniform:16:256")
    ap.add_argument("--prompt-kind", choices=("ids", "text"), default="text")
    ap.add_argument("--client-workers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "frontend_capacity_cpu.json"))
    a = ap.parse_args()
    specs = []
    for s in a.server:
        name, rest = s.split("=", 1)
        path, _, flags = rest.partition(";")
        specs.append((name, path, flags.split()))
    info = machine()
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in specs}
    with tempfile.TemporaryDirectory(prefix="fecap-") as tmp:
        servers = []
        try:
            for name, path, flags in specs:
                d = Path(tmp) / name
                d.mkdir()
                servers.append(Server(name, path, flags, d, a.step_s))
            for s in servers:
                s.wait_ready()
            for rnd in range(a.rounds):
                for s in servers:
                    r = load(s, a, f"{tmp}/{s.name}_{rnd}.json")
                    runs[s.name].append(r)
                    print(f"round {rnd} {s.name:>12}: {r['output_tokens_per_s']:8,.0f} tok/s  "
                          f"front end {r['frontend_cpu_us_per_token']:6.1f} CPU us/token "
                          f"({r['frontend_cpu_s']:.1f} s)  core {r['core_cpu_s']:.1f} s  client "
                          f"{r['client_cpu_us_per_token']:.1f} us/token  TTFT p50 "
                          f"{r['ttft_p50_ms']:.0f} ms  ITL p50 {r['itl_p50_ms']:.1f} ms  "
                          f"errors {r['errors']}", flush=True)
        finally:
            for s in servers:
                s.stop()
    summary = {name: {k: statistics.median(r[k] for r in rs)
                      for k in ("output_tokens_per_s", "frontend_cpu_us_per_token",
                                "ttft_p50_ms", "itl_p50_ms")}
               for name, rs in runs.items() if rs}
    for name, m in summary.items():
        print(f"median {name:>12}: {m['output_tokens_per_s']:8,.0f} tok/s, "
              f"{m['frontend_cpu_us_per_token']:.1f} front-end CPU us per output token")
    with open(a.out, "w") as f:
        json.dump({"machine": info, "config": vars(a), "runs": runs, "median": summary,
                   "measured_unix": time.time()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
