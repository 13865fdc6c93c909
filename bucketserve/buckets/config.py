"""Loading and validating the bucket / batching TOML file.

The shipped `default.toml` holds every key with its documented default. A user file may set any
subset; each key it sets is validated on its own, then merged over the defaults, then the few
cross-key rules are checked. Every user mistake raises ConfigError, whose str() is a single line
"FILE: table.key: problem; expected ..." so it reads well in a log line or a CLI error.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the API-identical backport, if installed
    import tomli as tomllib  # type: ignore[no-redef]

from bucketserve.buckets.spec import BucketSpec

DEFAULT_NAME = "default.toml"


class ConfigError(ValueError):
    """A bad buckets file. str() is one line naming the file, the dotted key and the fix."""

    def __init__(self, source: str, key: str | None, problem: str) -> None:
        self.source = source
        self.key = key
        self.problem = _one_line(problem)
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(_one_line(where + self.problem))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _Bad(Exception):
    """Raised by a value validator with the problem text; the loader adds file and key."""


# ---------------------------------------------------------------------------- value validators
def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time"


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value).replace("'", '"')
    return text if len(text) <= 60 else text[:57] + "..."


def _got(value: Any) -> str:
    return f"got {_toml_type(value)} ({_show(value)})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML true is not 1


def _positive_int(value: Any) -> int:
    if not _is_int(value):
        raise _Bad(f"{_got(value)}; expected a positive integer")
    if value < 1:
        raise _Bad(f"got {value}; expected a positive integer (>= 1)")
    return value


# `max_batched_tokens = "auto"`: the step token budget by device. A GPU step of a few thousand
# tokens costs little more than a decode step (the weights are read once either way), so larger
# steps finish prompts in fewer steps; on CPU the step time grows with its tokens, and a smaller
# budget keeps decodes that share the step from stalling behind long prompts.
# On a GPU 16,384, vLLM's own budget there: with max_running "auto" (1,024) the prompts of a large
# offline batch prefill in fewer, larger steps (H200, Llama-3.1-8B shape, 1,024 requests: 12,726
# output tok/s with 16,384 tokens and 1,024 sequences against 11,320 with 8,192 and 256).
AUTO_STEP_TOKENS = {"cpu": 2048, "cuda": 16384}
# `max_running = "auto"`: the running set by device. On a GPU 1,024 (vLLM's default there): once
# a decode batch is bound by arithmetic its GEMMs still run faster per row as it grows (H200, 8B
# shape, cuBLAS: 611 TFLOP/s at 256 rows, 733 at 512 and 1,024), and more sequences at once leave
# fewer steps with a half-empty batch; the KV pool still bounds what is admitted. On the CPU 256:
# there a step's time grows with its batch, and more streams at once only stretch every stream's
# inter-token latency.
AUTO_MAX_RUNNING = {"cpu": 256, "cuda": 1024}
# `piecewise_sizes = "auto"`: captured token counts every 32 tokens from 128 to 1024. There a
# step is launch-bound (8B shape on an H200: an eager forward costs ~11 ms of host launches up
# to ~600 tokens, the graphs 4.5 ms at 16 tokens and 9.9 ms at 512), so the cost model replays
# the graphs and their padding is what the metrics count; with powers of two, a 1,024-request
# run padded 9% of its computed tokens (a mixed step of 256 decodes and a short prompt chunk
# rounded up to 512), at most 31 rows a step with this spacing. Above 1024 tokens eager runs
# cost about what the graphs do, so coarse sizes only serve the smaller models.
AUTO_PIECEWISE_STEP = 32
# `async_scheduling = "auto"` on the CPU (it is on for CUDA). Off: measured on the 2-core dev
# machine (bench/offline_throughput.py, mixed workload, ABBA runs) it gains nothing there (CPU
# ops run in the engine's thread, so nothing overlaps; CPU time per run within 1%), and a
# request that ends by EOS or a stop would cost one more decode row.
AUTO_ASYNC_CPU = False


# `[embedding] preferred_batch_size / max_batch_tokens = "auto"`: the encoder batch by device.
# On CPU a forward's time grows with its tokens, so batches of 32 already keep the cores busy.
# On a GPU (H200, all-MiniLM-L6-v2 fp16, 20,000 texts offline) batches of up to 64 ran 20.6k
# texts/s against 13.1k for 256: the host path, not the device, sets the pace there, and
# smaller batches fill (and dispatch) sooner; they also need fewer graphs at start-up.
AUTO_EMBEDDING_BATCH = {"cpu": 32, "cuda": 64}
AUTO_EMBEDDING_BATCH_TOKENS = {"cpu": 8192, "cuda": 16384}
# `max_merged_padding = "auto"`: 0.1 on CPU, where merging many small online batches into one
# pays for its padding; 0.05 on a GPU, where batches are cheap and a 20,000-text offline run
# (chunks of 1,024 texts arriving while the device works) padded 5.4% at 0.1, 4.0% at 0.05
# (queue simulation; 5.1% measured on the H200 at 0.1).
AUTO_EMBEDDING_MERGED_PADDING = {"cpu": 0.1, "cuda": 0.05}


def _closed_fraction_or_auto(value: Any) -> float | str:
    if value == "auto":
        return value
    if isinstance(value, str):
        raise _Bad(f'{_got(value)}; expected a number in [0, 1] or "auto"')
    return _closed_fraction(value)


def _positive_int_or_auto(value: Any) -> int | str:
    if value == "auto":
        return value
    if not _is_int(value):
        raise _Bad(f'{_got(value)}; expected a positive integer or "auto"')
    if value < 1:
        raise _Bad(f'got {value}; expected a positive integer (>= 1) or "auto"')
    return value


def _increasing_ints(value: Any) -> tuple[int, ...]:
    expected = "expected a non-empty array of strictly increasing positive integers, e.g. [16, 32, 64]"
    if not isinstance(value, list):
        raise _Bad(f"{_got(value)}; {expected}")
    if not value:
        raise _Bad(f"got an empty array; {expected}")
    for i, item in enumerate(value):
        if not _is_int(item):
            raise _Bad(f"element {i} is {_toml_type(item)} ({_show(item)}); {expected}")
        if item < 1:
            raise _Bad(f"element {i} is {item}; {expected}")
        if i and item <= value[i - 1]:
            raise _Bad(
                f"element {i} ({item}) is not larger than element {i - 1} ({value[i - 1]}); {expected}"
            )
    return tuple(value)


def _sizes_or_auto(value: Any) -> tuple[int, ...] | str:
    if value == "auto":
        return value
    if not isinstance(value, list):
        raise _Bad(f'{_got(value)}; expected "auto" or a non-empty array of strictly increasing '
                   "positive integers, e.g. [64, 256, 1024, 2048]")
    return _increasing_ints(value)


def _bool_or_auto(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise _Bad(f'{_got(value)}; expected true, false or "auto"')


def _number(value: Any, what: str) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise _Bad(f"{_got(value)}; expected {what}")
    if not math.isfinite(value):
        raise _Bad(f"got {value}; expected {what}")
    return float(value)


def _positive_float(value: Any) -> float:
    what = "a finite number > 0"
    if _number(value, what) <= 0:
        raise _Bad(f"got {value}; expected {what}")
    return float(value)


def _non_negative_float(value: Any) -> float:
    what = "a finite number >= 0"
    if _number(value, what) < 0:
        raise _Bad(f"got {value}; expected {what}")
    return float(value)


def _fraction(value: Any) -> float:
    what = "a number in (0, 1], e.g. 0.9"
    number = _number(value, what)
    if not 0 < number <= 1:
        raise _Bad(f"got {value}; expected {what}")
    return number


def _closed_fraction(value: Any) -> float:
    what = "a number in [0, 1], e.g. 0.1"
    number = _number(value, what)
    if not 0 <= number <= 1:
        raise _Bad(f"got {value}; expected {what}")
    return number


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"{_got(value)}; expected true or false")
    return value


POLICIES = ("fcfs", "priority")
PIECEWISE_CHOICES = ("cost", "pad")
MIXED_GRAPH_MODES = ("full", "piecewise")


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        expected = "expected one of " + ", ".join(f'"{c}"' for c in choices)
        if not isinstance(value, str):
            raise _Bad(f"{_got(value)}; {expected}")
        if value not in choices:
            raise _Bad(f"got {value!r}; {expected}")
        return value

    return check


_piecewise_choice = _one_of(PIECEWISE_CHOICES)
# [embedding] fused_kernels (kernels/bert_ops.py; applied to a CUDA encoder by build_batcher)
FUSED_KERNEL_MODES = ("auto", "off", "tanh-gelu")
_fused_kernels = _one_of(FUSED_KERNEL_MODES)
_mixed_graphs = _one_of(MIXED_GRAPH_MODES)
# [decode] gemv: one-row projections by kernels/triton_gemv (models/llama.py use_gemv)
GEMV_MODES = ("auto", "on", "off")
_gemv = _one_of(GEMV_MODES)
# [model] quantization and [kv_cache] dtype (kernels/quant.py resolves them per device)
# (q4_1 and int8: CPU weight formats, kernels/cpu_quant.py)
QUANTIZATION_MODES = ("none", "fp8", "q4_1", "int8")
KV_CACHE_DTYPES = ("auto", "fp8")
_quantization = _one_of(QUANTIZATION_MODES)
_kv_cache_dtype = _one_of(KV_CACHE_DTYPES)
# [cpu]: the CPU execution plan (kernels/cpu_plan.py resolves it at start-up)
CPU_ISAS = ("auto", "avx512", "avx2", "baseline")
CPU_GEMMS = ("auto", "onednn", "mkl")
CPU_PREFILL_ATTENTION = ("auto", "c", "sdpa")
# [structured] backend: the grammar library of structured output (engine/structured.py)
STRUCTURED_BACKENDS = ("xgrammar", "llguidance")


def _policy(value: Any) -> str:
    expected = "expected one of " + ", ".join(f'"{p}"' for p in POLICIES)
    if not isinstance(value, str):
        raise _Bad(f"{_got(value)}; {expected}")
    if value not in POLICIES:
        close = difflib.get_close_matches(value.lower(), POLICIES, n=1, cutoff=0.5)
        hint = f' (did you mean "{close[0]}"?)' if close else ""
        raise _Bad(f"got {value!r}{hint}; {expected}")
    return value


# (table, key) -> (validator, BucketsConfig field path). "embedding.x" fields live in
# BucketsConfig.embedding. The order here is the order of to_toml().
_SCHEMA: dict[str, dict[str, tuple[Callable[[Any], Any], str]]] = {
    "model": {"quantization": (_quantization, "quantization")},
    "prefill": {
        "boundaries": (_increasing_ints, "prefill_boundaries"),
        "piecewise_sizes": (_sizes_or_auto, "piecewise_sizes"),
        "piecewise_choice": (_piecewise_choice, "piecewise_choice"),
        "mixed_graphs": (_mixed_graphs, "mixed_graphs"),
    },
    "decode": {"batch_sizes": (_increasing_ints, "decode_batch_sizes"),
               "gemv": (_gemv, "decode_gemv")},
    "scheduler": {
        "max_running": (_positive_int_or_auto, "max_running"),
        "max_batched_tokens": (_positive_int_or_auto, "max_batched_tokens"),
        "max_waiting": (_positive_int, "max_waiting"),
        "queue_timeout_s": (_positive_float, "queue_timeout_s"),
        "policy": (_policy, "policy"),
        "max_prefill_share": (_fraction, "max_prefill_share"),
        "async_scheduling": (_bool_or_auto, "async_scheduling"),
    },
    "kv_cache": {
        "block_size": (_positive_int, "block_size"),
        "cpu_memory_gib": (_positive_float, "cpu_memory_gib"),
        "gpu_memory_fraction": (_fraction, "gpu_memory_fraction"),
        "prefix_caching": (_bool, "prefix_caching"),
        "dtype": (_kv_cache_dtype, "kv_cache_dtype"),
    },
    "embedding": {
        "boundaries": (_increasing_ints, "embedding.boundaries"),
        "batch_sizes": (_increasing_ints, "embedding.batch_sizes"),
        "preferred_batch_size": (_positive_int_or_auto, "embedding.preferred_batch_size"),
        "max_batch_tokens": (_positive_int_or_auto, "embedding.max_batch_tokens"),
        "max_queue_delay_ms": (_non_negative_float, "embedding.max_queue_delay_ms"),
        "latency_slo_ms": (_non_negative_float, "embedding.latency_slo_ms"),
        "max_inputs_per_request": (_positive_int, "embedding.max_inputs_per_request"),
        "max_merged_padding": (_closed_fraction_or_auto, "embedding.max_merged_padding"),
        "fused_kernels": (_fused_kernels, "embedding.fused_kernels"),
    },
    "cpu": {
        "isa": (_one_of(CPU_ISAS), "cpu_isa"),
        "gemm": (_one_of(CPU_GEMMS), "cpu_gemm"),
        "threads": (_positive_int_or_auto, "cpu_threads"),
        "c_kernels": (_bool, "cpu_c_kernels"),
        "prefill_attention": (_one_of(CPU_PREFILL_ATTENTION), "cpu_prefill_attention"),
    },
    "structured": {"backend": (_one_of(STRUCTURED_BACKENDS), "structured_backend")},
}


# ---------------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class EmbeddingConfig:
    boundaries: tuple[int, ...]
    batch_sizes: tuple[int, ...]  # CUDA graph batch sizes (per length bucket)
    preferred_batch_size: int | str  # inputs, or "auto": see batch_size
    max_batch_tokens: int | str  # tokens, or "auto": see batch_tokens
    max_queue_delay_ms: float
    latency_slo_ms: float  # 0: off (fixed max_queue_delay_ms); > 0: deadline-driven batching
    max_inputs_per_request: int
    max_merged_padding: float | str  # merged batches' padding bound, or "auto": merged_padding
    fused_kernels: str = "auto"  # FUSED_KERNEL_MODES: the CUDA encoder's fused ops

    @property
    def spec(self) -> BucketSpec:
        return BucketSpec(self.boundaries)

    def batch_size(self, device_type: str) -> int:
        """preferred_batch_size on a device ("cpu", "cuda"): the set value, or for "auto" the
        device's default (AUTO_EMBEDDING_BATCH; the CPU one for other devices)."""
        if self.preferred_batch_size == "auto":
            return AUTO_EMBEDDING_BATCH.get(device_type, AUTO_EMBEDDING_BATCH["cpu"])
        return int(self.preferred_batch_size)

    def merged_padding(self, device_type: str) -> float:
        """max_merged_padding on a device, as batch_size (AUTO_EMBEDDING_MERGED_PADDING)."""
        if self.max_merged_padding == "auto":
            return AUTO_EMBEDDING_MERGED_PADDING.get(device_type,
                                                     AUTO_EMBEDDING_MERGED_PADDING["cpu"])
        return float(self.max_merged_padding)

    def batch_tokens(self, device_type: str) -> int:
        """max_batch_tokens on a device, as batch_size (AUTO_EMBEDDING_BATCH_TOKENS)."""
        if self.max_batch_tokens == "auto":
            return AUTO_EMBEDDING_BATCH_TOKENS.get(device_type, AUTO_EMBEDDING_BATCH_TOKENS["cpu"])
        return int(self.max_batch_tokens)


