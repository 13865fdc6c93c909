"""The CPU execution plan (kernels/cpu_plan.py): its resolution from the [cpu] keys and the
host, the refusals, the environment a forced ISA needs, the TOML keys and CLI flags that feed
it, and the packed GEMMs it chooses between."""

from __future__ import annotations

import argparse
import platform

import pytest
import torch

from bucketserve.buckets import ConfigError, load_buckets
from bucketserve.kernels import cpu_plan
from bucketserve.kernels.cpu_plan import CpuPlanError, isa_environment, resolve_cpu_plan
from bucketserve.models import llama

AVX512 = {"avx2", "fma", "avx512f"}
AVX2 = {"avx2", "fma"}
x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISAs")


def test_host_isa_from_flags():
    assert cpu_plan.host_isa(AVX512) == "avx512"
    assert cpu_plan.host_isa(AVX2) == "avx2"
    assert cpu_plan.host_isa({"avx2"}) == "baseline"  # AVX2 without FMA
    assert cpu_plan.host_isa({"sse2"}) == "baseline"


@x86_only
def test_auto_is_the_hosts_level():
    plan = resolve_cpu_plan(flags=AVX512, torch_isa="AVX512")
    assert (plan.isa, plan.host_isa, plan.forced, plan.march) == ("avx512", "avx512", False,
                                                                  "native")
    assert plan.prefill_attention == "c"  # the C prompt kernel at AVX-512
    plan = resolve_cpu_plan(flags=AVX2, torch_isa="AVX2")
    assert (plan.isa, plan.forced, plan.march, plan.prefill_attention) == (
        "avx2", False, "native", "sdpa")
    # "auto" where torch was held lower by hand: the plan follows torch
    assert resolve_cpu_plan(flags=AVX512, torch_isa="AVX2").isa == "avx2"


