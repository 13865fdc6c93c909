"""CPU layout of the split server (kernels/cpu_threads.py) and the packed GEMM backends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bucketserve.kernels import cpu_threads
from bucketserve.models import llama

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_engine_and_front_end_layouts_pin_every_thread():
    cores = sorted(os.sched_getaffinity(0))
    script = (
        "import os, sys, threading\n"
        "from bucketserve.kernels import cpu_threads\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait); t.start()\n"  # a thread that exists already
        "getattr(cpu_threads, sys.argv[1])()\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)),\n"
        "      os.environ.get('BUCKETSERVE_CPU_THREADS'))\n"
        "ev.set()\n")
    env = {**os.environ, "BUCKETSERVE_CPU_AFFINITY": "auto", "PYTHONPATH": str(ROOT)}
    env.pop("BUCKETSERVE_CPU_THREADS", None)

    def run(fn: str) -> str:
        return subprocess.run([sys.executable, "-c", script, fn], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    engine = cores[:-1]
    assert run("apply_engine_layout") == f"{engine} {engine} {len(engine)}"
    assert run("apply_frontend_layout") == f"{cores[-1:]} {cores[-1:]} None"


def test_gemm_backend_choice(monkeypatch):
    both = llama.onednn_packing_available() and llama.mkl_packing_available()
    monkeypatch.setenv("BUCKETSERVE_CPU_GEMM", "auto")
    assert llama.cpu_gemm_backend() == ("auto" if both else
                                        "onednn" if llama.onednn_packing_available() else
                                        "mkl" if llama.mkl_packing_available() else None)
    monkeypatch.setenv("BUCKETSERVE_CPU_GEMM", "mkl")
    assert llama.cpu_gemm_backend() == ("mkl" if llama.mkl_packing_available() else None)
    monkeypatch.setenv("BUCKETSERVE_CPU_GEMM", "onednn")
    assert llama.cpu_gemm_backend() == ("onednn" if llama.onednn_packing_available() else None)
    monkeypatch.setenv("BUCKETSERVE_CPU_GEMM", "blas")
    with pytest.raises(ValueError):
        llama.cpu_gemm_backend()


@pytest.mark.parametrize("backend", ["onednn", "mkl"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_gemm_backends_match_f_linear(monkeypatch, backend, rows):
    if not {"onednn": llama.onednn_packing_available,
            "mkl": llama.mkl_packing_available}[backend]():
        pytest.skip(f"this torch build has no {backend} packed sgemm")
    monkeypatch.setattr(llama, "_GEMM", backend)
    torch.manual_seed(rows)
    w, b = torch.randn(200, 96), torch.randn(200)
    x = torch.randn(rows, 96)
    p = llama.pack_weight(w)
    with torch.inference_mode():
        for bias in (None, b):
            got = llama.packed_linear(x, p, w, bias)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias),
                                       rtol=1e-5, atol=1e-4)
            assert llama._linear(x, (p, w, bias)).equal(got)


def test_auto_gemm_is_measured_once_on_the_first_model_packed(monkeypatch):
    """BUCKETSERVE_CPU_GEMM=auto: packing a model times both backends on its largest
    projection and keeps the faster for the process; a packed model then matches F.linear."""
    if not (llama.onednn_packing_available() and llama.mkl_packing_available()):
        pytest.skip("this torch build lacks one of the packed sgemms")
    best, times = llama.measure_cpu_gemm(torch.randn(256, 64), rounds=1)
    assert best in ("onednn", "mkl") and set(times) == {"onednn", "mkl"}
    assert times[best] == min(times.values()) > 0
    monkeypatch.setattr(llama, "_GEMM", "auto")
    lin = llama.Linear(64, 256, bias=True)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    mod = torch.nn.Sequential(lin)
    assert llama.pack_linear_weights(mod, lin.weight)
    assert llama._GEMM in ("onednn", "mkl") and lin.packed is not None
    x = torch.randn(9, 64)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias),
                                   rtol=1e-4, atol=1e-4)