@dataclass(frozen=True)
class BucketsConfig:
    prefill_boundaries: tuple[int, ...]
    piecewise_sizes: tuple[int, ...] | str  # token counts, or "auto": see piecewise_token_counts
    decode_batch_sizes: tuple[int, ...]
    max_running: int | str  # sequences, or "auto": see running_limit
    max_batched_tokens: int | str  # tokens, or "auto": see step_token_budget
    max_waiting: int
    queue_timeout_s: float
    policy: str
    max_prefill_share: float  # most of a step's token budget one sequence's prefill takes
    async_scheduling: bool | str  # or "auto": see use_async_scheduling
    block_size: int
    cpu_memory_gib: float
    gpu_memory_fraction: float
    prefix_caching: bool  # reuse cached KV blocks of shared prompt prefixes
    embedding: EmbeddingConfig
    # per prefill / mixed step: "cost" (cheaper of padded graph replay and eager run, measured
    # at start-up) or "pad" (always the next captured size); see PaddingCostModel
    piecewise_choice: str = "cost"
    # how prefill / mixed steps are captured (CUDA): "full" (one graph per token count,
    # attention inside: kernels/cuda_graphs.MixedGraphs) or "piecewise" (attention eager)
    mixed_graphs: str = "full"
    # one-row projections on CUDA (bf16 / fp16): "auto" (the Triton GEMV per weight shape
    # where it measures faster than cuBLAS at start-up), "on", "off" (cuBLAS)
    decode_gemv: str = "auto"
    # weights of the decoder projections: "none" (the model dtype) or "fp8" (W8A8, CUDA with
    # FP8 tensor cores only; kernels/quant.py)
    quantization: str = "none"
    # KV pool element type: "auto" (the model dtype) or "fp8" (float8_e4m3fn with scales)
    kv_cache_dtype: str = "auto"
    # the CPU plan's inputs ([cpu]; kernels/cpu_plan.resolve_cpu_plan)
    cpu_isa: str = "auto"
    cpu_gemm: str = "auto"
    cpu_threads: int | str = "auto"
    cpu_c_kernels: bool = True
    cpu_prefill_attention: str = "auto"
    # the grammar library of structured output: "xgrammar" or "llguidance"
    structured_backend: str = "xgrammar"
    # Where the values came from, for error messages: the user file (or the default file), and
    # the dotted keys the user file set (defaults may be adapted to the model; user values not).
    source: str = field(default="<defaults>", compare=False)
    user_keys: frozenset[str] = field(default=frozenset(), compare=False)

    def running_limit(self, device_type: str) -> int:
        """max_running on a device ("cpu", "cuda"): the set value, or for "auto" the device's
        default (AUTO_MAX_RUNNING; the CPU one for other devices)."""
        if self.max_running == "auto":
            return AUTO_MAX_RUNNING.get(device_type, AUTO_MAX_RUNNING["cpu"])
        return int(self.max_running)

    def decode_graph_sizes(self, device_type: str) -> list[int]:
        """The decode batch sizes worth a CUDA graph: those up to the running limit, and the
        limit itself when the list goes past it (a batch can never be larger)."""
        limit = self.running_limit(device_type)
        sizes = [b for b in self.decode_batch_sizes if b <= limit]
        if any(b > limit for b in self.decode_batch_sizes) and limit not in sizes:
            sizes.append(limit)
        return sizes

    def step_token_budget(self, device_type: str) -> int:
        """max_batched_tokens on a device ("cpu", "cuda"): the set value, or for "auto" the
        device's default (AUTO_STEP_TOKENS; the CPU one for other devices)."""
        if self.max_batched_tokens == "auto":
            return AUTO_STEP_TOKENS.get(device_type, AUTO_STEP_TOKENS["cpu"])
        return int(self.max_batched_tokens)

    def prefill_chunk_tokens(self, device_type: str) -> int:
        """The most prompt tokens one sequence prefills in one step on this device."""
        return max(1, int(self.step_token_budget(device_type) * self.max_prefill_share))
    def piecewise_token_counts(self, step_tokens: int) -> list[int]:
        """Token counts the piecewise CUDA graphs are captured at for a step budget of
        `step_tokens`: the set sizes up to the budget, or for "auto" the prefill boundaries
        below it, every AUTO_PIECEWISE_STEP tokens from 128 to 1024, the multiples of 1024
        below it and the budget itself."""
        if self.piecewise_sizes == "auto":
            sizes = [b for b in self.prefill_boundaries if b < step_tokens]
            sizes += list(range(128, min(1025, step_tokens), AUTO_PIECEWISE_STEP))
            sizes += list(range(1024, step_tokens, 1024))
            return sorted({*sizes, step_tokens})
        return [t for t in self.piecewise_sizes if t <= step_tokens]

    def use_async_scheduling(self, device_type: str) -> bool:
        """async_scheduling on a device: the set value, or for "auto" on for CUDA and
        AUTO_ASYNC_CPU on the CPU."""
        if self.async_scheduling == "auto":
            return device_type == "cuda" or AUTO_ASYNC_CPU
        return bool(self.async_scheduling)

    @property
    def prefill_spec(self) -> BucketSpec:
        return BucketSpec(self.prefill_boundaries)

    @property
    def decode_spec(self) -> BucketSpec:
        """Decode batch sizes as buckets: lookup(B) is the CUDA Graph size a batch of B uses."""
        return BucketSpec(self.decode_batch_sizes)

    def check_model(
        self, max_model_len: int | None = None, embedding_max_len: int | None = None
    ) -> BucketsConfig:
        """Check the boundaries against the loaded model(s); returns the config to use.

        A boundary the user set above the model's context is a ConfigError. Default boundaries
        (the user did not set the key) are instead cut to the context, which then becomes the
        last boundary, so every admissible length still has a bucket.
        """
        config = self
        if max_model_len is not None:
            bounds = self._fit("prefill.boundaries", self.prefill_boundaries, max_model_len,
                               "the model's context length (max_model_len)")
            config = replace(config, prefill_boundaries=bounds)
        if embedding_max_len is not None:
            bounds = self._fit("embedding.boundaries", self.embedding.boundaries,
                               embedding_max_len, "the embedding model's maximum input length")
            config = replace(config, embedding=replace(config.embedding, boundaries=bounds))
            config._check_cross_keys()
        return config

    def _fit(self, key: str, bounds: tuple[int, ...], limit: int, what: str) -> tuple[int, ...]:
        if not _is_int(limit) or limit < 1:
            raise ValueError(f"{what} must be a positive integer, got {limit!r}")
        if bounds[-1] <= limit:
            return bounds
        if key in self.user_keys:
            raise ConfigError(
                self.source, key,
                f"boundary {bounds[-1]} exceeds {what} {limit}; expected every boundary <= "
                f"{limit} (drop the larger ones, or end the list at {limit})",
            )
        kept = tuple(b for b in bounds if b < limit)
        return kept + (limit,)

    def _check_cross_keys(self) -> None:
        emb = self.embedding
        if emb.latency_slo_ms / 1000.0 >= self.queue_timeout_s:
            raise ConfigError(
                self.source, "embedding.latency_slo_ms",
                f"embedding.latency_slo_ms ({emb.latency_slo_ms:g}) is not below "
                f"scheduler.queue_timeout_s ({self.queue_timeout_s:g} s): inputs would time out "
                f"before their deadline; expected latency_slo_ms < {self.queue_timeout_s * 1000:g}",
            )
        batch_tokens = min(emb.batch_tokens(d) for d in AUTO_EMBEDDING_BATCH_TOKENS)
        if batch_tokens < emb.boundaries[-1]:
            key = ("embedding.max_batch_tokens"
                   if "embedding.max_batch_tokens" in self.user_keys or
                   "embedding.boundaries" not in self.user_keys else "embedding.boundaries")
            raise ConfigError(
                self.source, key,
                f"embedding.max_batch_tokens ({batch_tokens}) is smaller than the last "
                f"embedding.boundaries value ({emb.boundaries[-1]}), so an input of that length "
                f"could never be batched; expected max_batch_tokens >= {emb.boundaries[-1]}",
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The effective config as {table: {key: value}}, in the TOML schema's shape."""
        out: dict[str, dict[str, Any]] = {}
        for table, keys in _SCHEMA.items():
            out[table] = {}
            for key, (_, attr) in keys.items():
                obj: Any = self
                for part in attr.split("."):
                    obj = getattr(obj, part)
                out[table][key] = list(obj) if isinstance(obj, tuple) else obj
        return out

    def to_toml(self) -> str:
        """The effective config as a complete TOML buckets file (loads back to an equal config)."""
        lines: list[str] = []
        for table, keys in self.to_dict().items():
            lines.append(f"[{table}]")
            for key, value in keys.items():
                if isinstance(value, bool):
                    text = "true" if value else "false"
                elif isinstance(value, str):
                    text = f'"{value}"'
                elif isinstance(value, list):
                    text = "[" + ", ".join(str(v) for v in value) + "]"
                else:
                    text = repr(value)
                lines.append(f"{key} = {text}")
            lines.append("")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- loading
def default_buckets_path() -> Path:
    """Path of the shipped default.toml (package data)."""
    return Path(str(resources.files("bucketserve.buckets").joinpath(DEFAULT_NAME)))


def _read_toml(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            source, None, "file not found; expected a path to a TOML buckets file"
        ) from None
    except IsADirectoryError:
        raise ConfigError(source, None, "is a directory; expected a TOML buckets file") from None
    except OSError as e:
        raise ConfigError(source, None, f"cannot read the file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            source, None, f"not valid UTF-8 at byte {e.start}; expected a UTF-8 TOML file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        # tomllib's message carries the position, e.g. "... (at line 3, column 9)".
        raise ConfigError(source, None, f"invalid TOML: {e}") from None


def _unknown_key_hint(table: str, key: str) -> str:
    close = difflib.get_close_matches(key, list(_SCHEMA[table]), n=1, cutoff=0.6)
    if close:
        return f"did you mean {table}.{close[0]}?"
    owners = [t for t, keys in _SCHEMA.items() if key in keys]
    if owners:
        return f"did you mean {owners[0]}.{key} (it belongs in [{owners[0]}])?"
    return "valid keys in [" + table + "]: " + ", ".join(_SCHEMA[table])


def _validated(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Validate one parsed file (any subset of keys); returns {"table.key": normalized value}."""
    out: dict[str, Any] = {}
    for table, body in data.items():
        if table not in _SCHEMA:
            owners = [t for t, keys in _SCHEMA.items() if table in keys]
            close = difflib.get_close_matches(table, list(_SCHEMA), n=1, cutoff=0.6)
            if owners:
                hint = f"keys go inside their table: did you mean [{owners[0]}] {table} = ...?"
            elif close:
                hint = f"did you mean [{close[0]}]?"
            else:
                hint = "valid tables: " + ", ".join(f"[{t}]" for t in _SCHEMA)
            raise ConfigError(source, table, f"unknown table; {hint}")
        if not isinstance(body, dict):
            raise ConfigError(
                source, table, f"{_got(body)}; expected a table ([{table}] with keys under it)"
            )
        for key, value in body.items():
            dotted = f"{table}.{key}"
            if key not in _SCHEMA[table]:
                raise ConfigError(source, dotted, f"unknown key; {_unknown_key_hint(table, key)}")
            validator, _ = _SCHEMA[table][key]
            try:
                out[dotted] = validator(value)
            except _Bad as e:
                raise ConfigError(source, dotted, str(e)) from None
    return out


def _build(values: dict[str, Any], source: str, user_keys: frozenset[str]) -> BucketsConfig:
    top: dict[str, Any] = {}
    emb: dict[str, Any] = {}
    for table, keys in _SCHEMA.items():
        for key, (_, attr) in keys.items():
            value = values[f"{table}.{key}"]
            if attr.startswith("embedding."):
                emb[attr.split(".", 1)[1]] = value
            else:
                top[attr] = value
    return BucketsConfig(**top, embedding=EmbeddingConfig(**emb), source=source,
                         user_keys=user_keys)


def load_buckets(
    path: str | Path | None = None, max_model_len: int | None = None
) -> BucketsConfig:
    """Load the buckets config: the defaults, overridden by the keys set in `path` (if given).

    With max_model_len, also runs check_model(max_model_len) (see there). Raises ConfigError,
    a ValueError with a one-line message, for any problem in the file.
    """
    default_path = default_buckets_path()
    values = _validated(_read_toml(default_path), str(default_path))
    source, user_keys = str(default_path), frozenset()
    if path is not None:
        source = str(path)
        user = _validated(_read_toml(Path(path)), source)
        values.update(user)
        user_keys = frozenset(user)
    config = _build(values, source, user_keys)
    config._check_cross_keys()
    return config.check_model(max_model_len)
