"""The CPU execution plan: which instruction set, GEMM, C kernel build, prompt-attention path
and thread count a float32 CPU model runs with, resolved once at start-up.

`resolve_cpu_plan` decides from the config ([cpu] keys, --cpu-* flags) and the host (its
/proc/cpuinfo flags and what torch dispatches to); the result is a frozen, printable
`CpuPlan` that the engine hands to the model (LlamaForCausalLM.use_cpu_plan, which measures
the GEMM backends on the model's own weights where gemm is "auto" and returns the final plan)
and logs. Nothing here reads the environment or keeps module state.

ISA. "auto" is the host's best of avx512 > avx2 > baseline (or the lower level torch is held
to, when the variables below were set by hand). A lower one can be forced
([cpu] isa = "avx2"): the C kernels are then built for that level (-march=x86-64-v3 for
avx2: Haswell's AVX2 + FMA + BMI2 + F16C), and torch's own kernels, oneDNN and MKL must be
held to it too. Those three libraries read their limits from the environment when they
first dispatch (isa_environment), so the server sets them in its own environment before the
engine starts (the engine core process inherits them), and the plan checks what torch
reports (torch.backends.cpu.get_cpu_capability()).

GEMM. The projections multiply through a packed float32 sgemm, oneDNN's or MKL's. Neither
wins everywhere: oneDNN picks its kernels by the CPU's instruction set, MKL also by its vendor.
On the AMD EPYC (Zen 5, AVX-512) of this project's 2-core machine MKL's packed sgemm ran its
AVX2 kernels at ~110 GFLOP/s per core and oneDNN's AVX-512 ones at ~250; on an Intel Xeon
(AVX-512, AMX) MKL's ran at 153 GFLOP/s at 16 rows against oneDNN's 81 (bench/cpu_profile.py
measures both at the model's shapes). "auto" measures both on the model's largest projection
(measure_gemm) and keeps the faster. The BERT encoders (default_cpu_plan) take oneDNN's
without measuring.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import platform
import time
from dataclasses import dataclass

import torch

from bucketserve.buckets.config import CPU_GEMMS, CPU_ISAS, CPU_PREFILL_ATTENTION

log = logging.getLogger(__name__)

ISAS = ("avx512", "avx2", "baseline")  # best first
ISA_CHOICES = CPU_ISAS
GEMM_CHOICES = CPU_GEMMS
PREFILL_ATTENTION_CHOICES = CPU_PREFILL_ATTENTION

# What torch.backends.cpu.get_cpu_capability() reports at each level (x86)
_TORCH_CAPABILITY = {"avx512": "AVX512", "avx2": "AVX2", "baseline": "DEFAULT"}
# The environment that holds ATen, oneDNN and MKL to a level below the host's
_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
# The C kernels' -march for a forced level (the host's own level builds for -march=native)
_MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": "x86-64-v2"}


class CpuPlanError(ValueError):
    """A CPU plan that cannot run here (an unknown value, an ISA the host lacks); str() is
    one line saying why."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_isa(flags: set[str] | None = None) -> str:
    """"avx512" (AVX-512F), "avx2" (AVX2 + FMA) or "baseline" (anything else)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "baseline"


def _check(what: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise CpuPlanError(f"cpu {what} {value!r}; expected one of {', '.join(choices)}")
    return str(value)


def effective_isa(isa: str = "auto", flags: set[str] | None = None) -> tuple[str, str]:
    """(the level to run at, the host's level) for a configured `isa`. Raises CpuPlanError
    for an unknown value or a level above the host's."""
    _check("isa", isa, ISA_CHOICES)
    host = host_isa(flags)
    if isa == "auto":
        return host, host
    if ISAS.index(isa) < ISAS.index(host):
        raise CpuPlanError(f"cpu isa {isa!r} refused: this CPU has {host} at most "
                           f"({', '.join(ISAS[ISAS.index(host):])} can be forced)")
    return isa, host


def isa_environment(isa: str = "auto", flags: set[str] | None = None) -> dict[str, str]:
    """The environment variables that hold torch (ATEN_CPU_CAPABILITY), oneDNN
    (ONEDNN_MAX_CPU_ISA) and MKL (MKL_ENABLE_INSTRUCTIONS) to a forced `isa`; empty where
    `isa` is the host's own (or "auto", or not an x86 host). They only act when set before
    those libraries first dispatch: in the server's environment before the engine starts."""
    level, host = effective_isa(isa, flags)
    if level == host or platform.machine() not in ("x86_64", "AMD64"):
        return {}
    return dict(_ISA_ENV[level])


# ---- the packed GEMMs ------------------------------------------------------------------------

def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def onednn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(gemm: str, weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    """The packed layout of a float32 [out, in] weight for `gemm` ("onednn" | "mkl"). Packed
    sgemm is 2-4x faster than F.linear at the small row counts of CPU decode steps and no
    slower at prefill sizes; oneDNN's layout chosen for 64 rows serves 8..2048 rows at the
    same rate."""
    if gemm == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(gemm: str, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] times a weight packed by pack_weight(gemm, weight), plus bias."""
    if gemm == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


# What "auto" times on a model's largest projection, per backend: 32 GEMMs of 16 rows
# (decode-sized) and, apart, one of 512 (prefill-sized), the same rows in both, twice,
# alternating; the backend with the smaller sum is kept for every forward.
_GEMM_PROBE = ((16, 32), (512, 1))


@torch.inference_mode()
def measure_gemm(weight: torch.Tensor, rounds: int = 2) -> dict[str, dict[int, float]]:
    """Each packed backend's ("onednn", "mkl") best time (ms) for a float32 [out, in] weight
    at each row count of _GEMM_PROBE: {backend: {16: ms for 32 GEMMs, 512: ms for one}}.
    Both give the same results to rounding (tests/test_cpu_plan.py), so the choice only
    moves speed."""
    xs = {rows: torch.randn(rows, weight.shape[1]) for rows, _ in _GEMM_PROBE}
    packed = {b: pack_weight(b, weight) for b in ("onednn", "mkl")}
    best = {b: dict.fromkeys(xs, float("inf")) for b in packed}
    for _ in range(rounds):
        for b, p in packed.items():
            packed_linear(b, xs[16], p, weight, None)  # warm-up
            for rows, reps in _GEMM_PROBE:
                t0 = time.perf_counter()
                for _ in range(reps):
                    packed_linear(b, xs[rows], p, weight, None)
                best[b][rows] = min(best[b][rows], (time.perf_counter() - t0) * 1e3)
    return best


def _resolve_gemm(gemm: str) -> str | None:
    """"onednn" / "mkl", "auto" (both available: to be measured) or None (neither)."""
    _check("gemm", gemm, GEMM_CHOICES)
    have = {"onednn": onednn_packing_available(), "mkl": mkl_packing_available()}
    if gemm != "auto":
        if not have[gemm]:
            raise CpuPlanError(f"cpu gemm {gemm!r} refused: this torch build has no packed "
                               f"{gemm} sgemm")
        return gemm
    if all(have.values()):
        return "auto"
    return next((b for b, ok in have.items() if ok), None)


# ---- the plan --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuPlan:
    """isa: the level every kernel runs at ("avx512" | "avx2" | "baseline"); host_isa: the
    host's; torch_isa: what torch dispatches to (get_cpu_capability()); gemm: the packed
    sgemm of the projections ("onednn" | "mkl"; "auto" until measured on a model's weights;
    None: plain F.linear), gemm_how: how it was chosen; c_kernels: the C row-wise and
    attention kernels (kernels/cpu_decode.py) built for `march` ("native": the host's own
    level); prefill_attention: prompt attention through the C kernel ("c") or SDPA ("sdpa");
    threads: the engine's compute threads (None: torch's default, one per core);
    quant_kernels: the quantized weight kernels ("none": float32 weights)."""

    isa: str
    host_isa: str
    torch_isa: str
    gemm: str | None
    gemm_how: str
    c_kernels: bool
    march: str
    prefill_attention: str
    threads: int | None = None
    quant_kernels: str = "none"

    @property
    def forced(self) -> bool:
        return self.isa != self.host_isa

    def describe(self) -> str:
        isa = (f"{self.isa} (forced; host has {self.host_isa})" if self.forced
               else f"{self.isa} (host)")
        c = f"built for -march={self.march}" if self.c_kernels else "off (torch ops)"
        gemm = self.gemm or "F.linear"
        return (f"CPU kernels: isa {isa}, torch dispatch {self.torch_isa}, GEMM "
                f"{gemm} ({self.gemm_how}), C kernels {c}, prompt attention "
                f"{self.prefill_attention}, quantized kernels {self.quant_kernels}, threads "
                f"{self.threads or f'{torch.get_num_threads()} (torch default)'}")


def resolve_cpu_plan(isa: str = "auto", gemm: str = "auto", threads: int | str | None = None,
                     c_kernels: bool = True, prefill_attention: str = "auto",
                     flags: set[str] | None = None, torch_isa: str | None = None) -> CpuPlan:
    """The plan from the config's [cpu] keys. `flags` (the host's CPU flags) and `torch_isa`
    (what torch dispatches to) default to this machine's. Raises CpuPlanError (one line) for
    an unknown value, an ISA above the host's, a GEMM this torch lacks, or a forced ISA that
    torch is not held to (isa_environment was not in the environment when torch started)."""
    level, host = effective_isa(isa, flags)
    _check("prefill_attention", prefill_attention, PREFILL_ATTENTION_CHOICES)
    if threads == "auto":
        threads = None
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)
                                or threads < 1):
        raise CpuPlanError(f"cpu threads {threads!r}; expected a positive integer or \"auto\"")
    if torch_isa is None:
        torch_isa = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine() in ("x86_64", "AMD64")
    held = next((lv for lv, cap in _TORCH_CAPABILITY.items() if cap == torch_isa), level)
    if isa == "auto" and x86 and ISAS.index(held) > ISAS.index(level):
        level = held  # "auto" in a process whose libraries were held lower (isa_environment)
    want = _TORCH_CAPABILITY[level]
    if x86 and level != host and torch_isa != want:
        env = " ".join(f"{k}={v}" for k, v in _ISA_ENV[level].items())
        raise CpuPlanError(f"cpu isa {level!r} forced but torch dispatches {torch_isa}: start "
                           f"through `bucketserve serve --cpu-isa {level}` or set {env} before "
                           "torch starts")
    chosen = _resolve_gemm(gemm)
    how = ("forced" if gemm != "auto" else "to be measured" if chosen == "auto"
           else "the only one available" if chosen else "no packed sgemm in this torch")
    if prefill_attention == "auto":
        # the C prompt kernel's 16-row vectors ran 2x faster than SDPA on an AMD EPYC (Zen 5)
        # and as fast on an Intel Xeon; an AVX2 build has 8-row vectors and ran 3x slower
        # than SDPA (ATen's AVX2 kernels) on that Xeon, 512 tokens of SmolLM2's shape
        prefill_attention = "c" if c_kernels and level == "avx512" else "sdpa"
    return CpuPlan(isa=level, host_isa=host, torch_isa=torch_isa, gemm=chosen, gemm_how=how,
                   c_kernels=c_kernels, march="native" if level == host or not x86 else _MARCH[level],
                   prefill_attention=prefill_attention, threads=threads)


def with_measured_gemm(plan: CpuPlan, weight: torch.Tensor) -> CpuPlan:
    """`plan` with gemm "auto" decided by measuring both backends on `weight` (a model's
    largest float32 projection): the one with the smaller total over _GEMM_PROBE, for every
    forward. (Per row count they differ: with AVX2 forced on the AMD EPYC, MKL's sgemm ran
    1.25-1.36x oneDNN's at 512 rows and oneDNN's was faster at 16; but a plan that gave
    prompt-sized forwards MKL's and the rest oneDNN's served `mixed` at 40.7 output tok/s
    against 94.4 with oneDNN's alone, docs/benchmarks.md.) Any other plan as it is."""
    if plan.gemm != "auto":
        return plan
    times = measure_gemm(weight)
    best = min(times, key=lambda b: sum(times[b].values()))
    how = (f"measured on a {weight.shape[0]}x{weight.shape[1]} weight, 32 x 16 / 512 rows: "
           + ", ".join(f"{b} {t[16]:.1f} / {t[512]:.1f} ms" for b, t in times.items()))
    return dataclasses.replace(plan, gemm=best, gemm_how=how)


@functools.cache
def default_cpu_plan() -> CpuPlan:
    """The plan of a model packed without one (the BERT encoders): the host's level and
    torch's dispatch as they are, and oneDNN's packed GEMM where this torch has it (else
    MKL's, or none), not measured. An encoder's forwards are of B x L rows, where oneDNN's
    has no row limit and runs the GELU and residual adds as epilogues (models/bert.py); a
    start-up probe on MiniLM's 1536x384 weight was a near tie (32 x 16 / 512 rows, Intel
    Xeon: oneDNN 2.0-3.3 / 1.5-2.6 ms, MKL 1.5-2.7 / 2.2-3.3 ms) that picked MKL in one
    process out of three, natively and with AVX2 forced. Served, the two tied on that Xeon;
    with AVX2 forced on the AMD EPYC, MKL's ran forwards of 3-4 rows 2.4-3.2x slower
    (docs/benchmarks.md, Embeddings on the CPU)."""
    if not onednn_packing_available():
        return resolve_cpu_plan()
    return dataclasses.replace(resolve_cpu_plan(gemm="onednn"),
                               gemm_how="the encoders' default, not measured")
