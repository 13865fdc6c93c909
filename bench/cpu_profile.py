"""Where the time goes on the CPU: the engine on a workload, split by component.

Every component is timed around its call (wall clock and process CPU time, all threads), and
split by step kind (steps with prompt tokens vs pure decode steps):

  prefill_attention   causal attention of the prompt chunks (the C kernel, or SDPA)
  decode_attention    paged decode attention (the C kernel, or the torch path)
  kv_write            K/V into the pool (with the C kernels: rotary + K/V write)
  norms, silu_mul     the C kernels' RMSNorm (+ residual add) and SiLU-and-mul
  projections         q/k/v, o, gate/up, down GEMMs (Linear.forward)
  model_other         the rest of the forward: embedding, Python; without the C kernels also
                      norms, rotary, SiLU, residual adds
  lm_head             compute_logits
  sampler             token selection
  prepare             the runner's input building
  engine_other        scheduler, output processing / detokenization, stats (step - runner.launch)

    .venv/bin/python bench/cpu_profile.py --workload ../shared/workloads/mixed.jsonl [--threads 2] \
        [--cpu-isa avx2] [--cpu-gemm onednn] [--no-c-kernels]

--cpu-isa forces a lower instruction set as `bucketserve serve --cpu-isa` does (torch, oneDNN,
MKL and the C kernels held to it; kernels/cpu_plan.py).

Also prints the machine's sgemm rate at the step shapes and its memory bandwidth, so the
component times can be read against what the machine can do.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.kernels import attention, cpu_decode, cpu_plan
from bucketserve.models import llama, load_model

ROOT = Path(__file__).resolve().parent.parent
# ../shared beside the checkout (or two levels up, from a git worktree under wt/)
SHARED = next((p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()),
              ROOT.parent / "shared")


class Clock:
    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.kind = "decode"
        self.stack: list[str] = []

    def wrap(self, name: str, fn, kind: str | None = None):
        def timed(*a, **k):
            key = f"{kind or self.kind}:{name}"
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.wall[key] += time.perf_counter() - t0
                self.cpu[key] += time.process_time() - c0
        return timed


def cpu_features() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    keep = ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "avx512_vnni"]
    return " ".join(f for f in keep if f in flags)


def cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def machine_rates() -> dict:
    """sgemm GFLOP/s of each packed GEMM backend (oneDNN, MKL; the model uses the CPU plan's)
    at the model's shapes, with the process's thread count, and the copy bandwidth of a
    512 MiB buffer (about the weights' size)."""
    def best(f, n=5):
        f()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return min(ts)

    out = {}
    backends = [b for b, ok in (("onednn", cpu_plan.onednn_packing_available()),
                                ("mkl", cpu_plan.mkl_packing_available())) if ok]
    for backend in backends:
        for rows in (16, 64, 512, 2048):
            for o, i in ((960, 576), (3072, 576), (576, 1536)):
                x, w = torch.randn(rows, i), torch.randn(o, i)
                p = cpu_plan.pack_weight(backend, w)
                t = best(lambda: cpu_plan.packed_linear(backend, x, p, w, None))  # noqa: B023
                out[f"{backend}_sgemm_{rows}x{i}x{o}_gflops"] = round(2 * rows * o * i / t / 1e9, 1)
    a = torch.ones(2**27)
    b = torch.empty_like(a)
    t = best(lambda: b.copy_(a))
    out["copy_gb_s"] = round(2 * a.numel() * 4 / t / 1e9, 1)
    t = best(lambda: a.sum())
    out["read_gb_s"] = round(a.numel() * 4 / t / 1e9, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=SHARED / "workloads" / "mixed.jsonl")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-rates", action="store_true")
    ap.add_argument("--cpu-isa", default="auto", help="[cpu] isa (auto, avx512, avx2, baseline)")
    ap.add_argument("--cpu-gemm", default="auto", help="[cpu] gemm (auto, onednn, mkl)")
    ap.add_argument("--no-c-kernels", action="store_true", help="[cpu] c_kernels = false")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # before torch, oneDNN or MKL first dispatch (as `bucketserve serve --cpu-isa` does)
    os.environ.update(cpu_plan.isa_environment(args.cpu_isa))
    plan = cpu_plan.resolve_cpu_plan(args.cpu_isa, args.cpu_gemm, args.threads,
                                     not args.no_c_kernels)
    load0 = os.getloadavg()[0]
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    rows = [json.loads(x) for x in args.workload.read_text().splitlines() if x.strip()]
    rows = rows[: args.limit] if args.limit else rows
    reqs = [(loaded.tokenizer.encode(r["prompt"], add_special_tokens=False), int(r["max_tokens"]))
            for r in rows]
    engine = LLMEngine(loaded, load_buckets(None, max_model_len=loaded.max_model_len), cpu=plan)
    plan = engine.runner.cpu_plan
    print(plan.describe(), flush=True)
    clk = Clock()
    attention._prefill_attention = clk.wrap("prefill_attention", attention._prefill_attention)
    cpu_decode.paged_prefill = clk.wrap("prefill_attention", cpu_decode.paged_prefill)
    cpu_decode.paged_decode = clk.wrap("decode_attention", cpu_decode.paged_decode)
    attention._decode_attention = clk.wrap("decode_attention", attention._decode_attention)
    attention.write_kv = clk.wrap("kv_write", attention.write_kv)
    llama.Linear.forward = clk.wrap("projections", llama.Linear.forward)
    llama._linear = clk.wrap("projections", llama._linear)  # the C-kernel forward's GEMMs
    cpu_decode.rope_write_kv = clk.wrap("kv_write", cpu_decode.rope_write_kv)  # + rotary
    cpu_decode.rms_norm = clk.wrap("norms", cpu_decode.rms_norm)
    cpu_decode.silu_mul = clk.wrap("silu_mul", cpu_decode.silu_mul)
    model = loaded.model
    model.forward = clk.wrap("model_forward", model.forward)
    model.compute_logits = clk.wrap("lm_head", model.compute_logits)
    r = engine.runner
    r.sampler.sample = clk.wrap("sampler", r.sampler.sample)
    r.inputs.fill = clk.wrap("prepare", r.inputs.fill)  # the input building (host side)
    run = clk.wrap("runner_run", r.launch)  # the engine steps through launch (+ result)
    step = engine.step

    def kind_step():
        clk.kind = "unknown"  # runner.launch sets the step's kind once the batch is known
        return step()

    def run_kind(batch):
        clk.kind = "decode" if batch.num_decodes == len(batch.seqs) else "prefill"
        return run(batch)

    r.launch = run_kind
    engine.step = clk.wrap("step", kind_step, kind="all")
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in reqs]
    # warm-up (kernel build, first-call costs) on two short requests, not counted
    engine.generate([reqs[0][0][:16]] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    clk.wall.clear()
    clk.cpu.clear()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate([ids for ids, _ in reqs], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_out = sum(o.num_output_tokens for o in outs)
    n_prompt = sum(len(ids) for ids, _ in reqs)
    # step time is counted under the kind of the step's batch for runner parts, and under
    # "unknown" for the whole step: split the step's engine-side remainder proportionally
    table = {}
    for kind in ("prefill", "decode"):
        def g(name, d, kind=kind):
            return d.get(f"{kind}:{name}", 0.0)
        for d, label in ((clk.wall, "wall"), (clk.cpu, "cpu")):
            fwd = g("model_forward", d)
            parts = {n: g(n, d) for n in ("prefill_attention", "decode_attention", "kv_write",
                                          "projections", "norms", "silu_mul", "lm_head",
                                          "sampler", "prepare")}
            parts["model_other"] = fwd - sum(parts[n] for n in (
                "prefill_attention", "decode_attention", "kv_write", "projections", "norms",
                "silu_mul"))
            parts["runner_run"] = g("runner_run", d)
            table[f"{kind}_{label}"] = {k: round(v, 3) for k, v in parts.items()}
    step_wall = clk.wall.get("all:step", 0.0)
    run_wall = sum(clk.wall.get(f"{k}:runner_run", 0.0) for k in ("prefill", "decode"))
    result = {
        "workload": args.workload.name, "requests": len(reqs), "prompt_tokens": n_prompt,
        "output_tokens": n_out, "wall_s": round(wall, 2), "process_cpu_s": round(cpu, 2),
        "output_tok_s": round(n_out / wall, 1), "torch_threads": torch.get_num_threads(),
        "steps": engine.stats.num_steps, "gemm_backend": plan.gemm, "cpu": cpu_model(),
        "cpu_flags": cpu_features(), "cpu_plan": plan.describe(),
        "decode_kernel": cpu_decode.build_info(),
        "engine_other_wall_s": round(step_wall - run_wall, 3),
        "outside_step_wall_s": round(wall - step_wall, 3),
        "load_avg_1m_start": round(load0, 2), "components": table,
    }
    if not args.no_rates:
        result["machine"] = machine_rates()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
