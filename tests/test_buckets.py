"""Buckets config (load / merge / validation / CLI) and bucket arithmetic (lookup / profiles /
padding). Pure Python: fast, no model needed."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from bucketserve.buckets import (
    BucketsConfig,
    BucketSpec,
    ConfigError,
    PaddingCounter,
    default_buckets_path,
    load_buckets,
    round_up_batch_size,
)
from bucketserve.buckets.__main__ import main as cli_main

# The schema and defaults as documented in /work/notes/TEAM.md (the spec this package implements).
DOCUMENTED_DEFAULTS = {
    "model": {"quantization": "none"},
    "prefill": {"boundaries": [16, 32, 64, 128, 256, 512, 1024, 2048], "piecewise_sizes": "auto",
                "piecewise_choice": "cost", "mixed_graphs": "full"},
    "decode": {"batch_sizes": [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                               192, 208, 224, 240, 256, *range(288, 1025, 32)],
               "gemv": "auto"},
    "scheduler": {"max_running": "auto", "max_batched_tokens": "auto", "max_waiting": 1024,
                  "queue_timeout_s": 600.0, "policy": "priority",
                  "max_prefill_share": 0.25, "async_scheduling": "auto"},
    "kv_cache": {"block_size": 16, "cpu_memory_gib": 2.0, "gpu_memory_fraction": 0.9,
                 "prefix_caching": True, "dtype": "auto"},
    "embedding": {"boundaries": [*range(8, 257, 8), 320, 384, 448, 512],
                  "batch_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256],
                  "preferred_batch_size": "auto", "max_batch_tokens": "auto",
                  "max_queue_delay_ms": 5.0, "latency_slo_ms": 0.0,
                  "max_inputs_per_request": 2048, "max_merged_padding": "auto",
                  "fused_kernels": "auto"},
    "cpu": {"isa": "auto", "gemm": "auto", "threads": "auto", "c_kernels": True,
            "prefill_attention": "auto"},
    "structured": {"backend": "xgrammar"},
}


def write(tmp_path: Path, text: str, name: str = "buckets.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(path: Path, max_model_len: int | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_buckets(path, max_model_len=max_model_len)
    err = info.value
    assert "\n" not in str(err) and "\r" not in str(err), str(err)
    assert str(err).startswith(f"{path}: "), str(err)
    return err


# ------------------------------------------------------------------------------ default file
def test_default_file_matches_documented_defaults() -> None:
    config = load_buckets()
    assert config.to_dict() == DOCUMENTED_DEFAULTS
    assert config.prefill_boundaries == tuple(DOCUMENTED_DEFAULTS["prefill"]["boundaries"])
    assert config.embedding.max_queue_delay_ms == 5.0
    assert config.user_keys == frozenset()
    assert isinstance(config.queue_timeout_s, float)


def test_default_file_parsed_directly_equals_loaded_config() -> None:
    raw = tomllib.loads(default_buckets_path().read_text())
    assert raw == load_buckets().to_dict()


def test_default_file_is_package_data_and_documents_every_key() -> None:
    path = default_buckets_path()
    assert path.name == "default.toml" and path.is_file()
    lines = path.read_text().splitlines()
    keys_seen = 0
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+\s*=", line):
            keys_seen += 1
            assert lines[i - 1].lstrip().startswith("#"), f"undocumented key: {line}"
    assert keys_seen == sum(len(t) for t in DOCUMENTED_DEFAULTS.values())


def test_config_is_frozen() -> None:
    config = load_buckets()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_running = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.embedding.boundaries = (1,)  # type: ignore[misc]


# ------------------------------------------------------------------------------------ merging
def test_partial_file_merges_with_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, """
[decode]
batch_sizes = [1, 8, 64]

[scheduler]
policy = "fcfs"
queue_timeout_s = 30      # an integer is accepted for a float key

