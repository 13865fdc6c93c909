"""Faults on the Ray Serve endpoint (`bucketserve serve --replicas 2`, tests/conftest.py
ray_server and ray_haproxy_server): a replica's actor process killed during 32 streaming
requests, and a replica's engine-core child process killed. Every request ends (complete, an
SSE error event, or a 5xx error body; behind HAProxy, a stream whose replica process died is
cut, as docs/ray.md says), no engine-core process is left behind, Ray brings a new replica
up, and the next 32 requests all succeed. Skipped without ray.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bucketserve.bench.launch import RAY_API_KEY, LiveServer, alive, children, cmdline, descendants

AUTH = {"Authorization": f"Bearer {RAY_API_KEY}"}
STREAMS = 32
REPLICA_TITLES = ("ray::ServeReplica:bucketserve:EngineReplica",
                  "ray::ServeReplica:bucketserve:DirectReplica")
RECOVERY_LIMIT_S = 300.0  # a replica's restart on a busy 2-core machine; a bound


def engine_replicas(server: LiveServer) -> dict[int, int | None]:
    """Replica actor pid -> its engine-core child's pid (None while it has none), for the
    replicas of this server's own Ray instance (its process tree)."""
    return replicas_under(server.proc.pid)


def replicas_under(root: int) -> dict[int, int | None]:
    """Engine replica actor pid -> engine-core child pid, among `root`'s descendants."""
    out = {}
    for pid in descendants(root):
        if cmdline(pid).startswith(REPLICA_TITLES):
            cores = [c for c in children(pid) if "multiprocessing.spawn" in cmdline(c)]
            out[pid] = cores[0] if cores else None
    return out


def replica_labels(server: LiveServer) -> set[str]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return set(re.findall(r'bucketserve_kv_blocks_total\{replica="([^"]+)"\}', text))


def running_per_replica(server: LiveServer) -> dict[str, float]:
    time.sleep(server.metrics_lag_s)
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {r: float(v) for r, v in
            re.findall(r'bucketserve_requests_running\{replica="([^"]+)"\} (\S+)', text)}


def wait_for_new_replica(server: LiveServer, before: set[str]) -> set[str]:
    """Waits until /metrics shows two replicas, one of them not in `before`: Ray replaced
    the lost one and the new one has loaded its engine."""
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    while True:
        labels = replica_labels(server)
        if len(labels) == 2 and labels - before:
            return labels
        assert time.monotonic() < deadline, f"no new replica: {labels} (before {before})"
        time.sleep(1.0)


def stream_one(i: int, base_url: str, max_tokens: int, flowing: threading.Event,
               cut_ok: bool = False) -> tuple[str, str]:
    """One streaming completion -> (outcome, detail): "done" (the whole stream, [DONE]),
    "error_event" (an SSE error event, then [DONE]) or "error_body" (a 5xx OpenAI error body);
    with `cut_ok`, "cut" (the connection closed mid-stream: HAProxy's answer to a replica
    process that died). Anything else (a hang, a cut stream without `cut_ok`, a bad body)
    raises."""
    body = {"prompt": f"Request {i}: tell a story.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=AUTH,
                      timeout=httpx.Timeout(120.0)) as resp:
        if resp.status_code != 200:
            resp.read()
            assert resp.status_code >= 500, resp.text
            assert resp.json()["error"]["message"]
            return "error_body", resp.text
        events = []
        try:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    flowing.set()
        except httpx.RemoteProtocolError as exc:
            if not cut_ok:
                raise
            assert events, f"stream {i} was cut before its first event"
            return "cut", str(exc)
    assert events and events[-1] == "[DONE]", f"stream {i} did not end with [DONE]: {events[-3:]}"
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e[:12]]
    if errors:
        assert errors[0]["message"]
        return "error_event", errors[0]["message"]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text, f"stream {i} finished without text"
    return "done", ""


def run_streams(server: LiveServer, max_tokens: int = 24, during=None,
                cut_ok: bool = False) -> list[tuple[str, str]]:
    """STREAMS concurrent streaming requests; `during()` runs once tokens flow."""
    flowing = threading.Event()
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream_one, i, server.base_url, max_tokens, flowing, cut_ok)
                   for i in range(STREAMS)]
        if during is not None:
            assert flowing.wait(120.0), "no stream started"
            during()
        return [f.result() for f in futures]


def wait_gone(pids: list[int], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.2)


# behind HAProxy only the replica process's death differs (an engine core's death inside a
# live replica is the same app's error event on both ingresses): one case, for suite time
@pytest.mark.parametrize(("ingress", "victim"), [
    ("proxy", "replica_actor"), ("proxy", "engine_core"), ("haproxy", "replica_actor")])
def test_a_killed_replica_is_replaced_and_no_request_hangs(request, ingress, victim) -> None:
    ray_server = request.getfixturevalue("ray_server" if ingress == "proxy"
                                         else "ray_haproxy_server")
    # behind HAProxy nothing outlives a dead replica process to send an error event: its
    # streams are cut (an engine core's death is still an error event from the replica's app)
    cut = ingress == "haproxy" and victim == "replica_actor"
    replicas = engine_replicas(ray_server)
    assert len(replicas) == 2 and all(replicas.values()), replicas
    labels_before = replica_labels(ray_server)
    actor, core = next(iter(replicas.items()))
    # a first burst, so that Ray's router has seen both replicas' queue lengths
    assert [kind for kind, _ in run_streams(ray_server)] == ["done"] * STREAMS

    def kill() -> None:
        deadline = time.monotonic() + 60.0
        while min(running_per_replica(ray_server).values(), default=0) < 1:
            assert time.monotonic() < deadline, "the streams did not reach both replicas"
        os.kill(actor if victim == "replica_actor" else core, signal.SIGKILL)

    # long enough that every replica is mid-generation at the kill
    outcomes = run_streams(ray_server, max_tokens=200, during=kill, cut_ok=cut)
    kinds = [kind for kind, _ in outcomes]
    # every request ended (stream_one checks how); the streams running on the killed
    # replica ended with an error event (or were cut), those it had not started went to the
    # other one
    assert kinds.count("cut" if cut else "error_event") >= 1, kinds
    assert kinds.count("done") >= 1, kinds
    # no orphaned engine core: the killed replica's core is gone with it (or was the victim)
    wait_gone([core])
    labels_after = wait_for_new_replica(ray_server, labels_before)
    assert len(labels_before & labels_after) == 1  # the untouched replica still serves
    wait_gone([actor])  # the replaced replica's actor process has ended too
    # the next 32 all succeed
    assert [kind for kind, _ in run_streams(ray_server)] == ["done"] * STREAMS
    assert all(c and alive(c) for c in engine_replicas(ray_server).values())
