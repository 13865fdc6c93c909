"""Offline throughput on a shared workload: bucketserve vs transformers static batching.

Both run the same weights (SmolLM2-135M-Instruct from the GGUF, dequantized to fp32) in
the same process, one after the other, on the same prompts with EOS ignored, so each
request yields exactly its max_tokens. Transformers runs batches of 16 in arrival order
with left padding; each batch runs to its longest max_tokens. Output tokens/s counts the
tokens the requests asked for (sum of max_tokens) over wall time.

    .venv/bin/python bench/offline_throughput.py [--workload ../shared/workloads/mixed.jsonl]

`--prefix-caching-ab N` instead measures the host cost of prefix caching on this workload
(random prompts: nothing to share, so caching can only cost): bucketserve alone, caching off
and on alternately, N runs each in one process, and the ratio of the medians.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bucketserve sets it; before torch loads

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.models import load_model
from bucketserve.models.registry import resolve

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "workloads" / "mixed.jsonl"


def load_workload(path: Path, tokenizer, limit: int | None) -> list[tuple[list[int], int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit:
        rows = rows[:limit]
    out = []
    for r in rows:
        ids = tokenizer.encode(r["prompt"], add_special_tokens=False)
        out.append((ids, int(r["max_tokens"])))
    return out


def run_bucketserve(requests, buckets_path: str | None, loaded=None,
                    prefix_caching: bool | None = None, overlap: bool | None = None) -> dict:
    loaded = loaded or load_model("smollm2-135m-instruct", dtype=torch.float32)
    buckets = load_buckets(buckets_path, max_model_len=loaded.max_model_len)
    if prefix_caching is not None:
        buckets = dataclasses.replace(buckets, prefix_caching=prefix_caching)
    engine = LLMEngine(loaded, buckets, async_scheduling=overlap)
    host = _time_cache_calls(engine.block_manager) if prefix_caching else None
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in requests]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate([ids for ids, _ in requests], params)
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    n_out = sum(o.num_output_tokens for o in outs)
    assert n_out == sum(m for _, m in requests), "every request must yield exactly max_tokens"
    s = engine.stats
    steps = list(s.recent)
    return {
        "system": "bucketserve",
        "async_scheduling": engine.async_scheduling,
        "seconds": round(elapsed, 2),
        "output_tokens": n_out,
        "output_tokens_per_s": round(n_out / elapsed, 1),
        # CPU seconds of this process (all threads): what the run cost, whatever else the
        # machine was doing; output tokens per CPU second x the cores is the unshared rate
        "cpu_seconds": round(cpu_s, 2),
        "output_tokens_per_cpu_s": round(n_out / cpu_s, 2),
        "padding_waste": round(s.padding_waste, 4),
        "computed_tokens": s.computed_tokens_total,
        "useful_tokens": s.useful_tokens_total,
        "steps": s.num_steps,
        "preemptions": s.preemptions_total,
        "mean_batch": round(sum(x.num_seqs for x in steps) / max(1, len(steps)), 1),
        "prefix_caching": engine.block_manager.enable_caching,
        "prefix_cache_hit_tokens": s.prefix_cache_hits_total,
        **({"prefix_cache_host_s": round(host[0], 4)} if host else {}),
    }


def _time_cache_calls(bm) -> list[float]:
    """Wraps the block manager's caching-only work (lookup, with the hashing it does, and
    cache_computed) to add up its host time; returns the one-element running total."""
    total = [0.0]
    for name in ("lookup", "cache_computed"):
        fn = getattr(bm, name)

        def timed(seq, _fn=fn):
            t0 = time.perf_counter()
            try:
                return _fn(seq)
            finally:
                total[0] += time.perf_counter() - t0

        setattr(bm, name, timed)
    return total


def prefix_caching_ab(requests, buckets_path: str | None, repeats: int) -> dict:
    """Caching off and on, alternately (off, on, off, on, ...), same process and model."""
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(repeats):
        for caching in (False, True):
            r = run_bucketserve(requests, buckets_path, loaded, prefix_caching=caching)
            r["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
            print(json.dumps(r), flush=True)
            runs[caching].append(r)
    med = {c: statistics.median(r["output_tokens_per_s"] for r in runs[c]) for c in runs}
    cpu = {c: statistics.median(r["cpu_seconds"] for r in runs[c]) for c in runs}
    host = statistics.median(r["prefix_cache_host_s"] for r in runs[True])
    return {"off": runs[False], "on": runs[True],
            "median_tokens_per_s_off": med[False], "median_tokens_per_s_on": med[True],
            "ratio_on_over_off": round(med[True] / med[False], 4),
            "median_cpu_s_off": cpu[False], "median_cpu_s_on": cpu[True],
            "cpu_ratio_on_over_off": round(cpu[True] / cpu[False], 4),
            "median_prefix_cache_host_s": host,
            "prefix_cache_host_share_of_wall": round(
                host / statistics.median(r["seconds"] for r in runs[True]), 6)}


def run_hf_static(requests, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    entry = resolve("smollm2-135m-instruct")
    path = Path(entry.path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return time_hf_static(model, requests, batch_size)


def time_hf_static(model, requests, batch_size: int) -> dict:
    """transformers static batching: batches of `batch_size` requests in arrival order, left
    padded to the longest prompt, every row generating the batch's largest max_tokens."""
    model.eval()
    pad = 0
    computed = useful = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        chunk = requests[start : start + batch_size]
        longest = max(len(ids) for ids, _ in chunk)
        max_new = max(m for _, m in chunk)
        input_ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for i, (ids, _) in enumerate(chunk):
            input_ids[i, longest - len(ids) :] = torch.tensor(ids)
            mask[i, longest - len(ids) :] = 1
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=pad)
        computed += len(chunk) * (longest + max_new)
        useful += sum(len(ids) + m for ids, m in chunk)
    elapsed = time.perf_counter() - t0
    n_out = sum(m for _, m in requests)
    return {
        "system": f"transformers static generate (batch {batch_size}, left padding)",
        "seconds": round(elapsed, 2),
        "output_tokens": n_out,
        "output_tokens_per_s": round(n_out / elapsed, 1),
        "padding_waste": round(1 - useful / computed, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests")
    ap.add_argument("--buckets", default=None, help="buckets TOML (default: the shipped one)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--prefix-caching-ab", type=int, default=0, metavar="N",
                    help="instead: caching off vs on, N runs each, alternately (host cost)")
    ap.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                    help="overlapped scheduling (default: the TOML's scheduler.async_scheduling)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "offline_throughput.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    tokenizer = load_model("smollm2-135m-instruct").tokenizer
    requests = load_workload(args.workload, tokenizer, args.limit)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads")
    if args.prefix_caching_ab:
        ab = prefix_caching_ab(requests, args.buckets, args.prefix_caching_ab)
        result = {"workload": str(args.workload.name), "requests": len(requests),
                  "machine": machine, **ab}
        print(f"median output tokens/s: caching on {ab['median_tokens_per_s_on']}, off "
              f"{ab['median_tokens_per_s_off']}: ratio {ab['ratio_on_over_off']}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    ours = run_bucketserve(requests, args.buckets, overlap=overlap)
    ours["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # other work on the machine skews both
    print(json.dumps(ours), flush=True)
    result = {"workload": str(args.workload.name), "requests": len(requests),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads",
              "bucketserve": ours}
    if not args.skip_hf:
        peer = run_hf_static(requests, args.hf_batch)
        peer["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
        print(json.dumps(peer), flush=True)
        result["transformers_static"] = peer
        result["ratio"] = round(ours["output_tokens_per_s"] / peer["output_tokens_per_s"], 2)
        print(f"bucketserve {ours['output_tokens_per_s']} tok/s vs transformers static "
              f"{peer['output_tokens_per_s']} tok/s: {result['ratio']}x; bucketserve padding waste "
              f"{ours['padding_waste']:.1%} (transformers {peer['padding_waste']:.1%})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
