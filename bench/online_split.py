"""Served throughput: the engine core in its own process vs in a thread, in one run.

Starts every server given (each `NAME=PYTHONPATH[:FLAGS]`, e.g. the old in-thread server
from another checkout and this one with and without --engine-in-process) at once, then
runs the load client against them in turn, round after round (A B C, A B C, ...), so
that a change in the machine's load hits every server alike. Only one server has work
at a time; the others idle. The load client is ../shared/bench/loadgen.py (closed loop at
--concurrency, streaming, ignore_eos, usage from the stream); it needs aiohttp and numpy,
so it runs under --client-python.

    python bench/online_split.py --rounds 3 \\
        --server old=/work/main --server split=$PWD --server thread=$PWD:--engine-in-process \\
        --client-python /tmp/lgvenv/bin/python --out bench/results/online_split_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.5\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, pythonpath: str, flags: list[str], workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    buckets = workdir / "buckets.toml"
    buckets.write_text(BUCKETS)
    env = dict(os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "import sys; from bucketserve.server.cli import main; sys.exit(main())",
           "serve", "--port", str(port), "--buckets", str(buckets), "--embedding-model", "none",
           "--log-level", "warning", *flags]
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, limit_s: float = 900.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in time")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (the engine core)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                todo += [int(k) for k in kids]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def load(client_python: str, loadgen: str, url: str, workload: str, concurrency: int,
         out: Path, limit: int | None) -> dict:
    cmd = [client_python, loadgen, "--base-url", url, "--model", "smollm2-135m-instruct",
           "--workload", workload, "--concurrency", str(concurrency), "--out", str(out)]
    if limit:
        cmd += ["--limit", str(limit)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, metavar="NAME=PYTHONPATH[:FLAG...]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--workload", default="/work/shared/workloads/mixed.jsonl")
    ap.add_argument("--loadgen", default="/work/shared/bench/loadgen.py")
    ap.add_argument("--client-python", default=sys.executable)
    ap.add_argument("--warmup-limit", type=int, default=16, help="requests of the warm-up run")
    ap.add_argument("--limit", type=int, default=None, help="only the first N workload requests")
    ap.add_argument("--out", default="bench/results/online_split_cpu.json")
    args = ap.parse_args()

    servers = {}
    for spec in args.server:
        name, rest = spec.split("=", 1)
        path, *flags = rest.split(":")
        servers[name] = (path, flags)
    tmp = Path(tempfile.mkdtemp(prefix="online-split-"))
    procs = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally: stop the servers
    result: dict = {"concurrency": args.concurrency, "workload": args.workload, "limit": args.limit,
                    "cpu": subprocess.run("lscpu | grep 'Model name'", shell=True, text=True,
                                          capture_output=True).stdout.split(":")[-1].strip(),
                    "nproc": os.cpu_count(), "servers": {n: " ".join([p, *f]) for n, (p, f) in servers.items()},
                    "runs": {n: [] for n in servers}}
    try:
        for name, (path, flags) in servers.items():
            procs[name] = start(name, path, flags, tmp)
        for name, (proc, url) in procs.items():
            wait_healthy(proc, url)
            load(args.client_python, args.loadgen, url, args.workload, args.concurrency,
                 tmp / f"{name}-warmup.json", args.warmup_limit)
        for r in range(args.rounds):
            for name, (_, url) in procs.items():
                load1 = os.getloadavg()[0]
                cpu0 = tree_cpu_s(procs[name][0].pid)
                s = load(args.client_python, args.loadgen, url, args.workload, args.concurrency,
                         tmp / f"{name}-{r}.json", args.limit)
                run = {k: s[k] for k in ("output_throughput", "request_throughput", "duration_s",
                                         "completed", "errors", "total_output_tokens")}
                for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
                    run[k] = {q: s[k][q] for q in ("p50", "p99")}
                run["loadavg_1m_before"] = load1
                # CPU the server (front end + core) spent per output token: unlike wall-clock
                # throughput, hardly moved by other jobs on a shared machine
                run["server_cpu_ms_per_output_token"] = (
                    (tree_cpu_s(procs[name][0].pid) - cpu0) * 1e3 / s["total_output_tokens"])
                result["runs"][name].append(run)
                print(f"round {r} {name}: {run['output_throughput']:.1f} tok/s, "
                      f"{run['server_cpu_ms_per_output_token']:.2f} CPU ms/token, loadavg {load1:.1f}",
                      flush=True)
    finally:
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    med = {n: statistics.median(r["output_throughput"] for r in runs)
           for n, runs in result["runs"].items() if runs}
    result["median_output_throughput"] = med
    result["median_server_cpu_ms_per_output_token"] = {
        n: statistics.median(r["server_cpu_ms_per_output_token"] for r in runs)
        for n, runs in result["runs"].items() if runs}
    first = next(iter(med))
    result["ratio_vs_" + first] = {n: v / med[first] for n, v in med.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("median_output_throughput", "ratio_vs_" + first,
                                             "median_server_cpu_ms_per_output_token")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
