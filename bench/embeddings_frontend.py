#!/usr/bin/env python3
"""What the /v1/embeddings front end sustains on this CPU, with an encoder that costs nothing.

Each server is the real `bucketserve serve` (HTTP, body decoding, tokenization, the batcher
and its thread, response encoding, /metrics), but the embedding model's forward is a stub
that returns a constant unit vector at once, and the generative engine core is the fake one
(engine/fake_core.py, idle here). The stub is put in by a `sitecustomize` module that this
script writes and puts first on the servers' PYTHONPATH (BENCH_STUB_ENCODER=1), so an older
checkout without any hook is measured the same way. The load is bench/embeddings_gpu.py's
raw-socket client (closed loop, keep-alive, base64): 64 clients x 1 text and 16 clients x
32 texts of the seeded 8..250-word corpus, each shape for --seconds. The key figures are
requests/s and the server's CPU time per request (its processes' CPU seconds over the
timed round, read from /proc), which a loaded, shared machine disturbs less than requests/s.

    PYTHONPATH=. python bench/embeddings_frontend.py --rounds 3 --before-rev main \\
        --server after=$PWD '--server=after_w2=$PWD;--api-workers 2' \\
        --out bench/results/embeddings_frontend_cpu.json

--before-rev REV extracts REV of this repository (git archive) into a temporary directory and
serves it as "before". Servers are started first; then the rounds run every server in turn
(interleaved), and the medians over rounds are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
from embeddings_gpu import corpus, online_round  # noqa: E402
from frontend_capacity import free_port, machine  # noqa: E402

BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.1\n"
SITECUSTOMIZE = '''
import os
if os.environ.get("BENCH_STUB_ENCODER"):
    import torch
    from bucketserve.models import bert_loader

    _load = bert_loader.load_embedding_model

    class _Stub(torch.nn.Module):
        """The encoder's interface, no work: a constant unit vector per row."""

        def __init__(self, dim):
            super().__init__()
            self.embedding_dim = dim
            self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

        def forward(self, input_ids, attention_mask):
            out = torch.zeros(input_ids.shape[0], self.embedding_dim,
                              device=input_ids.device)
            out[:, 0] = 1.0
            return out

    def _load_stub(*args, **kwargs):
        loaded = _load(*args, **kwargs)
        loaded.model = _Stub(loaded.model.embedding_dim).to(next(loaded.model.parameters()).device)
        return loaded

    bert_loader.load_embedding_model = _load_stub
'''
SHAPES = ((64, 1), (16, 32))


class Server:
    def __init__(self, name: str, pythonpath: str, flags: list[str], workdir: Path,
                 stub_dir: Path) -> None:
        self.name, self.port = name, free_port()
        buckets = workdir / "buckets.toml"
        buckets.write_text(BUCKETS)
        env = dict(os.environ, PYTHONPATH=f"{stub_dir}:{pythonpath}", HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1", BUCKETSERVE_FAKE_CORE="0.005", BENCH_STUB_ENCODER="1")
        cmd = [sys.executable, "-c",
               "import sys; from bucketserve.bench.hooks import main; sys.exit(main())",
               "serve", "--port", str(self.port), "--buckets", str(buckets),
               "--log-level", "warning", *flags]
        self.log_path = workdir / f"{name}.log"
        self.proc = subprocess.Popen(cmd, env=env, cwd=pythonpath,
                                     stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, limit_s: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready")

    def cpu_s(self) -> float:
        """CPU seconds of the server's processes (the idle fake core's included)."""
        total = 0.0
        top = psutil.Process(self.proc.pid)
        for p in [top, *top.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def one_round(server: Server, texts: list[str], clients: int, per: int,
              a: argparse.Namespace) -> dict:
    c0 = server.cpu_s()
    r = online_round(server.url, "", texts, clients, per, a.seconds, a.procs, "base64")
    cpu = server.cpu_s() - c0
    r["server_cpu_s"] = cpu
    r["server_cpu_us_per_request"] = 1e6 * cpu / r["requests"]
    r["loadavg"] = os.getloadavg()
    return r


def extract(rev: str, dest: Path) -> Path:
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, text=True,
                          capture_output=True, check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=root, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", default=[],
                    help="NAME=CHECKOUT[;FLAGS] (space-separated flags of `bucketserve serve`)")
    ap.add_argument("--before-rev", default=None,
                    help="also serve this git revision of the repository as 'before'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="per shape and round")
    ap.add_argument("--procs", type=int, default=1, help="client processes")
    ap.add_argument("--n", type=int, default=4000, help="texts in the corpus")
    ap.add_argument("--out", default=str(HERE / "results" / "embeddings_frontend_cpu.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="embfe-") as tmp:
        specs = []
        if a.before_rev:
            specs.append(("before", str(extract(a.before_rev, Path(tmp) / "before")), []))
        for s in a.server:
            name, rest = s.split("=", 1)
            path, _, flags = rest.partition(";")
            specs.append((name, path, flags.split()))
        if not specs:
            ap.error("give --server and/or --before-rev")
        stub_dir = Path(tmp) / "stub"
        stub_dir.mkdir()
        (stub_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        texts = corpus(a.n)
        info = machine()
        runs: dict[str, dict[str, list[dict]]] = {
            name: {f"{c}x{p}": [] for c, p in SHAPES} for name, _, _ in specs}
        servers = []
        try:
            for name, path, flags in specs:
                d = Path(tmp) / f"run_{name}"
                d.mkdir()
                servers.append(Server(name, path, flags, d, stub_dir))
            for s in servers:
                s.wait_ready()
                online_round(s.url, "", texts, 16, 32, 1.0, a.procs, "base64")  # warm-up
            for rnd in range(a.rounds):
                for clients, per in SHAPES:
                    for s in servers:
                        r = one_round(s, texts, clients, per, a)
                        runs[s.name][f"{clients}x{per}"].append(r)
                        print(f"round {rnd} {clients}x{per} {s.name:>10}: "
                              f"{r['requests_per_s']:8,.0f} req/s {r['texts_per_s']:8,.0f} "
                              f"texts/s  p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  "
                              f"server {r['server_cpu_us_per_request']:7.0f} CPU us/request  "
                              f"load {r['loadavg'][0]:.1f}", flush=True)
        finally:
            for s in servers:
                s.stop()
    keys = ("requests_per_s", "texts_per_s", "p50_ms", "p99_ms", "server_cpu_us_per_request")
    summary = {name: {shape: {k: statistics.median(r[k] for r in rs) for k in keys}
                      for shape, rs in shapes.items() if rs}
               for name, shapes in runs.items()}
    for name, shapes in summary.items():
        for shape, m in shapes.items():
            print(f"median {shape} {name:>10}: {m['requests_per_s']:8,.0f} req/s, "
                  f"{m['texts_per_s']:8,.0f} texts/s, p50 {m['p50_ms']:.1f} ms, p99 "
                  f"{m['p99_ms']:.1f} ms, {m['server_cpu_us_per_request']:.0f} server CPU "
                  "us/request")
    with open(a.out, "w") as f:
        json.dump({"machine": info, "config": vars(a), "runs": runs, "median": summary,
                   "measured_unix": time.time()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
