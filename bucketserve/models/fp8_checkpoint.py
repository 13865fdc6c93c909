"""Pre-quantized FP8 checkpoints: a Hugging Face directory whose config.json carries an FP8
`quantization_config`, in either of the two formats users have:

- compressed-tensors (`quant_method: "compressed-tensors"`, what llmcompressor writes): format
  "float-quantized" or "naive-quantized", weights `type: float, num_bits: 8`, strategy channel,
  tensor or block; activations dynamic or static per tensor (`input_scale`); optional
  `kv_cache_scheme` (`k_scale`, `v_scale`);
- plain fp8 (`quant_method: "fp8"`, Qwen3-FP8, DeepSeek): `weight_block_size: [b0, b1]` with
  `weight_scale_inv` per block, else a per-tensor `weight_scale`; `activation_scheme` dynamic or
  static (`input_scale`).

Both become one set of tensors, the contract the model consumes. For a quantized projection with
Hugging Face prefix P (before q/k/v and gate/up are fused):

  P.weight        float8_e4m3fn [out, in]
  P.weight_scale  float32 [out] (per channel; per-tensor scales are expanded), or
                  [ceil(out/b0), ceil(in/b1)] when config.fp8_weight_block = (b0, b1)
  P.input_scale   float32 scalar, only with config.fp8_activation_scheme == "static"
  model.layers.N.self_attn.k_scale / v_scale   float32 scalars, when config.fp8_kv_scales

Which projections are quantized is read from the tensors (a weight with a scale), not from the
config's target patterns, so every target syntax and `ignore` list agrees with what is stored.
The LM head and the embeddings are never FP8 here: an FP8 lm_head is dequantized on load (its
logits decide every sampled token).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from bucketserve.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_channel
from bucketserve.models.config import ModelConfig, UnsupportedModelError

log = logging.getLogger(__name__)

_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_WEIGHT_STRATEGIES = ("channel", "tensor", "block")
# Other spellings of the KV scales: the k/v projections' output scales (AutoFP8, early
# llmcompressor), ModelOpt's names, and one deprecated kv_scale for both.
_KV_ALIASES = {"self_attn.k_proj.output_scale": ("self_attn.k_scale",),
               "self_attn.v_proj.output_scale": ("self_attn.v_scale",),
               "self_attn.k_proj.k_scale": ("self_attn.k_scale",),
               "self_attn.v_proj.v_scale": ("self_attn.v_scale",),
               "self_attn.kv_scale": ("self_attn.k_scale", "self_attn.v_scale")}


@dataclass(frozen=True)
class Fp8Format:
    """What a checkpoint's quantization_config declares."""
    method: str  # "compressed-tensors" or "fp8"
    activation_scheme: str  # "dynamic" or "static"
    block: tuple[int, int] | None  # block shape of block-wise weight scales
    kv_scales: bool  # the config declares KV-cache scales (compressed-tensors only)


