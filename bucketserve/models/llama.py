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

import dataclasses
import logging
import math
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.buckets.config import GEMV_MODES
from bucketserve.kernels import cpu_decode, cpu_quant, fp8_ops
from bucketserve.kernels.attention import AttentionBackend, get_forward_context
from bucketserve.kernels.cpu_plan import (
    CpuPlan,
    default_cpu_plan,
    pack_weight,
    packed_linear,
    with_measured_gemm,
)
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


def packed_gemm_backend() -> str | None:
    """The packed GEMM of models packed without a plan (the BERT encoders):
    kernels/cpu_plan.default_cpu_plan()'s, "onednn", "mkl" or None."""
    return default_cpu_plan().gemm


def pack_linear_weights(module: nn.Module, weight: torch.Tensor,
                        plan: CpuPlan | None = None) -> CpuPlan | None:
    """Gives every Linear inside `module` a packed copy of its weight for the plan's GEMM
    (kernels/cpu_plan.py; None: default_cpu_plan()), when `weight` (one of the model's
    parameters) is float32 on CPU and the plan has a packed GEMM; the original weights stay
    (autograd, unpacked paths). A plan whose gemm is "auto" is measured on the module's
    largest projection first. Returns the plan used, or None, changing nothing, where packing
    does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    linears = [sub for sub in module.modules() if isinstance(sub, Linear)]
    plan = plan or default_cpu_plan()
    if plan.gemm is None or not linears:
        return None
    plan = with_measured_gemm(plan, max((m.weight for m in linears), key=lambda w: w.numel()))
    for sub in linears:
        sub.gemm, sub.packed = plan.gemm, pack_weight(plan.gemm, sub.weight)
    return plan


def _gemv(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    from bucketserve.kernels.triton_gemv import gemv

    return gemv(x.contiguous(), weight, config=config)



def _linear(x: torch.Tensor, lin: tuple) -> torch.Tensor:
    """(gemm, packed, weight, bias) of a Linear, or a QuantLinear, applied to x [T, in] (no
    module call overhead)."""
    if isinstance(lin, QuantLinear):
        return lin(x)
    gemm, packed, weight, bias = lin
    if packed is None:
        return F.linear(x, weight, bias)
    return packed_linear(gemm, x, packed, weight, bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        # set by pack_linear_weights: the packed weight and its GEMM ("onednn" | "mkl")
        self.packed: torch.Tensor | None = None
        self.gemm: str | None = None
        # CUDA: the Triton GEMV config for one-row inputs (kernels/triton_gemv), set by
        # LlamaForCausalLM.use_gemv where it measured faster than cuBLAS; None: F.linear
        self.gemv: tuple[int, int, int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] == 1:  # set only on bias-free projections
            return _gemv(x, self.weight, self.gemv)
        if self.packed is not None and not torch.is_grad_enabled():
            return packed_linear(self.gemm, x, self.packed, self.weight, self.bias)
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
        # CUDA: the kernels/triton_gemv.gemv_fp8 config for one-row inputs, set by
        # LlamaForCausalLM.use_gemv where it measured faster than torch._scaled_mm
        self.gemv: tuple[int, int, int, int] | None = None
        # CUDA: rows_fp8 configs for 2..64 rows per row band (triton_gemv.row_band), set the
        # same way; a band without one (None) stays on torch._scaled_mm
        self.rows: dict[int, tuple | None] | None = None
        # CUDA: kernels/triton_fp8_gemm.fp8_mm configs for more than 64 rows per row band
        # (triton_fp8_gemm.band), set the same way; a band without one stays on _scaled_mm
        self.tiles: dict[int, tuple | None] | None = None
        # CUDA: the row bands (triton_fp8_gemm.band) of more than 64 rows where forward(x,
        # defer=True) returns the product with its scales deferred to the reader
        # (fp8_ops.fp8_linear_deferred), set by use_gemv where measured faster; `unit` is
        # the float32 1.0 its per-tensor GEMM takes as both scales
        self.deferred: frozenset[int] = frozenset()
        self.unit: torch.Tensor | None = None

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

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                defer: bool = False) -> torch.Tensor | fp8_ops.Deferred:
        """defer: the caller reads the result with a reader that takes fp8_ops.Deferred
        (rms_norm_quant, silu_and_mul_quant); it gets one where this row band's deferred
        product was measured faster, else the tensor as without it."""
        if isinstance(x, torch.Tensor):
            x = quantize_rows(x, self.input_scale)
        m = x[0].shape[0]
        if defer and m > 64 and self.deferred:
            from bucketserve.kernels import triton_fp8_gemm

            if triton_fp8_gemm.band(m) in self.deferred:
                return fp8_ops.fp8_linear_deferred(x, self.weight, self.weight_scale,
                                                   self.unit, self.out_dtype)
        if self.gemv is not None and m == 1:  # set only on bias-free projections
            from bucketserve.kernels.triton_gemv import gemv_fp8

            return gemv_fp8(x[0], x[1], self.weight, self.weight_scale, self.out_dtype,
                            config=self.gemv)
        if self.rows is not None and 1 < m <= 64:  # (also bias-free only)
            from bucketserve.kernels.triton_gemv import row_band, rows_fp8

            cfg = self.rows.get(row_band(m))
            if cfg is not None:
                return rows_fp8(x[0], x[1], self.weight, self.weight_scale, self.out_dtype,
                                config=cfg)
        if self.tiles is not None and m > 64:  # (also bias-free only)
            from bucketserve.kernels import triton_fp8_gemm

            cfg = self.tiles.get(triton_fp8_gemm.band(m))
            if cfg is not None:
                return triton_fp8_gemm.fp8_mm(x[0], x[1], self.weight, self.weight_scale, cfg,
                                              promote=not fp8_ops.FAST_ACCUM,
                                              out_dtype=self.out_dtype)
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
    return rms_norm(fp8_ops.apply_scales(x), norm.weight, norm.eps, residual=residual)


def _project(proj: nn.Module, x, defer: bool):
    """proj(x), asking an Fp8Linear for a Deferred product where `defer` (the reader applies
    the scales)."""
    return proj(x, defer=True) if defer and isinstance(proj, Fp8Linear) else proj(x)


def _by_band(chosen: dict[int, tuple[dict, object]]) -> tuple[dict, dict]:
    """A per-row-band start-up measurement, {band: (info, choice)} -> ({band: choice},
    {"bands": {band: info}}) for use_gemv's choice and its log row."""
    return ({b: c for b, (_, c) in chosen.items()},
            {"bands": {b: info for b, (info, _) in chosen.items()}})


