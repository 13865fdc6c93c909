"""The C kernels of the float32 CPU forward (csrc/paged_decode.c), built on first use.

They are compiled with the system C compiler into a per-user cache and loaded with ctypes, so
no build step is needed at install time. The build is the CPU plan's (kernels/cpu_plan.py:
`-march=native` at the host's own level, `-march=x86-64-v3` where AVX2 is forced on an
AVX-512 host); `select` loads one at start-up and the ops below run it. The cache key is the
source's hash, the compiler's version, the flags and the CPU's feature flags: a cache
directory shared between an AVX-512 and an AVX2 machine holds one build per kind, and the
loader checks that the instruction set a build was compiled for (`bs_isa()` in the C file)
is one the host has before calling anything else in it.

Threads: with PyTorch on its OpenMP (GNU libgomp) backend, the kernels are built with
-fopenmp and run on PyTorch's own OpenMP team (the same libgomp.so.1 is loaded once); if a
second OpenMP runtime shows up in the process they run on one thread instead.

Where no compiler is available, or the plan has them off (`[cpu] c_kernels = false`),
`load()` returns None and the model and attention stay on their torch paths (which are also
the test oracles).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bucketserve.kernels import cpu_plan

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# The build in use (select): a cache of what was loaded for the plan, not a choice made here
_lib: ctypes.CDLL | None = None
_selected: tuple[str, bool] | None = None  # (march, enabled) of _lib
_info: dict = {}
_threads_ok = True  # False when a second OpenMP runtime is in the process


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bucketserve" / "kernels"


_ISA_LEVEL = {"avx512": 3, "avx2": 2, "baseline": 1}  # bs_isa()'s levels


def host_isa(flags: set[str] | None = None) -> int:
    """3: AVX-512F, 2: AVX2 + FMA, 1: anything else (the levels of bs_isa() in the C file)."""
    return _ISA_LEVEL[cpu_plan.host_isa(flags)]


def _openmp_shared() -> bool:
    """PyTorch runs on GNU OpenMP, whose libgomp.so.1 a -fopenmp build will share."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    return any("libgomp" in path.rsplit("/", 1)[-1] for path in _omp_runtimes())


def _omp_runtimes() -> set[str]:
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f
                    if re.search(r"lib(gomp|iomp5|omp)[.-]", line.rsplit("/", 1)[-1])}
    except OSError:
        return set()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _flags(openmp: bool, march: str = "native") -> list[str]:
    """Compiler flags for -march=`march` ("native": the host's own instruction set).

    On x86 the tuning is GCC's generic one: -march=native also tunes for the CPU model the
    processor reports, and under a hypervisor that can be another chip's. The Intel Xeon
    (AVX-512, AMX) of one of this project's machines reports model 167, which GCC 12 tunes as
    Rocket Lake: its decode attention then ran 5.1x slower than with generic tuning on the
    same instructions (16 sequences x 512 positions, one thread: 8.2 ms against 1.6 ms)."""
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    arch = [f"-march={march}" if x86 else f"-mcpu={march}"]
    if x86:
        arch.append("-mtune=generic")
    return ["-O3", *arch, "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared",
            "-fopenmp" if openmp else "-fopenmp-simd"]


def build_target(cc: str, flags: list[str], features: set[str],
                 source: Path = _SOURCE) -> Path:
    """The cached build's path: keyed by the source, the compiler's version, the flags, the
    architecture and the CPU's feature flags (so a cache shared by machines of different
    instruction sets never hands one machine another's build)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[:1]
    except OSError:
        version = []
    key = hashlib.sha256()
    for part in (source.read_bytes(), repr(version).encode(), " ".join(flags).encode(),
                 platform.machine().encode(), " ".join(sorted(features)).encode()):
        key.update(part)
        key.update(b"\0")
    return _cache_dir() / f"{source.stem}-isa{host_isa(features)}-{key.hexdigest()[:16]}.so"


def build(cc: str, flags: list[str], target: Path, source: Path = _SOURCE) -> None:
    """Compiles `source` into the shared library `target` (atomically replaced)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *flags, str(source), "-o", str(out), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(out, target)  # atomic: concurrent builders never see a partial file


def _bind(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.bs_isa.restype = i32
    lib.bs_isa.argtypes = []
    lib.bs_openmp.restype = i32
    lib.bs_openmp.argtypes = []
    fn = lib.paged_decode_f32
    fn.restype = i32
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, i32]
    fn = lib.paged_prefill_f32
    fn.restype = i32
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                   f32, i32]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.rope_write_kv_f32.restype = None
    lib.rope_write_kv_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i32]
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = [ptr, ptr, i64, i64, i32]