[embedding]
max_queue_delay_ms = 0
""")
    config = load_buckets(path)
    expected = {t: dict(keys) for t, keys in DOCUMENTED_DEFAULTS.items()}
    expected["decode"]["batch_sizes"] = [1, 8, 64]
    expected["scheduler"]["policy"] = "fcfs"
    expected["scheduler"]["queue_timeout_s"] = 30.0
    expected["embedding"]["max_queue_delay_ms"] = 0.0
    assert config.to_dict() == expected
    assert isinstance(config.queue_timeout_s, float)
    assert config.source == str(path)
    assert config.user_keys == {"decode.batch_sizes", "scheduler.policy",
                                "scheduler.queue_timeout_s", "embedding.max_queue_delay_ms"}


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_buckets(write(tmp_path, "# nothing set\n")) == load_buckets()


def test_string_path_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, "[kv_cache]\nblock_size = 32\n")
    assert load_buckets(str(path)).block_size == 32


def test_small_token_budget_is_legal(tmp_path: Path) -> None:
    # Chunked prefill: a budget below the longest prompt bucket is allowed.
    config = load_buckets(write(tmp_path, "[scheduler]\nmax_batched_tokens = 1\n"))
    assert config.max_batched_tokens == 1 < config.prefill_boundaries[-1]


def test_max_running_auto_is_per_device_and_bounds_the_decode_graphs(tmp_path: Path) -> None:
    from bucketserve.buckets.config import AUTO_MAX_RUNNING

    auto = load_buckets()
    assert auto.max_running == "auto"
    assert auto.running_limit("cpu") == AUTO_MAX_RUNNING["cpu"] == 256
    assert auto.running_limit("cuda") == AUTO_MAX_RUNNING["cuda"] == 1024
    assert auto.running_limit("mps") == 256
    assert 'max_running = "auto"' in auto.to_toml()
    # on a GPU every default decode size is captured; a lower limit drops the sizes above it
    assert auto.decode_graph_sizes("cuda") == list(auto.decode_batch_sizes)
    assert auto.decode_graph_sizes("cpu")[-1] == 256 and max(auto.decode_graph_sizes("cpu")) == 256
    fixed = load_buckets(write(tmp_path, "[scheduler]\nmax_running = 300\n"))
    assert fixed.running_limit("cpu") == fixed.running_limit("cuda") == 300
    sizes = fixed.decode_graph_sizes("cuda")
    assert sizes[-2:] == [288, 300] and all(b <= 300 for b in sizes)
    small = load_buckets(write(tmp_path, "[decode]\nbatch_sizes = [1, 8]\n"))
    assert small.decode_graph_sizes("cuda") == [1, 8]  # below the limit: nothing added
    with pytest.raises(ConfigError, match="max_running"):
        load_buckets(write(tmp_path, '[scheduler]\nmax_running = "many"\n'))


def test_step_token_budget_auto_is_per_device(tmp_path: Path) -> None:
    from bucketserve.buckets.config import AUTO_STEP_TOKENS

    auto = load_buckets()
    assert auto.max_batched_tokens == "auto"
    assert auto.step_token_budget("cpu") == AUTO_STEP_TOKENS["cpu"] == 2048
    assert auto.step_token_budget("cuda") == AUTO_STEP_TOKENS["cuda"] == 16384
    assert auto.step_token_budget("mps") == 2048  # devices without their own default: CPU's
    assert 'max_batched_tokens = "auto"' in auto.to_toml()
    # a value the user sets holds on every device
    fixed = load_buckets(write(tmp_path, "[scheduler]\nmax_batched_tokens = 512\n"))
    assert fixed.step_token_budget("cpu") == fixed.step_token_budget("cuda") == 512


def test_prefix_caching_can_be_turned_off(tmp_path: Path) -> None:
    config = load_buckets(write(tmp_path, "[kv_cache]\nprefix_caching = false\n"))
    assert config.prefix_caching is False
    assert "prefix_caching = false" in config.to_toml()


def test_piecewise_sizes_auto_and_set(tmp_path: Path) -> None:
    auto = load_buckets()
    dense = list(range(128, 1025, 32))  # every 32 tokens from 128 to 1024
    assert auto.piecewise_token_counts(8192) == [16, 32, 64, *dense, 2048, 3072, 4096, 5120,
                                                 6144, 7168, 8192]
    assert auto.piecewise_token_counts(2048) == [16, 32, 64, *dense, 2048]
    assert auto.piecewise_token_counts(1000) == [16, 32, 64, *range(128, 1000, 32), 1000]
    assert auto.piecewise_token_counts(100) == [16, 32, 64, 100]
    assert auto.piecewise_token_counts(16) == [16]
    # the largest gap between captured sizes up to 1024: 32 tokens above 128
    sizes = auto.piecewise_token_counts(8192)
    assert max(b - a for a, b in zip(sizes, sizes[1:], strict=False)
               if b <= 1024 and a >= 128) == 32
    # "auto" follows the prefill boundaries (those below the budget)
    own = load_buckets(write(tmp_path, "[prefill]\nboundaries = [100, 300, 3000]\n"))
    assert own.piecewise_token_counts(4096) == sorted({100, 300, *dense, 2048, 3000, 3072,
                                                       4096})
    # a set list is taken as it is, less the sizes above the step budget
    fixed = load_buckets(write(tmp_path, "[prefill]\npiecewise_sizes = [64, 512, 4096]\n"))
    assert fixed.piecewise_sizes == (64, 512, 4096)
    assert fixed.piecewise_token_counts(8192) == [64, 512, 4096]
    assert fixed.piecewise_token_counts(2048) == [64, 512]


def test_async_scheduling_auto_is_per_device(tmp_path: Path) -> None:
    from bucketserve.buckets.config import AUTO_ASYNC_CPU

    auto = load_buckets()
    assert auto.use_async_scheduling("cuda") is True
    assert auto.use_async_scheduling("cpu") is AUTO_ASYNC_CPU
    for value in (True, False):
        config = load_buckets(write(tmp_path, f"[scheduler]\nasync_scheduling = {str(value).lower()}\n"))
        assert config.use_async_scheduling("cpu") is value
        assert config.use_async_scheduling("cuda") is value


def test_gpu_memory_fraction_one_is_legal(tmp_path: Path) -> None:
    assert load_buckets(write(tmp_path, "[kv_cache]\ngpu_memory_fraction = 1\n")
                        ).gpu_memory_fraction == 1.0


def test_to_toml_round_trips(tmp_path: Path) -> None:
    config = load_buckets(write(tmp_path, """
