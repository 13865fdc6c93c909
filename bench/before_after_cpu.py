"""No behaviour lost to a restructuring: the same server at two git revisions, served on the CPU
in one command, generation and embeddings throughput side by side.

Both revisions' servers are started (an old revision from a `git worktree` in a temporary
directory, run with PYTHONPATH pointing at it; the current tree as it is), with prefix caching
off and one front end each, and both stay up. `bucketserve bench` (this tree's client, the
same for both) then drives them in A B B A order per round: generation (streaming
completions, closed loop at --concurrency, EOS ignored, a generated log-uniform prompt / uniform
output mix with a fixed seed) and embeddings (single-text requests of 8-128 tokens). Fresh
prompts every run (the seed changes per round), so no run reuses another's KV. Reports the
medians of output tokens/s and embedding inputs/s per revision and their ratios.

    .venv/bin/python bench/before_after_cpu.py --old d005733 --rounds 2 --out FILE
        [--parts embeddings]   # only one of the two workloads (default: both)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, tree: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    buckets = workdir / "buckets.toml"
    buckets.write_text("[kv_cache]\nprefix_caching = false\ncpu_memory_gib = 1.0\n")
    cmd = [sys.executable, "-c", "import sys; from bucketserve.server.cli import main; "
           "sys.exit(main())", "serve", "--port", str(port), "--buckets", str(buckets),
           "--api-workers", "1"]
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    log = open(workdir / f"server_{name}.log", "wb")
    # cwd: the work directory, so that `-c` imports bucketserve from PYTHONPATH
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited; see {workdir}/server_{name}.log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} server did not start")


def bench(url: str, kind: str, seed: int, args: argparse.Namespace, out: Path) -> float:
    common = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url", url, "--seed", str(seed),
              "--warmup", "2", "--out", str(out)]
    if kind == "generation":
        cmd = common + ["--num-requests", str(args.requests), "--concurrency",
                        str(args.concurrency), "--prompt-len", "loguniform:16:1024",
                        "--output-len", "uniform:16:128"]
    else:
        cmd = common + ["--num-requests", str(args.embedding_requests), "--concurrency", "16",
                        "--embedding-fraction", "1.0", "--embedding-len", "uniform:8:128",
                        "--embedding-model", "all-minilm-l6-v2"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    report = json.loads(out.read_text())
    if report["errors"]:
        raise RuntimeError(f"{kind} run against {url} had errors: {report['error_samples']}")
    return (report["output_throughput"] if kind == "generation"
            else report["embedding"]["inputs_per_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="d005733", help="the earlier git revision")
    ap.add_argument("--rounds", type=int, default=2, help="A B B A rounds (runs = 2 x rounds)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--embedding-requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--parts", default="generation,embeddings",
                    help="comma-separated workloads to run: generation, embeddings")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - {"generation", "embeddings"}:
        ap.error(f"--parts {args.parts!r}: name generation and/or embeddings")
    work = Path(tempfile.mkdtemp(prefix="before-after-"))
    old_tree = work / "old"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), args.old],
                   check=True, cwd=ROOT)
    procs = []
    try:
        servers = {}
        for name, tree in (("old", old_tree), ("new", ROOT)):
            proc, url = start(name, tree, work)
            procs.append(proc)
            servers[name] = url
        figures: dict[str, dict[str, list[float]]] = {
            n: {k: [] for k in parts} for n in servers}
        for r in range(args.rounds):
            for name in ("old", "new", "new", "old"):
                seed = 1000 * (r + 1) + len(figures[name][parts[0]])
                for kind in parts:
                    value = bench(servers[name], kind, seed, args, work / f"{name}_{kind}.json")
                    figures[name][kind].append(value)
                    print(f"round {r} {name} {kind}: {value:.1f}", flush=True)
        med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()}
        result = {"old": args.old, "new": subprocess.run(
                      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                      cwd=ROOT).stdout.strip(),
                  "cpu": _cpu(), "load_average": os.getloadavg(), "runs": figures,
                  "medians": med,
                  "ratio_new_over_old": {k: med["new"][k] / med["old"][k] for k in med["new"]},
                  "command": " ".join(["bench/before_after_cpu.py", *(argv or sys.argv[1:])])}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["medians"]), json.dumps(result["ratio_new_over_old"]))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT)
    return 0


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa)}"


if __name__ == "__main__":
    sys.exit(main())
