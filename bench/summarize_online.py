#!/usr/bin/env python3
"""Medians of the runs written by bench/online_gpu_vs_vllm.sh: one line per (system, concurrency),
then the ratios bucketserve / vLLM and online / offline.

    python3 bench/summarize_online.py OUT_DIR SHAPE [--json FILE]
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys


def main() -> int:
    out, shape = sys.argv[1], sys.argv[2]
    table: dict[tuple[str, int], dict] = {}
    for path in sorted(glob.glob(os.path.join(out, f"*_{shape}_c*_r*.json"))):
        m = re.match(rf"(\w+)_{re.escape(shape)}_c(\d+)_r(\d+)\.json", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            r = json.load(f)
        table.setdefault((m.group(1), int(m.group(2))), {"runs": []})["runs"].append(r)
    summary: dict = {"shape": shape, "rows": []}
    for (system, c), row in sorted(table.items()):
        runs = row["runs"]

        def med(key: str, pct: str | None = None, runs: list = runs) -> float | None:
            vals = [r[key][pct] if pct else r[key] for r in runs]
            vals = [v for v in vals if v is not None]
            return statistics.median(vals) if vals else None

        rec = {"system": system, "concurrency": c, "runs": len(runs),
               "output_tok_s": med("output_throughput"),
               "output_tok_s_all": [r["output_throughput"] for r in runs],
               "ttft_p50_ms": med("ttft_ms", "p50"), "ttft_p99_ms": med("ttft_ms", "p99"),
               "itl_p50_ms": med("itl_ms", "p50"), "itl_p99_ms": med("itl_ms", "p99"),
               "tpot_p50_ms": med("tpot_ms", "p50"),
               "errors": sum(r["errors"] for r in runs),
               "completed": [r["completed"] for r in runs]}
        summary["rows"].append(rec)
        print(f"{shape} {system:8s} C={c:<4d} out {rec['output_tok_s']:9.0f} tok/s  "
              f"TTFT p50/p99 {rec['ttft_p50_ms']:7.0f}/{rec['ttft_p99_ms']:7.0f} ms  "
              f"ITL p50/p99 {rec['itl_p50_ms']:6.1f}/{rec['itl_p99_ms']:6.1f} ms  "
              f"errors {rec['errors']}  runs {[round(x) for x in rec['output_tok_s_all']]}")
    by = {(r["system"], r["concurrency"]): r for r in summary["rows"]}
    off_path = os.path.join(out, f"offline_{shape}.json")
    offline = None
    if os.path.exists(off_path):
        with open(off_path) as f:
            offline = json.load(f)["median_output_tok_s"]
        summary["offline_output_tok_s"] = offline
        print(f"{shape} ours offline (same requests, ids only): {offline:.0f} tok/s")
    # "ours" pairs with "vllm", "ours_fp8" with "vllm_fp8" (the script's LABEL_SUFFIX)
    for (system, c), ours in sorted(by.items()):
        if not system.startswith("ours"):
            continue
        suffix, vllm = system[4:], by.get(("vllm" + system[4:], c))
        if vllm:
            ratio = ours["output_tok_s"] / vllm["output_tok_s"]
            summary[f"ratio_vs_vllm{suffix}_c{c}"] = ratio
            print(f"{shape}{suffix} C={c}: bucketserve / vLLM output tok/s {ratio:.2f}x; ITL p50 "
                  f"{ours['itl_p50_ms']:.1f} vs {vllm['itl_p50_ms']:.1f} ms; TTFT p50 "
                  f"{ours['ttft_p50_ms']:.0f} vs {vllm['ttft_p50_ms']:.0f} ms")
        if offline and not suffix:
            summary[f"online_over_offline_c{c}"] = ours["output_tok_s"] / offline
            print(f"{shape} C={c}: online / offline {ours['output_tok_s'] / offline:.2f}")
    with open(os.path.join(out, f"summary_{shape}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