[prefill]
boundaries = [8, 100, 333]
piecewise_sizes = [64, 512]
[scheduler]
policy = "fcfs"
queue_timeout_s = 0.25
async_scheduling = false
[kv_cache]
cpu_memory_gib = 0.5
[embedding]
boundaries = [4, 9]
max_batch_tokens = 9
"""))
    again = load_buckets(write(tmp_path, config.to_toml(), name="again.toml"))
    assert again == config
    assert again.user_keys == {f"{t}.{k}" for t, keys in DOCUMENTED_DEFAULTS.items() for k in keys}


def test_max_merged_padding_bounds_accepted(tmp_path: Path) -> None:
    # 0 turns merging off, 1 merges regardless of padding; an integer is accepted as a float.
    for text, value in (("0", 0.0), ("1", 1.0), ("0.05", 0.05)):
        config = load_buckets(write(tmp_path, f"[embedding]\nmax_merged_padding = {text}\n"))
        assert config.embedding.max_merged_padding == value
        assert isinstance(config.embedding.max_merged_padding, float)


def test_specs_from_config() -> None:
    config = load_buckets()
    assert config.prefill_spec == BucketSpec(config.prefill_boundaries)
    assert config.decode_spec.lookup(3) == 4 and config.decode_spec.lookup(257) == 288
    assert config.decode_spec.lookup(1025) is None
    assert list(config.embedding.spec) == list(config.embedding.boundaries)


# ------------------------------------------------------------------------------- validation
# (file text, dotted key the message must name, fragments it must contain)
INVALID = [
    # unknown tables / keys, with suggestions
    ("[prefil]\nboundaries = [16]\n", "prefil", ["unknown table", "[prefill]"]),
    ("block_size = 16\n", "block_size", ["unknown table", "[kv_cache]"]),
    ("[network]\nx = 1\n", "network", ["unknown table", "valid tables", "[embedding]"]),
    ("[gpu]\nx = 1\n", "gpu", ["unknown table", "did you mean [cpu]?"]),
    ("prefill = 3\n", "prefill", ["integer", "expected a table"]),
    ("[scheduler]\nmax_runing = 4\n", "scheduler.max_runing",
     ["unknown key", "scheduler.max_running"]),
    ("[decode]\nmax_running = 4\n", "decode.max_running",
     ["unknown key", "scheduler.max_running", "[scheduler]"]),
    ("[kv_cache]\nzzz = 1\n", "kv_cache.zzz", ["unknown key", "block_size"]),
    ("[prefill.extra]\nx = 1\n", "prefill.extra", ["unknown key"]),
    # integers: bool is not an int, nor a string / float
    ("[scheduler]\nmax_running = true\n", "scheduler.max_running", ["boolean", "positive integer"]),
    ('[scheduler]\nmax_waiting = "8"\n', "scheduler.max_waiting", ["string", "positive integer"]),
    ("[kv_cache]\nblock_size = 16.0\n", "kv_cache.block_size", ["float", "positive integer"]),
    ("[scheduler]\nmax_waiting = 0\n", "scheduler.max_waiting", ["got 0", ">= 1"]),
    ("[kv_cache]\nblock_size = -16\n", "kv_cache.block_size", ["-16", ">= 1"]),
    ("[scheduler]\nmax_batched_tokens = 0\n", "scheduler.max_batched_tokens", [">= 1", '"auto"']),
    ('[scheduler]\nmax_batched_tokens = "fast"\n', "scheduler.max_batched_tokens",
     ["string", "'fast'", 'or "auto"']),
    ("[scheduler]\nmax_batched_tokens = 8192.0\n", "scheduler.max_batched_tokens",
     ["float", 'or "auto"']),
    ("[embedding]\npreferred_batch_size = 0\n", "embedding.preferred_batch_size", [">= 1"]),
    ('[embedding]\npreferred_batch_size = "big"\n', "embedding.preferred_batch_size",
     ["'big'", 'or "auto"']),
    ("[embedding]\nmax_batch_tokens = 8192.0\n", "embedding.max_batch_tokens",
     ["float", 'or "auto"']),
    ("[embedding]\nbatch_sizes = [4, 2]\n", "embedding.batch_sizes",
     ["element 1 (2)", "strictly increasing"]),
    ("[embedding]\nbatch_sizes = []\n", "embedding.batch_sizes", ["empty array"]),
    ("[embedding]\nbatch_sizes = [0, 8]\n", "embedding.batch_sizes", ["element 0", "positive"]),
    ("[embedding]\nmax_inputs_per_request = false\n", "embedding.max_inputs_per_request",
     ["boolean"]),
    # boundary / batch-size arrays
    ("[prefill]\nboundaries = 16\n", "prefill.boundaries", ["integer", "array"]),
    ("[prefill]\nboundaries = []\n", "prefill.boundaries", ["empty array"]),
    ('[prefill]\nboundaries = [16, "32"]\n', "prefill.boundaries", ["element 1", "string"]),
    ("[decode]\nbatch_sizes = [1, true]\n", "decode.batch_sizes", ["element 1", "boolean"]),
    ("[decode]\nbatch_sizes = [1, 2.0]\n", "decode.batch_sizes", ["element 1", "float"]),
    ("[decode]\nbatch_sizes = [0, 1]\n", "decode.batch_sizes", ["element 0", "positive"]),
    ("[decode]\nbatch_sizes = [1, 2, 2]\n", "decode.batch_sizes",
     ["element 2 (2)", "element 1 (2)", "strictly increasing"]),
    ("[embedding]\nboundaries = [64, 32]\n", "embedding.boundaries",
     ["element 1 (32)", "strictly increasing"]),
    # floats
    ("[scheduler]\nqueue_timeout_s = 0\n", "scheduler.queue_timeout_s", ["> 0"]),
    ("[scheduler]\nqueue_timeout_s = -1.5\n", "scheduler.queue_timeout_s", ["-1.5", "> 0"]),
    ("[scheduler]\nqueue_timeout_s = nan\n", "scheduler.queue_timeout_s", ["nan", "finite"]),
    ("[kv_cache]\ncpu_memory_gib = inf\n", "kv_cache.cpu_memory_gib", ["inf", "finite"]),
    ('[kv_cache]\ncpu_memory_gib = "2"\n', "kv_cache.cpu_memory_gib", ["string"]),
    ("[scheduler]\nqueue_timeout_s = true\n", "scheduler.queue_timeout_s", ["boolean"]),
    ("[embedding]\nmax_queue_delay_ms = -1\n", "embedding.max_queue_delay_ms", [">= 0"]),
    ("[embedding]\nlatency_slo_ms = -5\n", "embedding.latency_slo_ms", ["-5", ">= 0"]),
    ("[embedding]\nlatency_slo_ms = inf\n", "embedding.latency_slo_ms", ["inf", "finite"]),
    ('[embedding]\nlatency_slo_ms = "50ms"\n', "embedding.latency_slo_ms", ["string"]),
    ("[kv_cache]\ngpu_memory_fraction = 0\n", "kv_cache.gpu_memory_fraction", ["(0, 1]"]),
    ("[kv_cache]\ngpu_memory_fraction = 1.01\n", "kv_cache.gpu_memory_fraction", ["1.01", "(0, 1]"]),
    ("[kv_cache]\ngpu_memory_fraction = -0.5\n", "kv_cache.gpu_memory_fraction", ["(0, 1]"]),
    ("[kv_cache]\nprefix_caching = 1\n", "kv_cache.prefix_caching", ["integer", "true or false"]),
    ('[kv_cache]\nprefix_caching = "on"\n', "kv_cache.prefix_caching", ["string", "true or false"]),
    ("[embedding]\nmax_merged_padding = 1.5\n", "embedding.max_merged_padding", ["1.5", "[0, 1]"]),
    ("[embedding]\nmax_merged_padding = -0.1\n", "embedding.max_merged_padding", ["[0, 1]"]),
    ("[embedding]\nmax_merged_padding = nan\n", "embedding.max_merged_padding", ["nan", "[0, 1]"]),
    ('[embedding]\nmax_merged_padding = "10%"\n', "embedding.max_merged_padding",
     ["string", 'or "auto"']),
    # policy
    ('[scheduler]\npolicy = "lifo"\n', "scheduler.policy", ["'lifo'", '"fcfs"', '"priority"']),
    ('[scheduler]\npolicy = "FCFS"\n', "scheduler.policy", ['did you mean "fcfs"']),
    ('[scheduler]\npolicy = "priorty"\n', "scheduler.policy", ['did you mean "priority"']),
    ("[scheduler]\npolicy = 1\n", "scheduler.policy", ["integer", '"fcfs"']),
    # overlapped scheduling, piecewise graph sizes
    ('[scheduler]\nasync_scheduling = "yes"\n', "scheduler.async_scheduling",
     ["'yes'", "true, false or \"auto\""]),
    ("[scheduler]\nasync_scheduling = 1\n", "scheduler.async_scheduling", ["integer"]),
    ('[prefill]\npiecewise_sizes = "all"\n', "prefill.piecewise_sizes", ["'all'", '"auto"']),
    ("[prefill]\npiecewise_sizes = [512, 256]\n", "prefill.piecewise_sizes",
     ["element 1", "increasing"]),
    ("[prefill]\npiecewise_sizes = []\n", "prefill.piecewise_sizes", ["empty array"]),
    ("[prefill]\npiecewise_sizes = 1024\n", "prefill.piecewise_sizes", ["integer", '"auto"']),
    ('[prefill]\npiecewise_choice = "eager"\n', "prefill.piecewise_choice",
     ["'eager'", '"cost"', '"pad"']),
    ("[prefill]\npiecewise_choice = true\n", "prefill.piecewise_choice", ["boolean", '"cost"']),
    ('[prefill]\nmixed_graphs = "whole"\n', "prefill.mixed_graphs",
     ["'whole'", '"full"', '"piecewise"']),
    ("[prefill]\nmixed_graphs = 1\n", "prefill.mixed_graphs", ["integer", '"full"']),
    ('[decode]\ngemv = "cutlass"\n', "decode.gemv", ["'cutlass'", '"auto"', '"off"']),
    ("[decode]\ngemv = false\n", "decode.gemv", ["boolean", '"on"']),
    # cross-key: an encoder batch must fit one input of the longest bucket
    ("[embedding]\nmax_batch_tokens = 256\n", "embedding.max_batch_tokens", ["256", "512"]),
    ("[embedding]\nboundaries = [512, 16384]\n", "embedding.boundaries", ["8192", "16384"]),
    # cross-key: a deadline past the queue timeout could never be waited for
    ("[scheduler]\nqueue_timeout_s = 2\n[embedding]\nlatency_slo_ms = 2000\n",
     "embedding.latency_slo_ms", ["2000", "queue_timeout_s", "< 2000"]),
]


@pytest.mark.parametrize(("text", "key", "fragments"), INVALID)
def test_invalid_value_names_key(tmp_path: Path, text: str, key: str, fragments: list[str]) -> None:
    path = write(tmp_path, text)
    err = load_error(path)
    assert err.key == key
    assert str(err).startswith(f"{path}: {key}: "), str(err)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


def test_embedding_auto_batch_by_device(tmp_path: Path) -> None:
    emb = load_buckets().embedding
    assert (emb.batch_size("cpu"), emb.batch_tokens("cpu")) == (32, 8192)
    assert (emb.batch_size("cuda"), emb.batch_tokens("cuda")) == (64, 16384)
    assert emb.batch_size("mps") == 32  # other devices: the CPU values
    assert (emb.merged_padding("cpu"), emb.merged_padding("cuda")) == (0.1, 0.05)
    path = write(tmp_path, "[embedding]\npreferred_batch_size = 8\nmax_batch_tokens = 1024\n"
                           "batch_sizes = [2, 8]\nboundaries = [16, 512]\n")
    emb = load_buckets(path).embedding
    assert emb.batch_sizes == (2, 8)
    assert [emb.batch_size(d) for d in ("cpu", "cuda")] == [8, 8]
    assert [emb.batch_tokens(d) for d in ("cpu", "cuda")] == [1024, 1024]
    path = write(tmp_path, "[embedding]\nmax_merged_padding = 0\n")
    assert load_buckets(path).embedding.merged_padding("cuda") == 0.0


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_later_table_error_reports_user_file_not_default(tmp_path: Path) -> None:
    # A valid key before a bad one: the error still names the user file and the bad key.
    path = write(tmp_path, "[kv_cache]\nblock_size = 32\n[decode]\nbatch_sizes = [4, 2]\n")
    assert load_error(path).key == "decode.batch_sizes"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("[prefill]\nboundaries = [16, 32,,]\n", 2),
        ("[prefill]\nboundaries = [16, 32\n", None),  # tomllib: "at end of document"
        ("[scheduler]\nmax_running 4\n", 2),
        ("[kv_cache]\nblock_size = 16\nblock_size = 32\n", 3),  # duplicate key
        ("[prefill]\n[prefill]\n", 2),  # duplicate table
    ],
)
def test_toml_syntax_error_gives_position(tmp_path: Path, text: str, line: int | None) -> None:
    path = write(tmp_path, text)
    err = load_error(path)
    assert err.key is None
    assert "invalid TOML" in str(err)
    if line is None:
        assert "end of document" in str(err)
        return
    match = re.search(r"line (\d+), column (\d+)", str(err))
    assert match and int(match.group(1)) == line, str(err)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    err = load_error(path)
    assert "not found" in str(err) and err.key is None


def test_directory_instead_of_file(tmp_path: Path) -> None:
    err = load_error(tmp_path)
    assert "directory" in str(err)


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[scheduler]\npolicy = \"\xff\"\n")
    err = load_error(path)
    assert "UTF-8" in str(err)


# ------------------------------------------------------------------------ model context check
def test_user_boundary_over_context_names_both_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, "[prefill]\nboundaries = [64, 512, 4096]\n")
    err = load_error(path, max_model_len=2048)
    assert err.key == "prefill.boundaries"
    assert "4096" in str(err) and "2048" in str(err)
    # Same check through check_model after loading without the limit.
    config = load_buckets(path)
    with pytest.raises(ConfigError) as info:
        config.check_model(2048)
    assert str(info.value) == str(err)


def test_user_boundary_equal_to_context_is_fine(tmp_path: Path) -> None:
    path = write(tmp_path, "[prefill]\nboundaries = [64, 2048]\n")
    assert load_buckets(path, max_model_len=2048).prefill_boundaries == (64, 2048)


def test_default_boundaries_are_cut_to_context() -> None:
    defaults = DOCUMENTED_DEFAULTS["prefill"]["boundaries"]
    for limit in (1000, 2048, 8192, 10, 16):
        config = load_buckets(max_model_len=limit)
        expected = [b for b in defaults if b < limit] + [limit] if limit < defaults[-1] else defaults
        assert list(config.prefill_boundaries) == expected, limit
        assert config.prefill_boundaries[-1] <= limit


def test_embedding_max_len(tmp_path: Path) -> None:
    config = load_buckets().check_model(embedding_max_len=128)
    assert config.embedding.boundaries == tuple(range(8, 129, 8))
    assert config.prefill_boundaries == load_buckets().prefill_boundaries
    path = write(tmp_path, "[embedding]\nboundaries = [16, 1024]\n")
    with pytest.raises(ConfigError) as info:
        load_buckets(path).check_model(embedding_max_len=512)
    assert info.value.key == "embedding.boundaries"
    assert "1024" in str(info.value) and "512" in str(info.value)


def test_check_model_rejects_bad_limit() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        load_buckets().check_model(0)
    with pytest.raises(ValueError, match="positive integer"):
        load_buckets(max_model_len=True)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- CLI
def test_cli_prints_effective_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[decode]\nbatch_sizes = [1, 4]\n")
    assert cli_main(["check", str(path), "--max-model-len", "100"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed == load_buckets(path, max_model_len=100).to_dict()
    assert printed["prefill"]["boundaries"][-1] == 100


def test_cli_error_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[prefill]\nboundaries = [16, 4096]\n")
    assert cli_main(["check", str(path), "--max-model-len", "2048"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "prefill.boundaries" in lines[0] and str(path) in lines[0]


def test_cli_as_module(tmp_path: Path) -> None:
    bad = write(tmp_path, "[scheduler]\npolicy = \"lifo\"\n")
    run = subprocess.run([sys.executable, "-m", "bucketserve.buckets", "check", str(bad)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 2
    assert "scheduler.policy" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    ok = subprocess.run([sys.executable, "-m", "bucketserve.buckets", "check"],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0
    assert tomllib.loads(ok.stdout) == DOCUMENTED_DEFAULTS


# ----------------------------------------------------------------------------- bucket arithmetic
SPECS = [(16, 32, 64, 128), (1,), (3, 7, 8, 100)]


def brute_lookup(bounds: tuple[int, ...], n: int) -> int | None:
    fits = [b for b in bounds if b >= n]
    return min(fits) if fits else None


@pytest.mark.parametrize("bounds", SPECS)
def test_lookup_index_padded_len(bounds: tuple[int, ...]) -> None:
    spec = BucketSpec(bounds)
    assert len(spec) == len(bounds) and list(spec) == list(bounds) and spec.max_len == bounds[-1]
    for n in range(0, bounds[-1] + 5):
        expected = brute_lookup(bounds, n)
        assert spec.lookup(n) == expected, n
        if expected is None:
            assert spec.index(n) is None
            assert spec.padded_len(n) == n  # above the last bucket: unpadded
        else:
            assert bounds[spec.index(n)] == expected
            assert spec.padded_len(n) == expected >= n


@pytest.mark.parametrize("bounds", SPECS)
def test_profiles_tile_lengths(bounds: tuple[int, ...]) -> None:
    spec = BucketSpec(bounds)
    profiles = spec.profiles()
    assert len(profiles) == len(bounds)
    assert profiles[0][0] == 1
    for i, (low, opt, high) in enumerate(profiles):
        assert (opt, high) == (bounds[i], bounds[i])
        assert low == (bounds[i - 1] + 1 if i else 1)
        assert spec.profile(i) == (low, opt, high)
        # Every length in [low, high] maps to this bucket, and only those.
        assert all(spec.index(n) == i for n in range(low, high + 1))
    covered = [n for low, _, high in profiles for n in range(low, high + 1)]
    assert covered == list(range(1, bounds[-1] + 1))
    with pytest.raises(IndexError):
        spec.profile(len(bounds))
    with pytest.raises(IndexError):
        spec.profile(-1)


@pytest.mark.parametrize("bad", [[], [0, 4], [4, 4], [8, 4], [1, True], [2.0]])
def test_bucket_spec_rejects_bad_boundaries(bad: list) -> None:
    with pytest.raises(ValueError):
        BucketSpec(bad)


def test_lookup_rejects_negative_length() -> None:
    with pytest.raises(ValueError):
        BucketSpec([4]).lookup(-1)


def test_padding_counter() -> None:
    counter = PaddingCounter()
    assert (counter.computed, counter.useful, counter.waste) == (0, 0, 0.0)
    spec = BucketSpec([16, 32, 64])
    batches = [[3, 16], [20], [64, 33, 1], [70]]  # 70 is above the last bucket: no padding
    computed = useful = 0
    for lengths in batches:
        padded = spec.padded_len(max(lengths)) * len(lengths)  # pad the batch to its longest
        counter.add(padded, sum(lengths))
        computed += padded
        useful += sum(lengths)
    assert (counter.computed, counter.useful) == (computed, useful)
    assert math.isclose(counter.waste, 1 - useful / computed)
    assert 0 < counter.waste < 1
    counter.add(10, 10)  # no padding in this batch: waste falls
    assert counter.waste < 1 - useful / computed
    with pytest.raises(ValueError):
        counter.add(4, 5)
    with pytest.raises(ValueError):
        counter.add(4, -1)
    counter.reset()
    assert (counter.computed, counter.useful, counter.waste) == (0, 0, 0.0)


def test_buckets_config_fields() -> None:
    names = [f.name for f in dataclasses.fields(BucketsConfig)]
    assert names[:15] == ["prefill_boundaries", "piecewise_sizes", "decode_batch_sizes",
                          "max_running", "max_batched_tokens", "max_waiting", "queue_timeout_s",
                          "policy", "max_prefill_share", "async_scheduling", "block_size",
                          "cpu_memory_gib", "gpu_memory_fraction", "prefix_caching", "embedding"]


def test_round_up_batch_size() -> None:
    sizes = tuple(DOCUMENTED_DEFAULTS["decode"]["batch_sizes"])
    for n in range(1, sizes[-1] + 3):
        assert round_up_batch_size(n, sizes) == brute_lookup(sizes, n), n
    assert round_up_batch_size(sizes[-1] + 1, sizes) is None
    with pytest.raises(ValueError):
        round_up_batch_size(0, sizes)


def test_fused_kernels_takes_only_its_modes(tmp_path: Path) -> None:
    for mode in ("auto", "off", "tanh-gelu"):
        config = load_buckets(write(tmp_path, f'[embedding]\nfused_kernels = "{mode}"\n'))
        assert config.embedding.fused_kernels == mode
    for bad in ('"on"', "true"):
        with pytest.raises(ConfigError, match="embedding.fused_kernels.*expected one of"):
            load_buckets(write(tmp_path, f"[embedding]\nfused_kernels = {bad}\n"))