def _measured(mode: str, forced, measure, what: str, shape: tuple[int, int]) -> tuple:
    """use_gemv's choice for one weight shape: `forced` with mode "on", else `measure()`
    ((choice, info)); a measurement that raises (e.g. a GPU Triton cannot compile for)
    keeps the library's path: (None, {"error": ...})."""
    if mode == "on":
        return forced, {"forced": True}
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - the library's path stays
        log.warning("%s measurement failed for %s weights (%r); the library's path stays",
                    what, shape, e)
        return None, {"error": repr(e)[:200]}


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H] (final norm applied); call it
    inside kernels.attention.forward_context(meta) after bind_kv_cache(kv).

    Constructed directly, the parameters are uninitialised: use loader.load_model or
    loader.build_dummy_model to get weights. quantization "fp8": the FP8_PROJECTIONS are
    Fp8Linear (state dict: quantize_state_dict_fp8's form); "q4_1" / "int8" (CPU): they are
    QuantLinear, and the loader may set lm_head_quant (q4_1: a QuantLinear for the logits;
    int8 keeps the float32 head)."""

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
        self._lm_head_packed: torch.Tensor | None = None  # see use_cpu_plan
        self.lm_head_quant: QuantLinear | None = None  # the logits' QuantLinear (CPU modes)
        self.cpu: CpuPlan | None = None  # the CPU plan in use (use_cpu_plan)
        self._lm_head_gemv: tuple[int, int, int, int] | None = None  # see use_gemv
        self._cpu_plan: list[tuple] | None = None  # see _forward_cpu
        self._threads_set_for: int | None = None  # the thread the plan's threads were set in
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
                return m if isinstance(m, QuantLinear) else (m.gemm, m.packed, m.weight, m.bias)

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
            # torch's thread count (OpenMP's) is per thread: set in the thread that runs the
            # model (the engine's), on its first forward there
            if self.cpu is not None and self.cpu.threads:
                torch.set_num_threads(self.cpu.threads)
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
        delta, res = self._post_attention(len(m.layers) - 1, o, res, last=True)
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

    def _post_attention(self, i: int, o: torch.Tensor, res: torch.Tensor, last: bool = False):
        """o_proj, residual + RMSNorm, MLP -> (the MLP's output, the residual stream). FP8
        projections may return their products Deferred (Fp8Linear.forward) where the op that
        reads them applies the scales: o_proj's and gate_up's into the fused norm and
        SiLU-and-mul, down's into the next layer's norm (not the last layer's: the final
        plain RMSNorm reads it)."""
        layer = self.model.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        x, res = _norm_into(gate_up, _project(a.o_proj, o.reshape(o.shape[0], a.q_size),
                                              isinstance(gate_up, Fp8Linear)),
                            layer.post_attention_layernorm, res)
        if isinstance(down, Fp8Linear):
            act = silu_and_mul_quant(_project(gate_up, x, True), down.input_scale)
        else:
            act = silu_and_mul(fp8_ops.apply_scales(gate_up(x)))
        return _project(down, act, not last), res

    def use_cpu_plan(self, plan: CpuPlan) -> CpuPlan:
        """Runs a float32 CPU model as `plan` says (kernels/cpu_plan.py): every projection and
        the LM head on its packed sgemm (measured on the largest projection where the plan's
        gemm is "auto"; the original weights stay for the embedding lookup and for autograd),
        the C kernels of its build, prompt attention by its choice, its thread count. Returns
        the plan as applied (the GEMM decided; C kernels off where they do not build)."""
        built = cpu_decode.select(plan.march, plan.c_kernels)
        if plan.c_kernels and not built.get("enabled"):
            plan = dataclasses.replace(plan, c_kernels=False, prefill_attention="sdpa")
        self.attn_backend.c_prefill = plan.prefill_attention == "c"
        w = self.model.embed_tokens.weight
        head = w if self.lm_head is None else self.lm_head.weight
        self._lm_head_packed = None
        if self.quantization in cpu_quant.CPU_MODES:
            plan = dataclasses.replace(plan, gemm_how=f"{self.quantization} projections",
                                       quant_kernels=cpu_quant.describe_kernels(self.quantization))
            if self.lm_head_quant is not None or plan.gemm is None:
                plan = dataclasses.replace(plan, gemm=None)
            else:  # the float32 LM head (int8; q4_1 without Q4_1 / Q8_0 head blocks)
                plan = with_measured_gemm(plan, head)
                self._lm_head_packed = pack_weight(plan.gemm, head)
                plan = dataclasses.replace(plan, gemm_how=f"{self.quantization} projections; "
                                           f"float32 LM head packed for {plan.gemm}")
        elif (packed := pack_linear_weights(self, w, plan)) is None:
            plan = dataclasses.replace(plan, gemm=None, gemm_how="not a float32 CPU model")
        else:
            plan = packed
            self._lm_head_packed = pack_weight(plan.gemm, head)
        self._cpu_plan = None
        self._threads_set_for = None
        self.cpu = plan
        return plan

    def use_gemv(self, mode: str = "auto", max_rows: int | None = None) -> dict:
        """CUDA, bf16 / fp16 weights: one-row products (a decode step of one sequence) by the
        Triton GEMV of kernels/triton_gemv instead of cuBLAS. "auto" times both per weight
        shape (every layer's copy rotating, so that L2 does not hold them) and keeps the GEMV
        only where it is faster; "on" uses it for every shape; "off" never. FP8 projections
        (Fp8Linear) the same way: triton_gemv.gemv_fp8 against torch._scaled_mm of one row,
        rows_fp8 for 2..64 rows and triton_fp8_gemm.fp8_mm per row band above that, up to
        `max_rows` (the most tokens a step holds; default all bands).
        Returns per shape ("NxK", "NxK (fp8)") the choice and the measured microseconds, for
        the start-up log."""
        if mode not in GEMV_MODES:
            raise ValueError(f"gemv mode {mode!r}; expected one of {GEMV_MODES}")
        w0 = self.model.embed_tokens.weight
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.bias is None]
        fp8 = [m for m in self.modules() if isinstance(m, Fp8Linear) and m.bias is None]
        for m in linears + fp8:
            m.gemv = None
        for m in fp8:
            m.rows = m.tiles = None
            m.deferred, m.unit = frozenset(), None
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
            cfg, row = _measured(mode, triton_gemv.DEFAULT_CONFIG,
                                 lambda w=weights: triton_gemv.choose(w), "GEMV", shape)
            row["choice"] = "gemv" if cfg is not None else "cublas"
            info[f"{shape[0]}x{shape[1]}" + ("" if mods is not None else " (lm_head)")] = row
            if mods is None:
                self._lm_head_gemv = cfg
            else:
                for m in mods:
                    m.gemv = cfg
        fp8_groups: dict[tuple[int, int], list] = {}
        for m in fp8:
            fp8_groups.setdefault(tuple(m.weight.shape), []).append(m)
        for shape, mods in fp8_groups.items():
            ws, ss = [m.weight for m in mods], [m.weight_scale for m in mods]
            cfg, row = _measured(mode, triton_gemv.DEFAULT_CONFIG,
                                 lambda ws=ws, ss=ss: triton_gemv.choose_fp8(ws, ss), "FP8 GEMV",
                                 shape)
            row["choice"] = "gemv" if cfg is not None else "scaled_mm"
            info[f"{shape[0]}x{shape[1]} (fp8)"] = row
            for m in mods:
                m.gemv = cfg
            # 2..64 rows (small decode batches): rows_fp8 per row band, the same way

            def rows_measured(ws=ws, ss=ss) -> tuple[dict, dict]:
                return _by_band(triton_gemv.choose_fp8_rows(ws, ss))

            bands, brow = _measured(
                mode, {b: triton_gemv.ROW_CANDIDATES[0] for b in triton_gemv.ROW_BANDS},
                rows_measured, "FP8 few-row", shape)
            bands = bands or {}
            won = [b for b, c in bands.items() if c is not None]
            brow["choice"] = ("rows up to " + "/".join(map(str, won))) if won else "scaled_mm"
            info[f"{shape[0]}x{shape[1]} (fp8, 2..64 rows)"] = brow
            for m in mods:
                m.rows = bands if won else None
            # more than 64 rows (large decode batches, prefill and mixed steps): fp8_mm per
            # row band, an experiment until measured on a GPU (BUCKETSERVE_FP8_TILES=1); "on"
            # forces nothing here (the library's tiles stay the default)
            if mode == "on" or os.environ.get("BUCKETSERVE_FP8_TILES", "") != "1":
                continue
            from bucketserve.kernels import triton_fp8_gemm

            def tiles_measured(ws=ws, ss=ss) -> tuple[dict, dict]:
                return _by_band(triton_fp8_gemm.choose_fp8_tiles(
                    ws, ss, max_rows or triton_fp8_gemm.BANDS[-1]))

            tiles, trow = _measured(mode, None, tiles_measured, "FP8 tiles", shape)
            tiles = tiles or {}
            won = [b for b, c in tiles.items() if c is not None]
            trow["choice"] = ("tiles at " + "/".join(map(str, won))) if won else "scaled_mm"
            info[f"{shape[0]}x{shape[1]} (fp8, 65+ rows)"] = trow
            for m in mods:
                m.tiles = tiles if won else None
        # deferred scales for 65+ rows: an experiment until a GPU has run its tests and
        # measured it end to end (BUCKETSERVE_FP8_DEFER=1, docs/quantization.md)
        if os.environ.get("BUCKETSERVE_FP8_DEFER", "") == "1":  # ("off" returned above)
            info.update(self._use_deferred(max_rows))
        return info

    def _use_deferred(self, max_rows: int | None) -> dict:
        """use_gemv's choice for more than 64 rows of the FP8 projections whose readers take
        a Deferred product (o_proj, gate_up_proj, down_proj: _post_attention): per row band,
        the per-tensor GEMM with the scales deferred where measured at least 3% faster than
        _scaled_mm's row-wise one (triton_fp8_gemm.choose_deferred)."""
        from bucketserve.kernels import triton_fp8_gemm

        groups: dict[tuple[int, int], list[Fp8Linear]] = {}
        for layer in self.model.layers:
            for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                if isinstance(m, Fp8Linear) and m.bias is None:
                    groups.setdefault(tuple(m.weight.shape), []).append(m)
        info: dict[str, dict] = {}
        unit = None
        for shape, mods in groups.items():
            ws, ss = [m.weight for m in mods], [m.weight_scale for m in mods]

            def measured(ws=ws, ss=ss) -> tuple[frozenset, dict]:
                won, row = _by_band(triton_fp8_gemm.choose_deferred(
                    ws, ss, max_rows or triton_fp8_gemm.BANDS[-1]))
                return frozenset(b for b, w in won.items() if w), row

            bands, row = _measured("auto", None, measured, "FP8 deferred", shape)
            bands = bands or frozenset()
            row["choice"] = ("deferred at " + "/".join(map(str, sorted(bands)))) if bands \
                else "row-wise"
            info[f"{shape[0]}x{shape[1]} (fp8, 65+ rows, scales)"] = row
            if bands and unit is None:
                unit = torch.ones((), dtype=torch.float32, device=ws[0].device)
            for m in mods:
                m.deferred, m.unit = bands, unit
        return info

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (only the rows passed in are projected).
        `widen=False`: in the GEMM's own dtype (the engine's sampler widens the rows that need
        more than an argmax; an argmax of the narrow logits is the same)."""
        if self.lm_head_quant is not None:
            return self.lm_head_quant(hidden)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._lm_head_gemv is not None and hidden.shape[0] == 1:
            logits = _gemv(hidden, w, self._lm_head_gemv)
        elif self._lm_head_packed is not None and not torch.is_grad_enabled():
            return packed_linear(self.cpu.gemm, hidden.contiguous(), self._lm_head_packed, w,
                                 None)
        else:
            logits = F.linear(hidden, w)
        return logits if logits.dtype == torch.float32 or not widen else logits.float()