def select(march: str = "native", enabled: bool = True) -> dict:
    """Builds (or finds in the cache) and loads the kernels for -march=`march`, and makes them
    the ones the ops below run; enabled=False: none (torch ops). Returns build_info()."""
    global _lib, _selected, _threads_ok
    if _selected == (march, enabled):
        return dict(_info)
    _lib, _selected = None, (march, enabled)
    _info.clear()
    if not enabled:
        _info.update(enabled=False, reason="[cpu] c_kernels = false")
        return dict(_info)
    cc = _compiler()
    if cc is None:
        log.warning("CPU kernels unavailable (no C compiler: set CC or install gcc); using torch ops")
        _info.update(enabled=False, reason="no C compiler")
        return dict(_info)
    features = cpu_plan.cpu_flags()
    flags = _flags(_openmp_shared(), march)
    isa = host_isa(features)
    target = build_target(cc, flags, features)
    try:
        if not target.exists():
            build(cc, flags, target)
        lib = ctypes.CDLL(str(target))
        _bind(lib)
    except (OSError, RuntimeError, subprocess.CalledProcessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels unavailable, using torch ops: %s", detail)
        _info.update(enabled=False, reason=str(detail)[:200])
        return dict(_info)
    built = lib.bs_isa()
    if features and built > isa:
        log.warning("CPU kernel build %s targets ISA level %d but this CPU has level %d; using "
                    "torch ops", target.name, built, isa)
        _info.update(enabled=False, reason="build for another instruction set")
        return dict(_info)
    runtimes = _omp_runtimes()
    _threads_ok = bool(lib.bs_openmp()) and len(runtimes) <= 1
    if lib.bs_openmp() and len(runtimes) > 1:
        log.warning("two OpenMP runtimes in the process (%s): CPU kernels run on one thread",
                    ", ".join(sorted(runtimes)))
    _info.update(enabled=True, path=str(target), isa={3: "avx512f", 2: "avx2+fma"}.get(built, "baseline"),
                 openmp=bool(lib.bs_openmp()), threads=_threads_ok, flags=" ".join(flags))
    _lib = lib
    return dict(_info)


def selected_march() -> str:
    """The -march of the kernels in use (select's; "native" before any plan selected one)."""
    if _selected is None:
        select()
    return _selected[0]


def load() -> ctypes.CDLL | None:
    """The kernels in use (the host's native build when no plan selected one), or None when
    they cannot be built or run here."""
    if _selected is None:
        select()
    return _lib


def build_info() -> dict:
    """What was built and loaded (for logs and benchmark records)."""
    load()
    return dict(_info)


def threads() -> int:
    return torch.get_num_threads() if _threads_ok else 1


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.is_contiguous()
            and load() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
    """q, out: [nd, Hq, D] (out contiguous); block_tables [>= nd, W] int32; seq_lens int32."""
    lib = load()
    assert lib is not None and out.is_contiguous()
    nd, hq, d = q.shape
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    rc = lib.paged_decode_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), nd, hq, k_cache.shape[2], d,
        k_cache.shape[1], scale, threads())
    if rc != 0:
        raise ValueError(f"paged_decode_f32: unsupported shape (heads {hq}/{k_cache.shape[2]}, "
                         f"head_dim {d}, block_size {k_cache.shape[1]})")


def prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """paged_prefill's shapes: block size 16, head_dim a multiple of 16 up to 256."""
    d = q.shape[2]
    return (supports(q, k_cache) and k_cache.shape[1] == 16 and d % 16 == 0 and d <= 256
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[1] // k_cache.shape[2] <= 113)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                  first_row: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of prompt chunks over the pool (their K/V written). q, out:
    [T, Hq, D] (rows of head dim contiguous; out contiguous); the chunks' rows follow each
    other from `first_row`; block_tables [len(query_lens), W] int32, one row per chunk;
    chunk i has query_lens[i] queries, the last ones of a context of seq_lens[i] positions."""
    lib = load()
    assert lib is not None and out.is_contiguous()
    n = len(query_lens)
    qlen = torch.tensor(query_lens, dtype=torch.int64)
    klen = torch.tensor(seq_lens, dtype=torch.int64)
    qstart = (qlen.cumsum(0) - qlen) + first_row
    tables = block_tables.contiguous()
    hq, d = q.shape[1], q.shape[2]
    rc = lib.paged_prefill_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), qstart.data_ptr(), qlen.data_ptr(), klen.data_ptr(), out.data_ptr(),
        out.stride(0), n, hq, k_cache.shape[2], d, k_cache.shape[1], scale, threads())
    if rc != 0:
        raise ValueError(f"paged_prefill_f32: unsupported shape (heads {hq}/{k_cache.shape[2]}, "
                         f"head_dim {d}, block_size {k_cache.shape[1]})")


# ---- row-wise ops (callers check dtype float32, CPU, contiguous rows) ---------------------

def rms_norm(res: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor) -> None:
    """res += delta (if given), then out = RMSNorm(res) * weight; all [T, H] contiguous."""
    t, h = res.shape
    _lib.rms_norm_f32(res.data_ptr(), None if delta is None else delta.data_ptr(),
                      weight.data_ptr(), out.data_ptr(), t, h, eps, threads())


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, hq: int,
                  hkv: int, d: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """Rotates q and k inside qkv [T, (hq + 2 hkv) * d] (contiguous) and writes k, v to the
    pool slots; positions and slots int64 [T]; cos_sin [max_pos, d]."""
    _lib.rope_write_kv_f32(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), positions.data_ptr(),
                           cos_sin.data_ptr(), hq, hkv, d, k_cache.data_ptr(), v_cache.data_ptr(),
                           slots.data_ptr(), threads())


def silu_mul(gu: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, I] = silu(gu[:, :I]) * gu[:, I:]; gu [T, 2I] contiguous."""
    _lib.silu_mul_f32(gu.data_ptr(), out.data_ptr(), gu.shape[0], out.shape[1], threads())
