"""Starts a real `bucketserve serve` subprocess on a free localhost port (test helper).

The server is the installed console script with the real default model (SmolLM2-135M-
Instruct from its GGUF). Each launch takes the model load time, so test modules start one
per configuration and share it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_LIMIT_S = 600.0  # model load on a busy 2-core machine; a bound, not a measurement


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(env: dict[str, str] | None = None) -> list[str]:
    """The server's command line: the installed console script, or, when `env` sets a test
    switch (`hooks.SWITCHES`), the launcher that passes its stand-ins in
    (bucketserve/bench/hooks.py; the production server reads no test switch)."""
    from bucketserve.bench.hooks import SWITCHES

    if env and any(env.get(name) for name in SWITCHES):
        return [sys.executable, "-m", "bucketserve.bench.hooks"]
    script = Path(sys.executable).with_name("bucketserve")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from bucketserve.server.cli import main; sys.exit(main())"]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    # Ray endpoint (--replicas): its /metrics merges the replicas' pushes, each up to
    # ray_deploy.PUSH_S old; metrics() waits this long first so that it sees the present.
    metrics_lag_s: float = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, from GET /metrics; the samples of a Ray
        endpoint's replicas (label `replica`) are summed."""
        time.sleep(self.metrics_lag_s)
        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][^ ]*) ([^ ]+)$", line)
            if m:
                name = re.sub(r'\{\}$', "", re.sub(r',?replica="[^"]*"', "", m.group(1)))
                name = name.replace("{,", "{")
                values[name] = values.get(name, 0.0) + float(m.group(2))
        return values

    def openai_client(self, api_key: str, timeout: float = 300):
        """The official openai client for this server (no retries: tests see every error)."""
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             timeout=timeout)

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def wait_for_metric(self, name: str, predicate, limit_s: float = 120.0) -> float:
        """Polls /metrics until predicate(value) holds; fails with the last value after limit_s."""
        deadline = time.monotonic() + limit_s
        while True:
            value = self.metric(name)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value}")
            time.sleep(0.05)

    def stop(self, limit_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(limit_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_replicas(srv: LiveServer, n: int) -> None:
    """/health answers once one Ray replica is up; waits until n replicas push /metrics."""
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while len(set(re.findall(r'replica="([^"]+)"', httpx.get(srv.base_url + "/metrics").text))) < n:
        if time.monotonic() > deadline:
            srv.stop()
            raise RuntimeError(f"{n} replicas did not start:\n{srv.log()}")
        time.sleep(0.5)


RAY_API_KEY = "test-key"
# One Ray endpoint for every Ray test (tests/conftest.py: ray_server): small KV pools, and
# embedding batches of 4 that wait up to 1 s for more inputs (test_embeddings_server.py).
RAY_BUCKETS = ("[kv_cache]\ncpu_memory_gib = 0.1\n"
               "[embedding]\npreferred_batch_size = 4\nmax_queue_delay_ms = 1000.0\n")
RAY_MAX_BODY = 100_000
RAY_METRICS_LAG_S = 1.2  # twice ray_deploy.PUSH_S, and some


def start_ray_server(workdir: Path, ingress: str = "proxy") -> LiveServer:
    """`bucketserve serve --replicas 2 --ray-ingress INGRESS` on a local Ray instance, one CPU
    core per replica."""
    srv = start_server(workdir, "ray", RAY_BUCKETS, "--replicas", "2", "--cpus-per-replica",
                       "1", "--ray-ingress", ingress,
                       "--api-key", RAY_API_KEY, "--max-body-bytes", str(RAY_MAX_BODY),
                       "--embedding-model", "all-minilm-l6-v2",
                       env={"RAY_USAGE_STATS_ENABLED": "0"})
    srv.metrics_lag_s = RAY_METRICS_LAG_S
    wait_for_replicas(srv, 2)
    return srv


def start_server(workdir: Path, name: str, buckets_toml: str, *extra_args: str,
                 env: dict[str, str] | None = None) -> LiveServer:
    """`env`: extra environment variables for the server process (test switches included:
    see `command`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    buckets = workdir / f"{name}.toml"
    buckets.write_text(buckets_toml)
    log_path = workdir / f"{name}.log"
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
    args = [*command(env), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--buckets", str(buckets), "--embedding-model", "none", *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server not healthy after {STARTUP_LIMIT_S} s:\n{server.log()}")
        time.sleep(0.25)
