"""Quantized CPU projections: the GGUF's own blocks (Q4_1, Q8_0) and int8 per output channel.

`--quantization q4_1`: a GGUF's Q4_1 projection weights stay in their 20-byte blocks (per 32
weights an fp16 scale d and min m, 4-bit q: w = d * q + m) and are multiplied by float32
activations in csrc/quant_gemm.c, which dequantizes a strip of channels at a time into
L1/L2 and runs a register-blocked float32 kernel over it (AVX-512 or AVX2 + FMA, picked when
the file is compiled for the host). The weight values are bit for bit those of the float32
model that gguf's dequantize gives, and the arithmetic is float32: the outputs equal the
float32 model's up to the order of the additions. Above Q_GEMM_MAX_ROWS rows the weight is
dequantized into a scratch buffer and PyTorch's float32 GEMM multiplies it. The tied LM head reads the GGUF's Q8_0
token embedding the same way (w = d * q).

`--quantization int8`: every projection's float32 weight (and the LM head's) is quantized on
load to int8 with one symmetric scale per output channel; each call quantizes the activation
rows to int8 with one symmetric scale per row (per token) and csrc/quant_gemm.c's i8_gemm sums
the integer products exactly (AVX-512 VNNI vpdpbusd, or AVX2 vpmaddubsw + vpmaddwd), then
scales by row and channel. PyTorch's dynamic int8 linear (fbgemm) quantizes the activation
with one scale per call, which moved SmolLM2's perplexity by +57% (the batch's largest
activation sets every row's step); bench/cpu_quant_kernels.py measures the alternatives and
docs/quantization.md says why these were chosen.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import numpy as np
import torch

from bucketserve.kernels import cpu_decode
from bucketserve.kernels.cpu_plan import cpu_flags

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "quant_gemm.c"
# --quantization values served by this module (CPU only)
CPU_MODES = ("q4_1", "int8")
# gguf.GGMLQuantizationType values, and each block's (weights, bytes)
Q4_1, Q8_0 = 3, 8
BLOCKS = {Q4_1: (32, 20), Q8_0: (32, 34)}
QTYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}
MAX_K = 8192  # csrc/quant_gemm.c's strip buffer
# Row counts up to this run the fused kernel; more: dequantize + PyTorch's float32 GEMM.
# bench/cpu_quant_kernels.py on the 2-core AMD EPYC: the fused kernel 2.4 ms per layer at 64
# rows, growing linearly, and dequantize + MKL's sgemm 6.7 ms at 128 rows and 22.6 ms at 512:
# the fused kernel serves every step the scheduler makes (chunks up to its token budget).
Q_GEMM_MAX_ROWS = 4096

_libs: dict[str, ctypes.CDLL | None] = {}  # per -march: the build, or None where it failed
_infos: dict[str, dict] = {}


def _march() -> str:
    """The -march of the C kernels in use (the CPU plan's, kernels/cpu_plan.py)."""
    return cpu_decode.selected_march()


def load() -> ctypes.CDLL | None:
    """The compiled csrc/quant_gemm.c for the -march the CPU plan selected (cpu_decode.select),
    or None where it cannot be built or run here (no C compiler, [cpu] c_kernels = false, a
    build for another instruction set)."""
    march = _march()
    if march in _libs:
        return _libs[march]
    info = _infos[march] = {}
    _libs[march] = None
    if cpu_decode.load() is None:  # same switches, compiler and OpenMP checks
        info.update(enabled=False, reason=cpu_decode.build_info().get("reason", ""))
        return None
    cc = cpu_decode._compiler()
    features = cpu_flags()
    flags = cpu_decode._flags(cpu_decode._openmp_shared(), march)
    target = cpu_decode.build_target(cc, flags, features, _SOURCE)
    try:
        if not target.exists():
            cpu_decode.build(cc, flags, target, _SOURCE)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("quantized CPU kernels unavailable: %s", detail)
        info.update(enabled=False, reason=str(detail)[:200])
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bq_isa.restype = i32
    lib.q_gemm.restype = i32
    lib.q_gemm.argtypes = [i32, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]
    lib.q_dequant.restype = i32
    lib.q_dequant.argtypes = [i32, ptr, ptr, i64, i64, i32]
    lib.i8_isa.restype = i32
    lib.i8_gemm.restype = i32
    lib.i8_gemm.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i32]
    built = lib.bq_isa()
    if features and built > cpu_decode.host_isa(features):
        info.update(enabled=False, reason="build for another instruction set")
        return None
    info.update(enabled=True, path=str(target), march=march,
                isa={3: "avx512f", 2: "avx2+fma"}.get(built, "baseline"),
                int8_isa={4: "avx512_vnni", 2: "avx2"}.get(lib.i8_isa(), "baseline"))
    _libs[march] = lib
    return lib


def build_info() -> dict:
    load()
    return dict(_infos[_march()])


def describe_kernels(mode: str) -> str:
    """The quantized kernels `mode` runs on this host, for the start-up log."""
    info = build_info()
    if not info.get("enabled"):
        return f"torch reference ops ({info.get('reason', 'no kernels')})"
    if mode == "q4_1":
        return (f"Q4_1 / Q8_0 blocks x float32: csrc/quant_gemm.c q_gemm for {info['isa']} up to "
                f"{Q_GEMM_MAX_ROWS} rows, above: q_dequant + PyTorch float32 GEMM")
    return (f"int8 weights x int8 rows: csrc/quant_gemm.c i8_gemm for {info['int8_isa']}")


