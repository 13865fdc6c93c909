"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over the paged KV pool.

All sequences of a step are flattened into one token batch of T tokens; every op below works
on [T, ...] tensors, so there is no per-token or per-sequence Python here (that lives in the
attention backend). Weight layout, chosen at load time for CPU throughput:

  qkv_proj     one Linear, rows = [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]   (q/k/v fused)
  gate_up_proj one Linear, rows = [gate (I) | up (I)]                  (gate/up fused)

RoPE is the "rotate half" (GPT-NeoX) form that Hugging Face checkpoints use; GGUF weights are
un-permuted into that form by the GGUF loader. cos/sin are precomputed once for every position
and gathered once per forward, then shared by all layers.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.buckets.config import GEMV_MODES
from bucketserve.kernels import cpu_decode, cpu_quant
from bucketserve.kernels.attention import AttentionBackend, get_forward_context
from bucketserve.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_channel
from bucketserve.kernels.fp8_ops import (
    fp8_linear,
    quantize_rows,
    rms_norm_quant,
    silu_and_mul_quant,
)
from bucketserve.kernels.triton_ops import apply_rotary, rms_norm, silu_and_mul  # CPU-safe
from bucketserve.models.config import ModelConfig

log = logging.getLogger(__name__)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] float32, with the config's rope scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64,
                                                           device="cpu").float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        # positions are divided by the factor, i.e. every frequency is
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: wavelengths above old_len/low are slowed down by `factor`, those below
        # old_len/high are kept, and the band in between is interpolated; the clamp of the
        # interpolation weight to [0, 1] covers all three regions.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


# The modules below allocate their parameters with torch.empty and never initialise them: the
# loaders assign checkpoint tensors (or random ones, build_dummy_model), and skipping
# nn.Linear's kaiming init saves seconds per load (and a slow first meta-device init).


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def onednn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def cpu_gemm_backend() -> str | None:
    """Which packed float32 GEMM the CPU projections use: BUCKETSERVE_CPU_GEMM = "onednn",
    "mkl" or "auto" (the default). "auto" is returned as is when this torch has both: the
    first model packed then measures them on its own weights (measure_cpu_gemm) and keeps
    the faster for the process. None: neither is available.

    Neither wins everywhere. oneDNN picks its kernels by the CPU's instruction set, MKL also by
    its vendor: on the AMD EPYC (Zen 5, AVX-512) of this project's 2-core machine MKL's packed
    sgemm ran its AVX2 kernels at ~110 GFLOP/s per core and oneDNN's AVX-512 ones at ~250; on
    an Intel Xeon (AVX-512, AMX) MKL's ran at 153 GFLOP/s at 16 rows against oneDNN's 81, and
    faster at every row count measured (bench/cpu_profile.py measures both at the model's
    shapes)."""
    want = os.environ.get("BUCKETSERVE_CPU_GEMM", "auto").strip().lower() or "auto"
    if want not in ("auto", "onednn", "mkl"):
        raise ValueError(f"BUCKETSERVE_CPU_GEMM={want!r}: expected auto, onednn or mkl")
    dnn, mkl = onednn_packing_available(), mkl_packing_available()
    if want == "auto" and dnn and mkl:
        return "auto"
    if want in ("auto", "onednn") and dnn:
        return "onednn"
    if want in ("auto", "mkl") and mkl:
        return "mkl"
    return None


def _pack_as(backend: str, weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), batch_hint)