@x86_only
def test_forced_avx2_on_an_avx512_host():
    plan = resolve_cpu_plan("avx2", flags=AVX512, torch_isa="AVX2")
    assert (plan.isa, plan.host_isa, plan.forced) == ("avx2", "avx512", True)
    assert plan.march == "x86-64-v3"  # the C kernels really are the AVX2 build
    assert plan.prefill_attention == "sdpa"
    text = plan.describe()
    assert "isa avx2 (forced; host has avx512)" in text and "-march=x86-64-v3" in text
    assert isa_environment("avx2", AVX512) == {"ATEN_CPU_CAPABILITY": "avx2",
                                               "ONEDNN_MAX_CPU_ISA": "AVX2",
                                               "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    # the host's own level and "auto" need nothing
    assert isa_environment("avx512", AVX512) == isa_environment("auto", AVX512) == {}
    assert isa_environment("avx2", AVX2) == {}


@x86_only
def test_forced_isa_that_torch_does_not_follow_is_refused():
    with pytest.raises(CpuPlanError, match="torch dispatches AVX512.*--cpu-isa avx2"):
        resolve_cpu_plan("avx2", flags=AVX512, torch_isa="AVX512")


@pytest.mark.parametrize("kwargs,match", [
    ({"isa": "avx1024"}, "cpu isa 'avx1024'; expected one of auto, avx512, avx2, baseline"),
    ({"gemm": "blas"}, "cpu gemm 'blas'; expected one of auto, onednn, mkl"),
    ({"prefill_attention": "flash"}, "cpu prefill_attention 'flash'"),
    ({"threads": 0}, "cpu threads 0; expected a positive integer"),
    ({"threads": "many"}, "cpu threads 'many'"),
])
def test_unknown_values_are_refused(kwargs, match):
    with pytest.raises(CpuPlanError, match=match):
        resolve_cpu_plan(flags=AVX2, torch_isa="AVX2", **kwargs)


def test_isa_above_the_host_is_refused():
    with pytest.raises(CpuPlanError, match=r"cpu isa 'avx512' refused: this CPU has avx2 at most"):
        resolve_cpu_plan("avx512", flags=AVX2, torch_isa="AVX2")
    with pytest.raises(CpuPlanError, match="this CPU has baseline at most"):
        isa_environment("avx2", {"sse2"})


def test_config_keys_and_cli_flags_feed_the_plan(tmp_path):
    from bucketserve.engine.options import EngineOptions
    from bucketserve.server.options import build_parser

    b = load_buckets()
    assert (b.cpu_isa, b.cpu_gemm, b.cpu_threads, b.cpu_c_kernels, b.cpu_prefill_attention) == (
        "auto", "auto", "auto", True, "auto")
    path = tmp_path / "b.toml"
    path.write_text('[cpu]\nisa = "avx2"\ngemm = "mkl"\nthreads = 1\nc_kernels = false\n')
    b = load_buckets(path)
    assert (b.cpu_isa, b.cpu_gemm, b.cpu_threads, b.cpu_c_kernels) == ("avx2", "mkl", 1, False)
    path.write_text('[cpu]\nisa = "sse9"\n')
    with pytest.raises(ConfigError, match="cpu.isa"):
        load_buckets(path)
    args = build_parser().parse_args(["serve", "--cpu-isa", "avx2", "--cpu-gemm", "onednn",
                                      "--cpu-threads", "3"])
    opts = EngineOptions.from_args(args)
    assert (opts.cpu_isa, opts.cpu_gemm, opts.cpu_threads) == ("avx2", "onednn", 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpu-isa", "avx1024"])


def test_prepare_cpu_sets_the_environment_of_a_forced_isa(monkeypatch):
    from bucketserve.server.startup import prepare_cpu

    host = cpu_plan.host_isa()
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(var, raising=False)
    args = argparse.Namespace(device="cpu", cpu_isa="avx2", buckets=None)
    if host == "baseline":
        with pytest.raises(CpuPlanError):
            prepare_cpu(args)
        return
    prepare_cpu(args)
    import os

    assert {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                           "MKL_ENABLE_INSTRUCTIONS")} == (
        isa_environment("avx2") or dict.fromkeys(("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                  "MKL_ENABLE_INSTRUCTIONS")))


def test_gemm_choice():
    dnn, mkl = cpu_plan.onednn_packing_available(), cpu_plan.mkl_packing_available()
    plan = resolve_cpu_plan()
    assert plan.gemm == ("auto" if dnn and mkl else "onednn" if dnn else "mkl" if mkl else None)
    for gemm, ok in (("onednn", dnn), ("mkl", mkl)):
        if ok:
            assert resolve_cpu_plan(gemm=gemm).gemm == gemm
        else:
            with pytest.raises(CpuPlanError, match="no packed"):
                resolve_cpu_plan(gemm=gemm)


def test_encoders_take_onednn_without_measuring(monkeypatch):
    """default_cpu_plan (the BERT encoders'): oneDNN's packed GEMM wherever torch has it,
    never a start-up timing (a near tie on MiniLM's weight, which picked MKL in one process
    out of three, natively and with AVX2 forced); MKL's only without oneDNN's."""
    dnn, mkl = cpu_plan.onednn_packing_available(), cpu_plan.mkl_packing_available()
    monkeypatch.setattr(cpu_plan, "measure_gemm", lambda *a, **k: pytest.fail("measured"))
    plan = cpu_plan.default_cpu_plan.__wrapped__()
    assert plan.gemm == ("onednn" if dnn else "mkl" if mkl else None)
    assert llama.packed_gemm_backend() == plan.gemm  # the process's plan (cached)
    monkeypatch.setattr(cpu_plan, "onednn_packing_available", lambda: False)
    assert cpu_plan.default_cpu_plan.__wrapped__().gemm == ("mkl" if mkl else None)


@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_gemms_match_f_linear(gemm, rows):
    if not {"onednn": cpu_plan.onednn_packing_available,
            "mkl": cpu_plan.mkl_packing_available}[gemm]():
        pytest.skip(f"this torch build has no {gemm} packed sgemm")
    torch.manual_seed(rows)
    w, b = torch.randn(200, 96), torch.randn(200)
    x = torch.randn(rows, 96)
    p = cpu_plan.pack_weight(gemm, w)
    with torch.inference_mode():
        for bias in (None, b):
            got = cpu_plan.packed_linear(gemm, x, p, w, bias)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias),
                                       rtol=1e-5, atol=1e-4)
            assert llama._linear(x, (gemm, p, w, bias)).equal(got)


def test_auto_gemm_is_measured_on_the_modules_largest_projection():
    """gemm "auto": packing times both backends on the module's largest projection, at
    decode and at prefill row counts, and keeps the one with the smaller total for every
    forward; the packed module then matches F.linear."""
    if not (cpu_plan.onednn_packing_available() and cpu_plan.mkl_packing_available()):
        pytest.skip("this torch build lacks one of the packed sgemms")
    times = cpu_plan.measure_gemm(torch.randn(256, 64), rounds=1)
    assert set(times) == {"onednn", "mkl"}
    assert all(set(t) == {16, 512} and min(t.values()) > 0 for t in times.values())
    small, big = llama.Linear(64, 16, bias=False), llama.Linear(64, 256, bias=True)
    with torch.no_grad():
        for p in (small.weight, big.weight, big.bias):
            p.normal_()
    plan = llama.pack_linear_weights(torch.nn.Sequential(small, big), big.weight,
                                     resolve_cpu_plan())
    assert plan.gemm in ("onednn", "mkl") and "measured on a 256x64 weight" in plan.gemm_how
    assert small.gemm == big.gemm == plan.gemm and big.packed is not None
    for rows in (9, 300):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            torch.testing.assert_close(big(x), torch.nn.functional.linear(x, big.weight, big.bias),
                                       rtol=1e-4, atol=1e-4)