def block_bytes(qtype: int, k: int) -> int:
    """Bytes of one [K] row in `qtype` blocks."""
    per, size = BLOCKS[qtype]
    return k // per * size


def gguf_blocks(qtype: int, blocks: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """A GGUF tensor's raw blocks (read_gguf_file's uint8 data of a [N, K] weight) as a
    [N, row bytes] uint8 tensor of its own (a copy out of the file map)."""
    n, k = shape
    if qtype not in BLOCKS or k % BLOCKS[qtype][0]:
        raise ValueError(f"{QTYPE_NAMES.get(qtype, qtype)} blocks of a [{n}, {k}] weight are "
                         "not supported (Q4_1 or Q8_0, K a multiple of 32)")
    return torch.from_numpy(np.array(blocks, dtype=np.uint8).reshape(n, block_bytes(qtype, k)))


def dequantize(qtype: int, blocks: torch.Tensor, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, row bytes] blocks -> the float32 [N, K] weight (the values gguf's dequantize
    gives)."""
    lib = load()
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(n, k)
    if lib is None:
        import gguf

        arr = gguf.quants.dequantize(blocks.numpy().reshape(n, -1), gguf.GGMLQuantizationType(qtype))
        out.copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))
        return out
    rc = lib.q_dequant(qtype, blocks.data_ptr(), out.data_ptr(), n, k, cpu_decode.threads())
    if rc != 0:
        raise ValueError(f"q_dequant: unsupported {QTYPE_NAMES.get(qtype, qtype)} [{n}, {k}]")
    return out


_scratch: dict[int, torch.Tensor] = {}


def _scratch_weight(n: int, k: int) -> torch.Tensor:
    """A float32 [n, k] view of one per-thread-free buffer reused by every large product (the
    engine runs the model from one thread)."""
    buf = _scratch.get(0)
    if buf is None or buf.numel() < n * k:
        buf = _scratch[0] = torch.empty(n * k)
    return buf[: n * k].view(n, k)


def q_linear(x: torch.Tensor, qtype: int, blocks: torch.Tensor, k: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ the block-quantized weight^T (+ bias) -> [M, N] float32."""
    n = blocks.shape[0]
    m = x.shape[0]
    lib = load()
    if lib is None or k > MAX_K:
        w = dequantize(qtype, blocks, k)
        return torch.nn.functional.linear(x, w, bias)
    if m > Q_GEMM_MAX_ROWS:
        w = dequantize(qtype, blocks, k, _scratch_weight(n, k))
        return torch.nn.functional.linear(x, w, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n)
    rc = lib.q_gemm(qtype, blocks.data_ptr(), x.data_ptr(), x.stride(0),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
                    cpu_decode.threads())
    if rc != 0:
        raise ValueError(f"q_gemm: unsupported {QTYPE_NAMES.get(qtype, qtype)} [{n}, {k}]")
    return out


# ---- int8 per output channel x int8 per row ---------------------------------------------


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] -> (int8 [N, K], float32 [N] scales): symmetric, scale = max|w| / 127
    per row (a zero row gets scale 1)."""
    amax = weight.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(weight.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_state_dict_int8(state: dict[str, torch.Tensor],
                             projections: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A model state dict with the weight of every module named by a suffix in `projections`
    replaced by its int8 form: `<p>.weight` int8 [out, in] and `<p>.weight_scale` float32
    [out] (quantize_int8_per_channel). Other entries are kept as they are."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        prefix = key.removesuffix(".weight")
        if key.endswith(".weight") and prefix.endswith(projections) and value.is_floating_point():
            out[key], out[prefix + ".weight_scale"] = quantize_int8_per_channel(value)
        else:
            out[key] = value
    return out


def int8_linear_reference(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """What int8_linear computes, in torch: each row of x quantized symmetrically to int8
    (scale max|x| / 127, round half to even), the integer products summed exactly, then
    (float) sum * row scale * channel scale (+ bias)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = torch.round(x / sx)
    acc = (xq.double() @ wq.double().t()).to(torch.int32)  # exact: |sum| < 2^53
    out = acc.float() * sx * scale
    return out if bias is None else out + bias


def int8_linear(x: torch.Tensor, wq: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ (wq [N, K] int8 * scale [N])^T (+ bias) with x quantized per row
    (int8_linear_reference's arithmetic, bit for bit); wsum: int32 [N] row sums of wq."""
    lib = load()
    m, k = x.shape
    n = wq.shape[0]
    if lib is None or k % 64:
        return int8_linear_reference(x, wq, scale, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n)
    xq = torch.empty(m, k, dtype=torch.uint8)
    sx = torch.empty(m)
    lib.i8_gemm(x.data_ptr(), x.stride(0), wq.data_ptr(), wsum.data_ptr(), scale.data_ptr(),
                None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
                xq.data_ptr(), sx.data_ptr(), cpu_decode.threads())
    return out
