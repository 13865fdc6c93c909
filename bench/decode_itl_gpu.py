"""The decode step as served: bucketserve vs vLLM at a fixed batch and context, one GPU, one command.

`gpu_8b.py` times `runner.run` of one decode batch again and again: host input building,
the graph, sampling and the device-to-host copy run one after another. The engine does not
serve that way: with async scheduling the next step is built and launched while the current
one runs. This script measures the step inside each engine's own generation loop, the same
way for both systems: for a batch of B fresh random prompts of P tokens (fresh per run, so
that no prefix cache helps), generate T tokens with EOS ignored, and separately 1 token on
other fresh prompts of the same length; the decode step is (t_T - t_1) / (T - 1), at a mean
context of P + T / 2. Medians of `--repeats` runs after a warm-up of each shape. For
bucketserve it also prints the mean wall time of its pure decode steps at batch B from the
engine's step statistics. The byte floor is gpu_throughput.bound_ms (weights + KV read once
over the measured copy bandwidth).

    PYTHONPATH=. python3 bench/decode_itl_gpu.py --out DIR [--shape llama-8b] [--batches 1,256]
        [--prompt 448] [--tokens 128] [--repeats 3] [--mode graphs|nogemv|...] [--vllm-site DIR]

vLLM runs first, in a subprocess (bench/vllm_itl_peer.py with that site on PYTHONPATH, prefix
caching off). Writes DIR/decode_itl_MODE.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(batch)]


def itl(gen, batch: int, length: int, tokens: int, vocab: int, repeats: int,
        seed0: int) -> dict:
    """gen(prompts, max_tokens) -> seconds. Decode step from T-token and 1-token runs."""
    gen(prompts(batch, length, vocab, seed0), tokens)  # warm-up at this shape
    gen(prompts(batch, length, vocab, seed0 + 1), 1)
    steps, t_ones, t_fulls = [], [], []
    for r in range(repeats):
        t1 = gen(prompts(batch, length, vocab, seed0 + 10 + 2 * r), 1)
        tt = gen(prompts(batch, length, vocab, seed0 + 11 + 2 * r), tokens)
        t_ones.append(t1)
        t_fulls.append(tt)
        steps.append((tt - t1) / (tokens - 1) * 1e3)
    return {"batch": batch, "prompt": length, "tokens": tokens, "context": length + tokens // 2,
            "step_ms": statistics.median(steps), "all_step_ms": steps,
            "t_one_s": t_ones, "t_full_s": t_fulls}


def run_ours(args, vocab: int) -> list[dict]:
    import gpu_8b
    import gpu_throughput as gt
    import torch

    from bucketserve.engine.sequence import SamplingParams

    engine = gpu_8b.make_engine(args.shape, "auto", args.mode, tempfile.mkdtemp())
    bw = gt.copy_bandwidth_gbs()
    rows = []

    def gen(ps, max_tokens):
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                 detokenize=False) for _ in ps]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(ps, params)
        torch.cuda.synchronize()
        assert sum(o.num_output_tokens for o in outs) == max_tokens * len(ps)
        return time.perf_counter() - t0

    for b in [int(x) for x in args.batches.split(",")]:
        n0 = engine.stats.num_steps
        row = itl(gen, b, args.prompt, args.tokens, vocab, args.repeats, seed0=1000 * b)
        steps = list(engine.stats.recent)[n0 - engine.stats.num_steps:]
        full = [s.step_time_s for s in steps if s.kind == "decode" and s.num_seqs == b]
        row["engine_decode_step_ms"] = statistics.mean(full) * 1e3 if full else None
        row["bound_ms"] = gt.bound_ms(args.shape, b, row["context"], bw)
        row["ratio"] = row["step_ms"] / row["bound_ms"]
        row["system"] = "bucketserve"
        row["mode"] = args.mode
        row["gemv"] = engine.cuda_info.get("gemv")
        row["copy_bw_gbs"] = bw
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_vllm(args) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0",
               PYTHONPATH=os.pathsep.join(p for p in (args.vllm_site, str(ROOT / "bench"))
                                          if p))
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_itl_peer.py"), args.shape, args.batches,
           str(args.prompt), str(args.tokens), str(args.repeats)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.vllm_timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "timeout", -1
    rows = [json.loads(x) for x in out.splitlines() if x.startswith('{"batch"')]
    if rc or not rows:
        rows.append({"system": "vllm", "error": err[-3000:]})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--prompt", type=int, default=448)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="graphs", help="bucketserve configuration: gpu_8b.MODES")
    ap.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE", ""))
    ap.add_argument("--vllm-timeout", type=float, default=400.0)
    args = ap.parse_args()
    import gpu_throughput as gt

    vocab = gt.SHAPES[args.shape]["vocab_size"]
    res: dict = {"argv": sys.argv[1:], "vllm": [], "ours": []}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.vllm_site:
        res["vllm"] = run_vllm(args)
    res["ours"] = run_ours(args, vocab)
    import torch

    res["gpu"] = torch.cuda.get_device_name()
    (Path(args.out) / f"decode_itl_{args.mode}.json").write_text(json.dumps(res, indent=1))
    print("\nbatch  context  bucketserve ms  vLLM ms  floor ms  ours/floor  vLLM/floor")
    for o in res["ours"]:
        v = [x for x in res["vllm"] if x.get("batch") == o["batch"]]
        vm = v[0]["step_ms"] if v else float("nan")
        print(f"{o['batch']:5d}  {o['context']:7d}  {o['step_ms']:14.2f}  {vm:7.2f}  "
              f"{o['bound_ms']:8.2f}  {o['ratio']:10.2f}  {vm / o['bound_ms']:10.2f}"
              f"   (engine's own decode steps: {o['engine_decode_step_ms']})")


if __name__ == "__main__":
    main()