def parse_quantization_config(qc: dict[str, Any]) -> Fp8Format:
    """config.json's quantization_config -> Fp8Format; UnsupportedModelError (one line, saying
    what is supported) for anything that is not FP8 e4m3 in a layout this package loads."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "fp8":
        return _parse_fp8(qc)
    raise UnsupportedModelError(
        f"quantization_config quant_method {method or None!r} is not supported; pre-quantized "
        "checkpoints load in FP8 only: 'compressed-tensors' (float8 weights) or 'fp8'")


def _parse_fp8(qc: dict[str, Any]) -> Fp8Format:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise UnsupportedModelError(
            f"fp8 checkpoint with fmt {fmt!r} is not supported; only e4m3 (float8_e4m3fn)")
    if str(qc.get("scale_fmt", "float")).lower() not in ("float", "ue8m0"):
        raise UnsupportedModelError(f"fp8 scale_fmt {qc['scale_fmt']!r} is not supported; "
                                    "supported: float, ue8m0")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise UnsupportedModelError(
            f"fp8 activation_scheme {scheme!r} is not supported; supported: dynamic, static")
    block = qc.get("weight_block_size")
    return Fp8Format("fp8", scheme, _block_shape(block) if block else None, False)


def _parse_compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedModelError(
            f"compressed-tensors quantization_status {status!r} is not supported: the weights "
            "are not stored in FP8; save the model compressed (quantization_status 'compressed')")
    if qc.get("transform_config"):
        raise UnsupportedModelError("compressed-tensors transform_config (rotated weights) is "
                                    "not supported; only plain FP8 weights load")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise UnsupportedModelError(
            f"compressed-tensors sparsity format {sparsity['format']!r} is not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedModelError("compressed-tensors quantization_config has no config_groups")
    schemes, blocks = set(), set()
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise UnsupportedModelError(
                f"compressed-tensors format {fmt!r} (group {name!r}) is not supported; only FP8 "
                f"weights load: {', '.join(_CT_FORMATS)}")
        weights = group.get("weights") or {}
        _check_float8(weights, f"group {name!r} weights")
        strategy = weights.get("strategy")
        if strategy not in _CT_WEIGHT_STRATEGIES or weights.get("dynamic"):
            raise UnsupportedModelError(
                f"compressed-tensors group {name!r}: weight strategy {strategy!r} "
                f"(dynamic={weights.get('dynamic')}) is not supported; supported: static "
                f"{', '.join(_CT_WEIGHT_STRATEGIES)}")
        if strategy == "block":
            blocks.add(_block_shape(weights.get("block_structure")))
        if group.get("output_activations"):
            raise UnsupportedModelError(f"compressed-tensors group {name!r}: quantized output "
                                        "activations are not supported")
        schemes.add(_ct_activation_scheme(group.get("input_activations"), name))
    if len(schemes) > 1 or len(blocks) > 1:
        raise UnsupportedModelError(
            "compressed-tensors config_groups mix activation schemes or block shapes "
            f"({sorted(schemes)}, {sorted(blocks)}); one of each is supported")
    kv = qc.get("kv_cache_scheme")
    if kv:
        _check_float8(kv, "kv_cache_scheme")
        if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic"):
            raise UnsupportedModelError(
                f"compressed-tensors kv_cache_scheme strategy {kv.get('strategy')!r} "
                f"(dynamic={kv.get('dynamic')}) is not supported; only static per-tensor scales")
    return Fp8Format("compressed-tensors", schemes.pop(), blocks.pop() if blocks else None,
                     bool(kv))


def _check_float8(args: dict[str, Any], what: str) -> None:
    kind, bits = args.get("type"), args.get("num_bits")
    if kind != "float" or bits != 8:
        raise UnsupportedModelError(
            f"compressed-tensors {what} are type {kind!r} with {bits} bits; only FP8 (type "
            "'float', num_bits 8, float8_e4m3fn) is supported")
    if not args.get("symmetric", True):
        raise UnsupportedModelError(f"compressed-tensors {what}: asymmetric FP8 (zero points) "
                                    "is not supported")


def _ct_activation_scheme(args: dict[str, Any] | None, group: str) -> str:
    if not args:  # weight-only (W8A16): the engine quantizes activations dynamically
        return "dynamic"
    _check_float8(args, f"group {group!r} input_activations")
    if args.get("dynamic"):  # per token or per tensor, computed at run time
        return "dynamic"
    if args.get("strategy") != "tensor":
        raise UnsupportedModelError(
            f"compressed-tensors group {group!r}: static input activations with strategy "
            f"{args.get('strategy')!r} are not supported; only per tensor")
    return "static"


def _block_shape(value: Any) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise UnsupportedModelError(f"FP8 block shape {value!r} is not two positive integers")
    return int(value[0]), int(value[1])


def apply_fp8_checkpoint(config: ModelConfig, qc: dict[str, Any],
                         tensors: dict[str, torch.Tensor],
                         linears: dict[str, tuple[str, ...]]) -> ModelConfig:
    """Rewrites `tensors` (HF names, in place) into the contract of the module docstring and
    returns `config` with the FP8 fields set. `linears`: this package's decoder projections ->
    the HF prefixes fused into each (loader.linear_parts)."""
    fmt = parse_quantization_config(qc)
    if "lm_head.weight_scale" in tensors or "lm_head.weight_scale_inv" in tensors:
        _dequantize_lm_head(tensors, fmt)
    for old, names in _KV_ALIASES.items():
        for key in [k for k in tensors if k.endswith(old)]:
            scale = tensors.pop(key)
            for new in names:
                tensors[key.removesuffix(old) + new] = scale
    for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
        tensors[key.removesuffix("_inv")] = tensors.pop(key)

    ignored, quantized = [], {}
    for name, parts in linears.items():
        has_scale = [p + ".weight_scale" in tensors for p in parts]
        if not any(has_scale):
            for p in parts:
                if tensors.get(p + ".weight", torch.empty(0)).dtype == FP8_DTYPE:
                    raise UnsupportedModelError(f"{p}.weight is FP8 but has no weight_scale")
            ignored.append(name)
        elif not all(has_scale):
            raise UnsupportedModelError(
                f"{name} fuses {', '.join(parts)}, of which only some are quantized; FP8 "
                "checkpoints must quantize all or none of them")
        else:
            quantized[name] = parts
    if not quantized:
        raise UnsupportedModelError("the checkpoint declares FP8 quantization but no projection "
                                    "has a weight_scale")

    layouts = {_normalize_linear(tensors, p, fmt) for parts in quantized.values() for p in parts}
    block = fmt.block if layouts == {"block"} else None
    if block is not None and not all(_rows_aligned(tensors, parts, block[0])
                                     for parts in quantized.values()):
        log.info("FP8 checkpoint: fused projections do not end on %d-row blocks; block-wise "
                 "weights are requantized per output channel", block[0])
        block = None
    if block is None and "block" in layouts:
        for parts in quantized.values():
            for p in parts:
                _requantize_per_channel(tensors, p, fmt.block)

    kv_scales = _normalize_kv_scales(tensors, config.num_layers)
    if fmt.kv_scales and not kv_scales:
        raise UnsupportedModelError("the checkpoint's kv_cache_scheme declares KV scales but no "
                                    "layer stores self_attn.k_scale / v_scale")
    return dataclasses.replace(
        config, quantization="fp8", fp8_weight_block=block,
        fp8_activation_scheme=fmt.activation_scheme, fp8_ignored=tuple(ignored),
        fp8_kv_scales=kv_scales)


def _normalize_linear(tensors: dict[str, torch.Tensor], p: str, fmt: Fp8Format) -> str:
    """One HF projection's tensors -> the contract; returns its scale layout ("channel" after a
    per-tensor scale is expanded, or "block")."""
    weight = tensors.get(p + ".weight")
    if weight is None or weight.dtype != FP8_DTYPE:
        raise UnsupportedModelError(
            f"{p}.weight is {None if weight is None else weight.dtype}; FP8 checkpoints must "
            "store float8_e4m3fn weights (e5m2 and other formats are not supported)")
    for zp in (p + ".weight_zero_point", p + ".input_zero_point"):
        if zp in tensors and tensors.pop(zp).any():
            raise UnsupportedModelError(f"{zp} is not zero; asymmetric FP8 is not supported")
    out, inp = weight.shape
    scale = tensors[p + ".weight_scale"].float()
    if scale.numel() == 1:
        scale, layout = scale.reshape(()).expand(out).contiguous(), "channel"
    elif scale.shape in ((out,), (out, 1)):
        scale, layout = scale.reshape(out), "channel"
    elif fmt.block is not None and scale.shape == (math.ceil(out / fmt.block[0]),
                                                   math.ceil(inp / fmt.block[1])):
        layout = "block"
    else:
        raise UnsupportedModelError(
            f"{p}.weight_scale has shape {tuple(scale.shape)}, which is neither per tensor, per "
            f"channel ({out}) nor {fmt.block} blocks of a {out}x{inp} weight")
    tensors[p + ".weight_scale"] = scale
    input_scale = tensors.pop(p + ".input_scale", None)
    if fmt.activation_scheme == "static":
        if input_scale is None or input_scale.numel() != 1:
            raise UnsupportedModelError(
                f"{p}.input_scale is missing or not one value; static FP8 activations need a "
                "per-tensor input_scale for every quantized projection")
        tensors[p + ".input_scale"] = input_scale.float().reshape(())
    return layout


def _dequantize_lm_head(tensors: dict[str, torch.Tensor], fmt: Fp8Format) -> None:
    """An FP8 lm_head -> its float32 weight (the loader casts it to the model dtype)."""
    scale = tensors.pop("lm_head.weight_scale", None)
    if scale is None:
        scale = tensors.pop("lm_head.weight_scale_inv")
    weight = tensors["lm_head.weight"]
    if weight.dtype != FP8_DTYPE:
        raise UnsupportedModelError(f"lm_head.weight is {weight.dtype} with a weight_scale; "
                                    "FP8 checkpoints must store float8_e4m3fn weights")
    tensors["lm_head.weight"] = dequantize_fp8(weight, scale, fmt.block or (128, 128))
    tensors.pop("lm_head.input_scale", None)


def _rows_aligned(tensors: dict[str, torch.Tensor], parts: tuple[str, ...], rows: int) -> bool:
    """Whether concatenating the parts' block scales keeps every block inside one part: all
    but the last part must have a multiple of `rows` rows."""
    return all(tensors[p + ".weight"].shape[0] % rows == 0 for p in parts[:-1])


def _requantize_per_channel(tensors: dict[str, torch.Tensor], p: str,
                            block: tuple[int, int] | None) -> None:
    scale = tensors[p + ".weight_scale"]
    if scale.dim() == 2:
        q, s = quantize_fp8_per_channel(dequantize_fp8(tensors[p + ".weight"], scale, block))
        tensors[p + ".weight"], tensors[p + ".weight_scale"] = q, s


def _normalize_kv_scales(tensors: dict[str, torch.Tensor], num_layers: int) -> bool:
    keys = [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(num_layers) for kv in "kv"]
    present = [k in tensors for k in keys]
    if any(present) and not all(present):
        missing = keys[present.index(False)]
        raise UnsupportedModelError(f"KV scales are stored for some layers but not {missing}")
    for key in keys if all(present) else ():
        if tensors[key].numel() != 1:
            raise UnsupportedModelError(f"{key} has {tensors[key].numel()} values; only "
                                        "per-tensor KV scales are supported")
        tensors[key] = tensors[key].float().reshape(())
    return all(present)


def fuse_fp8_linear(name: str, parts: tuple[str, ...], tensors: dict[str, torch.Tensor],
                    block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Pops the contract tensors of `parts` (HF prefixes) and returns them fused under `name`:
    weights and scales concatenated along rows (block scales too: apply_fp8_checkpoint keeps
    blocks only where every part but the last fills whole row blocks), the input scale the
    largest of the parts' (they all quantize the same input)."""
    weights = [tensors.pop(p + ".weight") for p in parts]
    scales = [tensors.pop(p + ".weight_scale") for p in parts]
    if block is not None:
        assert all(w.shape[0] % block[0] == 0 for w in weights[:-1]), name
    out = {name + ".weight": weights[0] if len(parts) == 1 else torch.cat(weights),
           name + ".weight_scale": scales[0] if len(parts) == 1 else torch.cat(scales)}
    inputs = [tensors.pop(p + ".input_scale") for p in parts if p + ".input_scale" in tensors]
    if inputs:
        out[name + ".input_scale"] = torch.stack(inputs).amax()
    return out