def _linear_as(backend: str, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    # the ops bound once below (_dnn_linear, _mkl_linear): a torch.ops lookup per call costs
    # microseconds on the per-projection path
    if backend == "onednn":
        return _dnn_linear(x, packed, bias, "none", [], "")
    return _mkl_linear(x, packed, weight, bias, x.shape[0])


# What "auto" times on a model's largest projection: 32 GEMMs of 16 rows (decode-sized) and one
# of 512 (prefill-sized), the same rows in both, twice per backend, alternating.
_GEMM_PROBE = ((16, 32), (512, 1))


@torch.inference_mode()
def measure_cpu_gemm(weight: torch.Tensor, rounds: int = 2) -> tuple[str, dict[str, float]]:
    """The faster packed backend ("onednn" or "mkl") for a float32 [out, in] weight, with each
    one's best time (ms) for the rows of _GEMM_PROBE. Both give the same results to rounding
    (tests/test_cpu_threads.py), so the choice only moves speed."""
    xs = {rows: torch.randn(rows, weight.shape[1]) for rows, _ in _GEMM_PROBE}
    packed = {b: _pack_as(b, weight) for b in ("onednn", "mkl")}
    best = {b: float("inf") for b in packed}
    for _ in range(rounds):
        for b, p in packed.items():
            _linear_as(b, xs[16], p, weight, None)  # warm-up
            t0 = time.perf_counter()
            for rows, reps in _GEMM_PROBE:
                for _ in range(reps):
                    _linear_as(b, xs[rows], p, weight, None)
            best[b] = min(best[b], (time.perf_counter() - t0) * 1e3)
    return min(best, key=best.get), best


def _resolve_gemm(module: nn.Module) -> None:
    """BUCKETSERVE_CPU_GEMM=auto: measures both backends once, on the largest projection of
    the first module packed, and keeps the faster for the process."""
    global _GEMM
    if _GEMM != "auto":
        return
    weight = max((sub.weight for sub in module.modules() if isinstance(sub, Linear)),
                 key=lambda w: w.numel(), default=None)
    if weight is None:
        return
    _GEMM, times = measure_cpu_gemm(weight)
    log.info("CPU GEMM: %s (BUCKETSERVE_CPU_GEMM=auto, measured on a %dx%d weight, %d and %d "
             "rows: %s)", _GEMM, *weight.shape, *(rows for rows, _ in _GEMM_PROBE),
             ", ".join(f"{b} {t:.1f} ms" for b, t in times.items()))


def packed_gemm_backend() -> str | None:
    """The packed GEMM in use: "onednn", "mkl", "auto" (not measured yet) or None."""
    return _GEMM


def pack_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    """The packed layout of a float32 [out, in] weight for the CPU GEMM backend in use
    (cpu_gemm_backend). Packed sgemm is 2-4x faster than F.linear at the small row counts of
    CPU decode steps (measured: 64 rows x 576 -> 3072, 8.0 ms -> 2.1 ms on 2 cores, MKL) and no
    slower at prefill sizes; oneDNN's layout chosen for 64 rows serves 8..2048 rows at the
    same rate."""
    return _pack_as(_GEMM, weight, batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return _linear_as(_GEMM, x, packed, weight, bias)


def pack_linear_weights(module: nn.Module, weight: torch.Tensor) -> bool:
    """Gives every Linear inside `module` a packed copy of its weight (pack_weight), when
    `weight` (one of the model's parameters) is float32 on CPU and a packed GEMM is available;
    the original weights stay (autograd, unpacked paths). Returns False, changing nothing,
    otherwise."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or _GEMM is None:
        return False
    _resolve_gemm(module)
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.packed = pack_weight(sub.weight)
    return True


_GEMM = cpu_gemm_backend()
_mkl_linear = torch.ops.mkl._mkl_linear if mkl_packing_available() else None
_dnn_linear = torch.ops.mkldnn._linear_pointwise if onednn_packing_available() else None


def _apply_cpu_threads() -> None:
    """BUCKETSERVE_CPU_THREADS=N: the compute threads of the thread that runs the forward.
    PyTorch's thread count (OpenMP's) is a per-thread setting, so it is applied in the thread
    that runs the model (the engine's), on its first forward there."""
    value = os.environ.get("BUCKETSERVE_CPU_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    from bucketserve.kernels.triton_gemv import gemv

    return gemv(x.contiguous(), weight, config=config)



def _linear(x: torch.Tensor, lin: tuple) -> torch.Tensor:
    """(packed, weight, bias) of a Linear applied to x [T, in] (no module call overhead)."""
    if isinstance(lin, QuantLinear):
        return lin(x)
    packed, weight, bias = lin
    if packed is None:
        return F.linear(x, weight, bias)
    return _linear_as(_GEMM, x, packed, weight, bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.packed: torch.Tensor | None = None  # set by pack_linear_weights
        # CUDA: the Triton GEMV config for one-row inputs (kernels/triton_gemv), set by
        # LlamaForCausalLM.use_gemv where it measured faster than cuBLAS; None: F.linear
        self.gemv: tuple[int, int, int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] == 1:  # set only on bias-free projections
            return _gemv(x, self.weight, self.gemv)
        if self.packed is not None and not torch.is_grad_enabled():
            return packed_linear(x, self.packed, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# The decoder projections that quantization = "fp8" stores in FP8 (names inside a layer). The
# embeddings and the LM head stay in the model dtype: the embedding is a lookup (no product to
# speed up), and the LM head's logits decide every sampled token (its error would move
# greedy choices directly); at the 8B shape it is 5% of the weight bytes.
FP8_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                   "mlp.down_proj")


class Fp8Linear(nn.Module):
    """A projection with FP8 weights: weight [out, in] float8_e4m3fn, weight_scale [out]
    float32 (one scale per output channel), optional input_scale (a float32 scalar: static
    activation quantization; absent: per token, dynamic), bias in the model dtype.

    forward takes the activation either in the model dtype (quantized here) or already
    quantized, (q, scale) from a fused producer (kernels/fp8_ops.rms_norm_quant,
    silu_and_mul_quant). A checkpoint's per-tensor or block-wise weight scales are turned
    into per-channel ones when loaded (_load_from_state_dict): the weight is dequantized and
    quantized again per channel, so every layer runs the one row-wise scaled GEMM."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None,
                 dtype: torch.dtype | None = None, block: tuple[int, int] = (128, 128)) -> None:
        super().__init__()
        self.out_dtype = dtype or torch.bfloat16
        self.block = block  # the block shape of block-wise checkpoint scales
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32,
                                                     device=device), requires_grad=False)
        self.register_buffer("input_scale", None)  # a tensor when a checkpoint has one
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                 requires_grad=False) if bias else None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        key = prefix + "input_scale"
        if key in state_dict and self.input_scale is None:
            self.register_buffer("input_scale", torch.empty((), device=self.weight.device))
        scale_key, weight_key = prefix + "weight_scale", prefix + "weight"
        scale = state_dict.get(scale_key)
        if scale is not None and weight_key in state_dict and not (
                scale.dim() == 1 and scale.numel() == self.weight.shape[0]):
            w = dequantize_fp8(state_dict[weight_key], scale, self.block)
            state_dict[weight_key], state_dict[scale_key] = quantize_fp8_per_channel(w)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            x = quantize_rows(x, self.input_scale)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.out_dtype)


def quantize_state_dict_fp8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict (this package's fused names) with every FP8_PROJECTIONS weight
    replaced by its per-channel FP8 form: `<p>.weight` float8_e4m3fn [out, in] and
    `<p>.weight_scale` float32 [out] (kernels/fp8.quantize_fp8_per_channel), the format a
    pre-quantized checkpoint loads into. Other entries are kept as they are."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        prefix = key.removesuffix(".weight")
        if key.endswith(".weight") and prefix.endswith(FP8_PROJECTIONS) \
                and value.dtype != FP8_DTYPE:
            out[key], out[prefix + ".weight_scale"] = quantize_fp8_per_channel(value)
        else:
            out[key] = value
    return out


class QuantLinear(nn.Module):
    """A CPU projection with quantized weights (kernels/cpu_quant.py), float32 in and out.
    mode "q4_1": weight [out, in / 32 * 20] uint8, the GGUF's Q4_1 blocks (Q8_0 blocks, 34
    bytes per 32, for an LM head: `qtype`); mode "int8": weight [out, in] int8 and weight_scale
    [out] float32 (symmetric, per output channel), times int8 activation rows (one scale per
    row, quantized per call). The bias stays float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool, mode: str,
                 device=None, dtype: torch.dtype | None = None, qtype: int = cpu_quant.Q4_1) -> None:
        super().__init__()
        self.mode, self.in_features, self.qtype = mode, in_features, qtype
        if mode == "q4_1":
            shape, wdtype = (out_features, cpu_quant.block_bytes(qtype, in_features)), torch.uint8
            self.register_parameter("weight_scale", None)
        else:
            shape, wdtype = (out_features, in_features), torch.int8
            self.weight_scale = nn.Parameter(torch.empty(out_features, device=device),
                                             requires_grad=False)
        self.weight = nn.Parameter(torch.empty(shape, dtype=wdtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                 requires_grad=False) if bias else None
        self._wsum: torch.Tensor | None = None  # int8: int32 [out] row sums, on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "q4_1":
            return cpu_quant.q_linear(x, self.qtype, self.weight, self.in_features, self.bias)
        if self._wsum is None:
            self._wsum = self.weight.sum(dim=1, dtype=torch.int32)
        return cpu_quant.int8_linear(x, self.weight, self._wsum, self.weight_scale, self.bias)


def _projection(in_features: int, out_features: int, bias: bool, quantization: str,
                **factory) -> Linear | Fp8Linear | QuantLinear:
    if quantization in cpu_quant.CPU_MODES:
        return QuantLinear(in_features, out_features, bias, quantization, **factory)
    return (Fp8Linear if quantization == "fp8" else Linear)(in_features, out_features,
                                                             bias=bias, **factory)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, **factory))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 like HF; spelled out because F.rms_norm's CPU kernel measured
        # ~3x slower at 512 tokens (and no faster for decode batches).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return h.to(x.dtype).mul_(self.weight)  # h is a fresh tensor: in place is safe


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 quantization: str = "none", **factory) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = _projection(config.hidden_size, self.q_size + 2 * self.kv_size,
                                    config.attention_bias, quantization, **factory)
        self.o_proj = _projection(self.q_size, config.hidden_size, config.o_proj_bias,
                                  quantization, **factory)
        self.attn_backend = attn_backend
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        # an FP8 KV pool's scales (stored = value / scale): a checkpoint's k_scale / v_scale
        # buffers when it has them; kv_scales is their host copy for the kernels (set by
        # LlamaForCausalLM.bind_kv_cache; None: a pool in the model dtype, no scaling)
        self.register_buffer("k_scale", None)
        self.register_buffer("v_scale", None)
        self.kv_scales: tuple[float, float] | None = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in ("k_scale", "v_scale"):
            if prefix + name in state_dict and getattr(self, name) is None:
                self.register_buffer(name, torch.empty((), device=self.o_proj.weight.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Writes k, v into the pool and attends q over it (scaled for an FP8 pool)."""
        if self.kv_scales is None:
            return self.attn_backend.forward(q, k, v, self.k_cache, self.v_cache, self.scale)
        return self.attn_backend.forward(q, k, v, self.k_cache, self.v_cache, self.scale,
                                         kv_scales=self.kv_scales)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H]; cos/sin [T, 1, D/2] -> [T, H]."""
        if self.k_cache is None:
            raise RuntimeError("no KV cache bound: call model.bind_kv_cache(kv) before forward")
        t = x.shape[0]
        d = self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        # q and k rotated together, in place inside the qkv buffer: [T, Hq + Hkv, D]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, d)
        x1, x2 = qk[..., : d // 2], qk[..., d // 2:]
        x1_orig = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
        x2.mul_(cos).addcmul_(x1_orig, sin)  # x2 cos + x1 sin
        q = qk[:, : self.num_heads]  # [T, Hq, D]
        k = qk[:, self.num_heads:]  # [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, d)
        return self.o_proj(self.attend(q, k, v).reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str = "none", **factory) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = _projection(config.hidden_size, 2 * self.inter, config.mlp_bias,
                                        quantization, **factory)
        self.down_proj = _projection(self.inter, config.hidden_size, config.mlp_bias,
                                     quantization, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)  # [T, 2I]
        # silu(gate) is a fresh tensor, so the product can be taken in place
        return self.down_proj(F.silu(gu[:, : self.inter]).mul_(gu[:, self.inter:]))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 quantization: str = "none", **factory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = LlamaAttention(config, attn_backend, quantization, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = LlamaMLP(config, quantization, **factory)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [T, H] is the residual stream; it is updated in place and returned."""
        h += self.self_attn(self.input_layernorm(h), cos, sin)
        h += self.mlp(self.post_attention_layernorm(h))
        return h


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 quantization: str = "none", **factory) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attn_backend, quantization,
                                                      **factory)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


def _norm_into(proj: nn.Module, x: torch.Tensor, norm: RMSNorm,
               residual: torch.Tensor | None = None):
    """kernels/triton_ops.rms_norm of x (+ residual) as the input of `proj`: for an Fp8Linear
    quantized in the same kernel (with its static input scale, if any) -> (the normed input,
    x + residual or None)."""
    if isinstance(proj, Fp8Linear):
        return rms_norm_quant(x, norm.weight, norm.eps, residual, proj.input_scale)
    return rms_norm(x, norm.weight, norm.eps, residual=residual)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H] (final norm applied); call it
    inside kernels.attention.forward_context(meta) after bind_kv_cache(kv).

    Constructed directly, the parameters are uninitialised: use loader.load_model or
    loader.build_dummy_model to get weights. quantization "fp8": the FP8_PROJECTIONS are
    Fp8Linear (state dict: quantize_state_dict_fp8's form); "q4_1" / "int8" (CPU): they are
    QuantLinear, and the loader may set lm_head_quant (a QuantLinear for the logits)."""

    fused_ops = True  # CUDA: run _forward_fused (benchmarks switch it off to compare)
    cpu_kernels = True  # float32 CPU: run _forward_cpu (the C row-wise ops), when they build

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, quantization: str = "none") -> None:
        super().__init__()
        if quantization not in ("none", "fp8", *cpu_quant.CPU_MODES):
            raise ValueError(f"quantization {quantization!r}; expected none, fp8, "
                             f"{', '.join(cpu_quant.CPU_MODES)}")
        factory = {"device": device, "dtype": dtype}
        self.config = config
        self.quantization = quantization
        self.attn_backend = attn_backend or AttentionBackend()
        self.model = LlamaModel(config, self.attn_backend, quantization, **factory)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, bias=False, **factory))
        self._lm_head_packed: torch.Tensor | None = None  # see pack_cpu_weights
        self.lm_head_quant: QuantLinear | None = None  # the logits' QuantLinear (CPU modes)
        self._lm_head_gemv: tuple[int, int, int, int] | None = None  # see use_gemv
        self._cpu_plan: list[tuple] | None = None  # see _forward_cpu
        self._threads_set_for: int | None = None  # the thread _apply_cpu_threads ran in
        # [max_pos, D]: cos in the first D/2 columns, sin in the last D/2
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        if torch.device(device or "cpu").type != "meta":
            self.init_rope_cache()

    def init_rope_cache(self) -> None:
        """(Re)computes the cos/sin table on the weights' device and dtype. Needed after the
        model was materialised from the meta device (to_empty / load_state_dict(assign=True))."""
        w = self.model.embed_tokens.weight
        inv_freq = rope_inv_freq(self.config).double()
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float64,
                           device="cpu")
        freqs = torch.outer(pos, inv_freq)  # [max_pos, D/2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.cos_sin = table.to(device=w.device, dtype=w.dtype)

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """kv: [num_layers, 2, num_blocks, block_size, Hkv, D]; layer l reads kv[l, 0/1]."""
        c = self.config
        if kv.dim() != 6 or kv.shape[0] != c.num_layers or kv.shape[1] != 2 \
                or tuple(kv.shape[4:]) != (c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"KV pool has shape {tuple(kv.shape)}; this model needs [{c.num_layers}, 2, "
                f"num_blocks, block_size, {c.num_kv_heads}, {c.head_dim}]")
        fp8 = kv.dtype == FP8_DTYPE
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            a.k_cache = kv[i, 0]
            a.v_cache = kv[i, 1]
            a.kv_scales = None
            if fp8:  # the checkpoint's scales (one host sync per layer, once), else 1.0
                a.kv_scales = tuple(1.0 if x is None else float(x) for x in (a.k_scale, a.v_scale))
        self._cpu_plan = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, H]."""
        if input_ids.is_cuda and self.fused_ops:
            return self._forward_fused(input_ids, positions)
        if self._cpu_kernels_apply(input_ids):
            return self._forward_cpu(input_ids, positions)
        h = self.model.embed_tokens(input_ids)  # [T, H], a fresh tensor: safe to update in place
        half = self.config.head_dim // 2
        cs = self.cos_sin[positions].unsqueeze(1)  # [T, 1, D]
        cos, sin = cs[..., :half], cs[..., half:]
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.model.norm(h)

    # ---- float32 CPU: the C row-wise ops (kernels/csrc/paged_decode.c) ---------------------

    def _cpu_kernels_apply(self, input_ids: torch.Tensor) -> bool:
        if not self.cpu_kernels or input_ids.device.type != "cpu" or torch.is_grad_enabled() \
                or self.quantization == "fp8":
            return False
        w = self.model.embed_tokens.weight
        a = self.model.layers[0].self_attn
        return (w.dtype == torch.float32 and type(a.attn_backend) is AttentionBackend
                and a.k_cache is not None and a.k_cache.dtype == torch.float32
                and a.k_cache.is_contiguous() and cpu_decode.load() is not None)

    def _plan(self) -> list[tuple]:
        """Per layer, what _forward_cpu reads (looked up once, not per step)."""
        if self._cpu_plan is None:
            def lin(m: Linear | QuantLinear) -> tuple | QuantLinear:
                return m if isinstance(m, QuantLinear) else (m.packed, m.weight, m.bias)

            plan = []
            for layer in self.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                plan.append((a, lin(a.qkv_proj), lin(a.o_proj), lin(mlp.gate_up_proj),
                             lin(mlp.down_proj), layer.post_attention_layernorm))
            self._cpu_plan = plan
        return self._cpu_plan

    def _forward_cpu(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward above with the row-wise work in C: the residual add fused into each
        RMSNorm, q and k rotated and k, v written to the pool in one pass, SiLU-and-mul in
        one pass; the GEMMs stay on the packed sgemm (oneDNN or MKL) and attention on the backend. Same
        operations in the same order per element (rounding included) as the torch path,
        except the reductions' summation order and SiLU's exp (within 2 ulp)."""
        if self._threads_set_for != threading.get_ident():
            _apply_cpu_threads()
            self._threads_set_for = threading.get_ident()
        meta = get_forward_context()
        c, m = self.config, self.model
        t = input_ids.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q_size = hq * d
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        res = m.embed_tokens(input_ids)  # [T, H], fresh: updated in place below
        x = torch.empty_like(res)
        first = m.layers[0].input_layernorm
        cpu_decode.rms_norm(res, None, first.weight, first.eps, x)
        act = None
        plan = self._plan()
        last = len(plan) - 1
        for i, (a, qkv_l, o_l, gu_l, down_l, norm2) in enumerate(plan):
            qkv = _linear(x, qkv_l)
            cpu_decode.rope_write_kv(qkv, positions, self.cos_sin, hq, hkv, d, a.k_cache,
                                     a.v_cache, slots)
            q = qkv[:, :q_size].view(t, hq, d)
            o = a.attn_backend.attend(q, a.k_cache, a.v_cache, meta, a.scale)
            cpu_decode.rms_norm(res, _linear(o.view(t, q_size), o_l), norm2.weight, norm2.eps, x)
            gu = _linear(x, gu_l)
            if act is None:
                act = torch.empty(t, gu.shape[1] // 2)
            cpu_decode.silu_mul(gu, act)
            nxt = m.norm if i == last else m.layers[i + 1].input_layernorm
            cpu_decode.rms_norm(res, _linear(act, down_l), nxt.weight, nxt.eps, x)
        return x

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The same computation with kernels/triton_ops (CUDA): residual add fused into each
        RMSNorm, q and k rotated in one kernel, SiLU-and-mul in one kernel (fewer launches
        and passes over [T, H]; the CPU path above is unchanged).

        It is written as stages split at each layer's attention, the only step that mixes
        rows of different sequences: stage_first, then for each layer attention and
        stage_between (stage_last after the last layer). Piecewise CUDA graphs
        (kernels/cuda_graphs.PiecewiseGraphs) capture the stages at padded token counts and
        run the attention eagerly between them."""
        res, q, k, v = self.stage_first(input_ids, positions)
        last = len(self.model.layers) - 1
        for i in range(last + 1):
            o = self.attention(i, q, k, v)
            if i < last:
                res, q, k, v = self.stage_between(i, o, res, positions)
        return self.stage_last(o, res)

    # ---- the fused forward's stages (rows independent: padding rows stay harmless) ---------

    def stage_first(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """ids, positions [T] -> (residual [T, H], q [T, Hq, D], k, v [T, Hkv, D]) of layer 0."""
        m = self.model
        res = m.embed_tokens(input_ids)  # residual stream [T, H]
        layer = m.layers[0]
        x, _ = _norm_into(layer.self_attn.qkv_proj, res, layer.input_layernorm)
        q, k, v = self._qkv(0, x, positions)
        return res, q, k, v

    def attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer i's paged attention (writes k, v into the pool) -> o [T, Hq, D]."""
        return self.model.layers[i].self_attn.attend(q, k, v)

    def stage_between(self, i: int, o: torch.Tensor, res: torch.Tensor, positions: torch.Tensor):
        """Layer i after its attention, then layer i+1 up to its attention -> (res, q, k, v)."""
        delta, res = self._post_attention(i, o, res)
        layer = self.model.layers[i + 1]
        x, res = _norm_into(layer.self_attn.qkv_proj, delta, layer.input_layernorm, res)
        q, k, v = self._qkv(i + 1, x, positions)
        return res, q, k, v

    def stage_last(self, o: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """The last layer after its attention, then the final norm -> hidden [T, H]."""
        m = self.model
        delta, res = self._post_attention(len(m.layers) - 1, o, res)
        h, _ = rms_norm(delta, m.norm.weight, m.norm.eps, residual=res)
        return h

    def _qkv(self, i: int, x, positions: torch.Tensor):
        a = self.model.layers[i].self_attn
        qkv = a.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        t = qkv.shape[0]
        q = qkv[:, : a.q_size].view(t, a.num_heads, a.head_dim)
        k = qkv[:, a.q_size: a.q_size + a.kv_size].view(t, a.num_kv_heads, a.head_dim)
        v = qkv[:, a.q_size + a.kv_size:].view(t, a.num_kv_heads, a.head_dim)
        q, k = apply_rotary(q, k, positions, self.cos_sin)
        return q, k, v

    def _post_attention(self, i: int, o: torch.Tensor, res: torch.Tensor):
        """o_proj, residual + RMSNorm, MLP -> (the MLP's output, the residual stream)."""
        layer = self.model.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        x, res = _norm_into(mlp.gate_up_proj, a.o_proj(o.reshape(o.shape[0], a.q_size)),
                            layer.post_attention_layernorm, res)
        gu = mlp.gate_up_proj(x)
        down = mlp.down_proj
        act = (silu_and_mul_quant(gu, down.input_scale) if isinstance(down, Fp8Linear)
               else silu_and_mul(gu))
        return down(act), res

    def pack_cpu_weights(self) -> bool:
        """Switches every projection (and the LM head) of a float32 CPU model to the packed
        sgemm (cpu_gemm_backend); the original weights stay for the embedding lookup and for autograd. Returns
        False (and changes nothing) where packing does not apply."""
        w = self.model.embed_tokens.weight
        if self.quantization in cpu_quant.CPU_MODES or not pack_linear_weights(self, w):
            return False
        self._cpu_plan = None
        self._lm_head_packed = pack_weight(w if self.lm_head is None else self.lm_head.weight)
        return True

    def use_gemv(self, mode: str = "auto") -> dict:
        """CUDA, bf16 / fp16 weights: one-row products (a decode step of one sequence) by the
        Triton GEMV of kernels/triton_gemv instead of cuBLAS. "auto" times both per weight
        shape (every layer's copy rotating, so that L2 does not hold them) and keeps the GEMV
        only where it is faster; "on" uses it for every shape; "off" never. Returns per shape
        ("NxK") the choice and the measured microseconds, for the start-up log."""
        if mode not in GEMV_MODES:
            raise ValueError(f"gemv mode {mode!r}; expected one of {GEMV_MODES}")
        w0 = self.model.embed_tokens.weight
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.bias is None]
        for m in linears:
            m.gemv = None
        self._lm_head_gemv = None
        if mode == "off" or not w0.is_cuda or w0.dtype not in (torch.bfloat16, torch.float16):
            return {}
        from bucketserve.kernels import triton_gemv

        head = w0 if self.lm_head is None else self.lm_head.weight
        groups: dict[tuple[int, int], list] = {}
        for m in linears:
            if m is not self.lm_head:
                groups.setdefault(tuple(m.weight.shape), []).append(m)
        info: dict[str, dict] = {}
        for shape, mods in [*groups.items(), (tuple(head.shape), None)]:
            weights = [m.weight for m in mods] if mods is not None else [head]
            if mode == "on":
                cfg, row = triton_gemv.DEFAULT_CONFIG, {"forced": True}
            else:
                try:
                    cfg, row = triton_gemv.choose(weights)
                except Exception as e:  # noqa: BLE001 - e.g. a GPU Triton cannot compile for
                    log.warning("GEMV measurement failed for %s weights (%r); cuBLAS", shape, e)
                    cfg, row = None, {"error": repr(e)[:200]}
            row["choice"] = "gemv" if cfg is not None else "cublas"
            info[f"{shape[0]}x{shape[1]}" + ("" if mods is not None else " (lm_head)")] = row
            if mods is None:
                self._lm_head_gemv = cfg
            else:
                for m in mods:
                    m.gemv = cfg
        return info

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (only the rows passed in are projected)."""
        if self.lm_head_quant is not None:
            return self.lm_head_quant(hidden)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._lm_head_gemv is not None and hidden.shape[0] == 1:
            return _gemv(hidden, w, self._lm_head_gemv).float()
        if self._lm_head_packed is not None and not torch.is_grad_enabled():
            return packed_linear(hidden.contiguous(), self._lm_head_packed, w, None)
        logits = F.linear(hidden, w)
        return logits if logits.dtype == torch.float32 else logits.float()
