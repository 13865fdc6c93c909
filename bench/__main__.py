"""The benchmarks' one entry point, from the repository root:

    python -m bench LIST            # every script, grouped by what it measures (bench/README.md)
    python -m bench NAME [ARGS...]  # runs bench/NAME.py (or NAME.sh) with ARGS

A Python script runs in this interpreter (runpy) as `python bench/NAME.py ARGS` would run it:
named `__main__`, with its own directory first on the path (for the scripts that import a
sibling's functions); a shell script runs under bash."""

from __future__ import annotations

import ast
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (group, scripts): the sections of bench/README.md, in its order (tests/test_docs.py checks
# that every script of bench/ is here once and in its section of the README)
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Served LLM (HTTP)", (
        "online_gpu_vs_vllm.sh", "summarize_online.py", "cpu_vs_vllm.py", "cpu_vs_llamacpp.py",
        "online_split.py",
        "long_prompt_ttft.py", "chat_workload.py", "chat_gpu_vs_vllm.sh", "bucket_tuning.py",
        "structured_gpu.py", "structured_gpu_vs_vllm.sh", "structured_schemas.py", "ray_gpu.sh", "ray_overhead_cpu.sh",
        "ray_stream_cpu.py")),
    ("Offline engine", (
        "offline_throughput.py", "offline_workload.py", "gpu_throughput.py", "gpu_8b.py",
        "decode_itl_gpu.py", "vllm_itl_peer.py", "cpu_profile.py", "fp8_accuracy_gpu.py",
        "cpu_quant_accuracy.py", "make_random_model.py")),
    ("Kernels", ("attention_gpu.py", "fp8_attention_gpu.py", "fp8_rows_gpu.py", "fp8_split_gpu.py",
                 "fp8_pdl_gpu.py", "fp8_gemm_gpu.py", "fp8_silu_gpu.py", "gemm_gpu.py", "bert_fused_gpu.py",
                 "cpu_quant_kernels.py")),
    ("Host cost and the front end", (
        "frontend_capacity.py", "frontend_sizing.py", "embeddings_frontend.py",
        "core_overhead.py", "guided_host_cpu.py", "guided_chain_cpu.py", "guided_launch_gpu.py",
        "xgrammar_gil_cpu.py",
        "grammar_fill_cpu.py", "ipc_microbench.py", "client_capacity.py")),
    ("Embeddings", (
        "embeddings_offline.py", "embeddings_online.py", "bert_cpu_isa.py", "embeddings_gpu.py",
        "embeddings_gpu_vs_vllm.sh", "embeddings_gpu_host_phases.py", "embedding_slo_sweep.py",
        "issue15_h200.sh")),
    ("Reliability", ("overload.py", "soak.py")),
    ("The GPU machine", ("gpu_assets.sh", "gpu_setup.sh", "h200_pending.sh",
                         "vllm_parts.sh")),
    ("The code itself", ("loc.py", "before_after_cpu.py")),
)


def summary(path: Path) -> str:
    """The first line of a script's docstring (a shell script's first comment)."""
    text = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
    else:
        doc = next((line.lstrip("# ") for line in text.splitlines()[1:]
                    if line.startswith("#")), "")
    return doc.strip().splitlines()[0] if doc.strip() else ""


def list_scripts() -> None:
    for group, scripts in GROUPS:
        print(f"{group}:")
        for name in scripts:
            print(f"  {name.rsplit('.', 1)[0]:30} {summary(HERE / name)}")


def script_path(name: str) -> Path | None:
    """bench/NAME.py or bench/NAME.sh for NAME as LIST prints it (a suffix is accepted)."""
    known = {s for _, scripts in GROUPS for s in scripts}
    for candidate in (name, f"{name}.py", f"{name}.sh"):
        if candidate in known:
            return HERE / candidate
    return None


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] in ("LIST", "list"):
        list_scripts()
        return 0
    path = script_path(argv[0])
    if path is None:
        print(f"python -m bench: error: no script {argv[0]!r} (python -m bench LIST names them)",
              file=sys.stderr)
        return 2
    if path.suffix == ".sh":
        os.execvp("bash", ["bash", str(path), *argv[1:]])
    sys.argv = [str(path), *argv[1:]]
    sys.path.insert(0, str(HERE))  # what `python bench/NAME.py` puts first
    runpy.run_path(str(path), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
