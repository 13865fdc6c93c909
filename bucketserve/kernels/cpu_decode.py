"""The C paged-decode kernel for the CPU (csrc/paged_decode.c), built on first use.

It is compiled with the system C compiler into a per-user cache keyed by the source's hash
and loaded with ctypes, so no build step is needed at install time. Where no compiler is
available, `load()` returns None and attention stays on the torch path (which is also the
test oracle for this kernel).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bucketserve" / "kernels"


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, "-O3", "-march=native", "-fopenmp-simd", "-pthread", "-shared", "-fPIC", str(_SOURCE),
               "-o", str(out), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(out, target)  # atomic: concurrent builders never see a partial file


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None when it cannot be built here."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{digest}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU decode kernel unavailable, using the torch path: %s", detail)
        return None
    fn = lib.paged_decode_f32
    fn.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, ctypes.c_int]
    _lib = lib
    return _lib


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
        k_cache.shape[1], scale, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged_decode_f32: unsupported shape (heads {hq}/{k_cache.shape[2]}, "
                         f"head_dim {d}, block_size {k_cache.shape[1]})")
