"""Two Ray nodes on this machine: `ray start --head` and a second `ray start --address
127.0.0.1:PORT`, each with one CPU and its own custom resource; `bucketserve serve --replicas
2 --ray-address` puts one engine replica on each node, and both serve requests. Loopback
only; every process is stopped by its pid (never `ray stop`, which would stop every Ray on
the machine). Skipped without ray.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bucketserve.bench.launch import (
    cmdline,
    descendants,
    free_port,
    start_server,
    wait_for_replicas,
)

pytest.importorskip("ray.serve")

BUCKETS = "[kv_cache]\ncpu_memory_gib = 0.1\n"
# token auth, the one mode that head, worker and driver all agree on without a flag each
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
REPLICA_TITLE = "ray::ServeReplica:bucketserve:EngineReplica"


def ray_start(log: Path, *args: str) -> subprocess.Popen:
    """`ray start ... --block`: the node's processes live (and stop) with this one."""
    ray = Path(sys.executable).with_name("ray")
    with open(log, "wb") as out:
        return subprocess.Popen([str(ray), "start", "--block", "--num-cpus", "1",
                                 "--object-store-memory", str(100 * 2**20), *args],
                                stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **ENV))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_nodes(address: str, n: int, limit_s: float = 180.0) -> None:
    """`ray status` lists n nodes."""
    ray = Path(sys.executable).with_name("ray")
    deadline = time.monotonic() + limit_s
    while True:
        out = subprocess.run([str(ray), "status", "--address", address], capture_output=True,
                             text=True, env=dict(os.environ, **ENV)).stdout
        if len(re.findall(r"^ 1 node_", out, re.M)) >= n:
            return
        assert time.monotonic() < deadline, f"the cluster did not reach {n} nodes:\n{out}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("ray-cluster")
    # Ray's socket paths must stay short: its own temp dir under /tmp
    temp_dir = tempfile.mkdtemp(prefix="bs-ray-")
    address = f"127.0.0.1:{free_port()}"
    head = ray_start(work / "head.log", "--head", "--port", address.split(":")[1],
                     "--node-ip-address", "127.0.0.1", "--include-dashboard=false",
                     "--temp-dir", temp_dir, "--resources", '{"bucketserve_head": 1}')
    worker = None
    try:
        wait_for_nodes(address, 1)
        worker = ray_start(work / "worker.log", "--address", address, "--node-ip-address",
                           "127.0.0.1", "--resources", '{"bucketserve_worker": 1}')
        wait_for_nodes(address, 2)
        yield address, head, worker
    finally:
        for proc in (worker, head):
            if proc is not None:
                stop(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_one_replica_on_each_node_and_both_serve(cluster, tmp_path) -> None:
    address, head, worker = cluster
    srv = start_server(tmp_path, "cluster", BUCKETS, "--replicas", "2", "--ray-address",
                       address, "--proxy-location", "HeadOnly", "--cpus-per-replica", "1",
                       env=ENV)
    try:
        wait_for_replicas(srv, 2)
        # each node's raylet (under its `ray start`) runs one engine replica
        per_node = [[p for p in descendants(node.pid) if cmdline(p).startswith(REPLICA_TITLE)]
                    for node in (head, worker)]
        assert [len(p) for p in per_node] == [1, 1], per_node

        def one(i: int) -> int:
            return httpx.post(srv.base_url + "/v1/completions", timeout=300, json={
                "prompt": f"Request {i}:", "max_tokens": 4, "ignore_eos": True}).status_code

        served: dict[str, float] = {}
        for _ in range(5):  # Ray's router spreads a burst once it knows both queue lengths
            with ThreadPoolExecutor(16) as pool:
                assert list(pool.map(one, range(16))) == [200] * 16
            time.sleep(srv.metrics_lag_s + 1.0)
            text = httpx.get(srv.base_url + "/metrics").text
            served = {r: float(v) for r, v in re.findall(
                r'bucketserve_request_success_total\{finish_reason="length",replica="([^"]+)"\} (\S+)',
                text)}
            if len(served) == 2:
                break
        assert len(served) == 2 and min(served.values()) > 0, served
    finally:
        assert srv.stop(120) == 0
