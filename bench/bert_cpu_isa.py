"""The CPU encoder's forward at online batch shapes, with the packed GEMM and with F.linear, in
one process per setting: natively or with PyTorch's, oneDNN's and MKL's kernels held to AVX2,
and the packed GEMM auto (the plan's measurement) / mkl / onednn. Median of 12 forwards (ms) per shape.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python bench/bert_cpu_isa.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
SHAPES = ((1, 40), (1, 120), (3, 100), (3, 160), (4, 200))
SETTINGS = (("avx2", "auto"), ("avx2", "mkl"), ("avx2", "onednn"), ("native", "auto"))


def one(gemm: str) -> None:
    import torch

    from bucketserve.kernels.cpu_plan import resolve_cpu_plan
    from bucketserve.models import llama
    from bucketserve.models.bert import _Linear
    from bucketserve.models.bert_loader import load_embedding_model

    model = load_embedding_model("all-minilm-l6-v2").model
    used = llama.packed_gemm_backend()
    if gemm != "auto":  # re-packed for the GEMM asked for (the plan's [cpu] gemm)
        w = next(p for p in model.parameters() if p.dim() == 2)
        used = llama.pack_linear_weights(model, w, resolve_cpu_plan(gemm=gemm)).gemm
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, packed GEMM "
          f"{used}, threads {torch.get_num_threads()}")
    for mode in ("packed", "F.linear"):
        if mode == "F.linear":
            for sub in model.modules():
                if isinstance(sub, _Linear):
                    sub.max_packed_rows = 0
        row = []
        for b, length in SHAPES:
            ids = torch.randint(1000, 2000, (b, length))
            mask = torch.ones(b, length, dtype=torch.bool)
            model(ids, mask)
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                model(ids, mask)
                times.append(time.perf_counter() - t0)
            row.append(f"{b}x{length} {statistics.median(times) * 1e3:.1f}")
        print(f"  {mode:8s} " + " | ".join(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: its GEMM
    a = ap.parse_args()
    if a.one:
        one(a.one)
        return
    lines = []
    for isa, gemm in SETTINGS:
        env = dict(os.environ, **(AVX2 if isa == "avx2" else {}))
        out = subprocess.run([sys.executable, __file__, "--one", gemm], env=env, check=True,
                             capture_output=True, text=True).stdout
        lines.append(f"isa {isa}, gemm {gemm}: {out}")
        print(lines[-1], end="", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(lines)


if __name__ == "__main__":
    main()
