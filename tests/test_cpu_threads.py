"""CPU layout of the split server (kernels/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bucketserve.kernels import cpu_threads

ROOT = Path(__file__).resolve().parent.parent


def test_layout_plans():
    assert cpu_threads.plan("off", {0, 1}) is None
    assert cpu_threads.plan("", {0, 1}) is None
    assert cpu_threads.plan("auto", {0, 1}) == ({0}, {1})
    assert cpu_threads.plan("auto", {0, 1, 2, 3}) == ({0, 1, 2}, {3})
    assert cpu_threads.plan("auto", {5}) is None  # one core: nothing to split
    assert cpu_threads.plan("0-2/3", {0}) == ({0, 1, 2}, {3})
    assert cpu_threads.plan("0,2/1,3", {0}) == ({0, 2}, {1, 3})
    for bad in ("1", "0/", "/1", "a/b", "0-/1", "3-1/0"):
        with pytest.raises(ValueError):
            cpu_threads.plan(bad, {0, 1})
        with pytest.raises(ValueError):
            cpu_threads.plan(bad, {0, 1}, device="cuda")


def test_a_gpu_engine_takes_explicit_layouts_only():
    # "auto" is the CPU engine's layout (the front end on one core): a GPU server runs
    # several API workers, and pins only where the user names both core lists
    assert cpu_threads.plan("auto", {0, 1, 2, 3}, device="cuda") is None
    assert cpu_threads.plan("auto", {0, 1, 2, 3}, device="cuda:1") is None
    assert cpu_threads.plan("off", {0, 1}, device="cuda") is None
    assert cpu_threads.plan("0-5/6-15", {0}, device="cuda") == (set(range(6)), set(range(6, 16)))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_engine_and_front_end_layouts_pin_every_thread():
    cores = sorted(os.sched_getaffinity(0))
    script = (
        "import os, sys, threading\n"
        "from bucketserve.kernels import cpu_threads\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait); t.start()\n"  # a thread that exists already
        "n = getattr(cpu_threads, sys.argv[1])()\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)), n)\n"
        "ev.set()\n")
    env = {**os.environ, "BUCKETSERVE_CPU_AFFINITY": "auto", "PYTHONPATH": str(ROOT)}

    def run(fn: str) -> str:
        return subprocess.run([sys.executable, "-c", script, fn], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    engine = cores[:-1]
    assert run("apply_engine_layout") == f"{engine} {engine} {len(engine)}"
    assert run("apply_frontend_layout") == f"{cores[-1:]} {cores[-1:]} None"
