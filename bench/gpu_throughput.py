"""GPU throughput and decode step time of bucketserve, with the transformers peers in the same run.

Workload: the seeded 256-request mix of ../shared/bench/hf_peers_gpu.py (same seed, same
random calls: prompt lengths log-uniform 16..1024 as random token ids, max_tokens uniform
16..256, EOS ignored, all requests at t=0), dummy bf16 weights, shapes SmolLM2-135M and
Llama-3.2-1B. bucketserve runs through LLMEngine.generate (scheduler, runner, sampler,
outputs), after a 16-request warm-up, as the vLLM peer script does. Like the peers (vLLM with
detokenize=False, transformers returning ids), it returns token ids without text
(SamplingParams.detokenize=False); `--detokenize` turns text on (a word-level tokenizer over
the model's vocabulary, which takes the window detokenizer, the slow path).

    python3 bench/gpu_throughput.py --out $OUT [--peers PATH/hf_peers_gpu.py]
        [--vllm PATH/vllm_peer_gpu.py] [--profile] [--detokenize]

Also: decode step time (runner.run of a pure-decode batch, host work included) at batch
1/8/64/256 with context 512, graphs on and off, beside the bytes-moved lower bound
(weights + KV read, over the device-to-device copy bandwidth measured in the same run).
The peers script runs as a subprocess (PROBE_ONLY selects its runs) so its numbers come
from the same machine, one after the other.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import math
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from bucketserve.buckets import load_buckets  # noqa: E402
from bucketserve.engine.llm_engine import LLMEngine  # noqa: E402
from bucketserve.engine.scheduler import ScheduledBatch  # noqa: E402
from bucketserve.engine.sequence import SamplingParams, Sequence  # noqa: E402
from bucketserve.models.config import ModelConfig  # noqa: E402
from bucketserve.models.loader import LoadedModel, build_dummy_model  # noqa: E402
from bucketserve.models.tokenizer import Tokenizer  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, vocab_size=49152),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, head_dim=64, vocab_size=128256),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=128256),  # Llama-3.1-8B, tied
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=4096),  # CPU smoke runs only
}
MAX_MODEL_LEN = 2048  # as the vLLM peer; prompts <= 1024 + 256 new tokens


def mixed_workload(vocab: int, n: int = 256, seed: int = 0) -> list[tuple[list[int], int]]:
    """The peers' request mix; one Random(seed) drawn in the same order (per request: the
    log-length, then max_tokens, then the prompt's token ids), so the requests are equal."""
    rng = random.Random(seed)
    lo, hi = math.log(16), math.log(1024)
    out = []
    for _ in range(n):
        length = int(round(math.exp(rng.uniform(lo, hi))))
        max_tokens = rng.randint(16, 256)
        out.append(([rng.randrange(100, vocab - 1) for _ in range(length)], max_tokens))
    return out


def word_tokenizer(vocab: int) -> Tokenizer:
    """A word-level tokenizer over `vocab` ids (token i is "w{i}"; id 2 is EOS, ignored here)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, eos_token="w2")


def make_engine(shape: str, device: str, dtype: torch.dtype, cuda_graphs: bool,
                tokenizer: Tokenizer, fused_ops: bool = True,
                max_batched_tokens: int | None = None, tmp_dir: str = "/tmp",
                piecewise: bool = True, async_scheduling: bool | None = None) -> LLMEngine:
    cfg = ModelConfig(**SHAPES[shape], max_position_embeddings=MAX_MODEL_LEN, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
    model = build_dummy_model(cfg, device, dtype, seed=0)
    model.fused_ops = fused_ops  # before the graphs are captured
    loaded = LoadedModel(model, tokenizer, cfg, shape, MAX_MODEL_LEN)
    path = None  # the default TOML, or it with a larger step token budget
    if max_batched_tokens:
        path = Path(tmp_dir) / f"buckets_{max_batched_tokens}.toml"
        path.write_text(f"[scheduler]\nmax_batched_tokens = {max_batched_tokens}\n")
    buckets = load_buckets(str(path) if path else None, max_model_len=MAX_MODEL_LEN)
    return LLMEngine(loaded, buckets, device, cuda_graphs=cuda_graphs, piecewise_graphs=piecewise,
                     async_scheduling=async_scheduling)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kind_summary(steps) -> dict[str, dict]:
    """Engine step stats grouped by step kind (prefill / mixed / decode)."""
    kinds: dict[str, dict] = {}
    for s in steps:
        k = kinds.setdefault(s.kind, {"steps": 0, "seconds": 0.0, "seqs": 0, "tokens": 0})
        k["steps"] += 1
        k["seconds"] += s.step_time_s
        k["seqs"] += s.num_seqs
        k["tokens"] += s.computed_tokens
    return kinds


def ntok_first(outs) -> int:
    return sum(o.num_output_tokens for o in outs)


def run_bucketserve(engine: LLMEngine, reqs, device: str, profile: bool = False,
                    repeats: int = 3, detokenize: bool = False) -> dict:
    """Times generate() over the whole workload; with `profile`, runs it a second time under
    cProfile (host hot spots; the timed run is not profiled)."""
    params = [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True, detokenize=detokenize)
              for _, t in reqs]
    prompts = [p for p, _ in reqs]
    engine.generate(prompts[:16], params[:16])  # warm-up, as the vLLM peer does
    steps_before = engine.stats.num_steps
    for k in engine.runner.step_timing:
        engine.runner.step_timing[k] = 0.0
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    dt = time.perf_counter() - t0
    steps = list(engine.stats.recent)[steps_before - engine.stats.num_steps:]
    timing = dict(engine.runner.step_timing)
    repeat_tok_s, repeat_kinds = [], []
    for _ in range(repeats - 1):  # the same run again: run-to-run spread
        t1 = time.perf_counter()
        n_before = engine.stats.num_steps
        again = engine.generate(prompts, params)
        sync(device)
        repeat_tok_s.append(sum(o.num_output_tokens for o in again) / (time.perf_counter() - t1))
        repeat_kinds.append(kind_summary(list(engine.stats.recent)[n_before - engine.stats.num_steps:]))
    all_tok_s = [ntok_first(outs) / dt, *repeat_tok_s]
    prof = None
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(prompts, params)
        prof.disable()
    ntok = sum(o.num_output_tokens for o in outs)
    kinds = kind_summary(steps)
    res = dict(system="bucketserve", seconds=dt, out_tok_s=sorted(all_tok_s)[len(all_tok_s) // 2],
               first_out_tok_s=ntok / dt, all_out_tok_s=all_tok_s,
               generated_tokens=ntok,
               expected_tokens=sum(t for _, t in reqs), steps=len(steps), step_kinds=kinds,
               repeat_step_kinds=repeat_kinds,
               runner_timing=timing, graph_steps=engine.runner.num_graph_steps,
               engine_step_s=sum(s.step_time_s for s in steps))
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        res["profile_top"] = buf.getvalue()[-6000:]
    return res


def decode_batch(engine: LLMEngine, batch: int, context: int, vocab: int) -> ScheduledBatch:
    """`batch` sequences of `context` tokens whose first context-1 are in the pool: a pure
    decode step at position context-1 (runner.run does not advance them, so it repeats)."""
    bm = engine.block_manager
    seqs = []
    rng = random.Random(batch)
    for _ in range(batch):
        s = Sequence([rng.randrange(100, vocab - 1) for _ in range(context)],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        bm.allocate(s, context)
        s.num_computed_tokens = context - 1
        seqs.append(s)
    return ScheduledBatch(seqs, [1] * batch, batch, "decode", batch, 0, batch)


def step_times(engine: LLMEngine, batches: list[int], context: int, vocab: int,
               device: str, iters: int = 30) -> list[dict]:
    out = []
    for b in batches:
        batch = decode_batch(engine, b, context, vocab)
        for _ in range(3):
            engine.runner.run(batch)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            engine.runner.run(batch)  # ends in the sampler's device-to-host copy
        sync(device)
        ms = (time.perf_counter() - t0) / iters * 1e3
        for s in batch.seqs:
            engine.block_manager.free(s)
        out.append({"batch": b, "context": context, "step_ms": ms})
    return out


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB; bytes read + written over the median time."""
    x = torch.empty(2**29, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2**30 / sorted(times)[len(times) // 2] / 1e9


def bound_ms(shape: str, batch: int, context: int, bw_gbs: float) -> float:
    """(weights + KV read) bytes / bandwidth, bf16; the tied embedding is read once (lm_head)."""
    s = SHAPES[shape]
    h, i, layers, v = s["hidden_size"], s["intermediate_size"], s["num_layers"], s["vocab_size"]
    q, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    weights = 2 * (layers * per_layer + v * h)
    kv_read = 2 * layers * 2 * kv * context * batch
    return (weights + kv_read) / (bw_gbs * 1e9) * 1e3


def run_peers(path: str, out_dir: str, only: str) -> list[dict]:
    env = dict(os.environ, OUT=out_dir, PROBE_ONLY=only, HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                          timeout=560)
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"system"' in line:
            rows.append(json.loads(line))
    if proc.returncode:
        rows.append({"error": proc.stderr[-2000:]})
    return rows


def run_vllm(path: str, shape: str, out_dir: str) -> list[dict]:
    """../shared/bench/vllm_peer_gpu.py SHAPE in a subprocess (vLLM importable from the
    environment this script runs in)."""
    env = dict(os.environ, OUT=out_dir, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               VLLM_USE_FLASHINFER_SAMPLER="0")
    proc = subprocess.run([sys.executable, path, shape], env=env, capture_output=True, text=True,
                          timeout=560)
    rows = [json.loads(line) for line in proc.stdout.splitlines()
            if line.startswith("{") and '"system"' in line]
    if proc.returncode or not rows:
        rows.append({"system": "vllm", "model": shape, "error": proc.stderr[-3000:]})
    return rows


def run_mode(res: dict, shape: str, mode: str, device: str, dtype: torch.dtype, tok, reqs,
             batches: list[int], args, bw: float | None) -> None:
    """mode: graphs | eager, + "_unfused" (no fused Triton ops) / "_2k" (2048-token steps; the
    default "auto" budget is 8192 on CUDA) / "_nopiece" (decode graphs only: prefill and
    mixed steps eager) / "_sync" (overlapped scheduling off: each step resolved before the
    next is scheduled)."""
    vocab = SHAPES[shape]["vocab_size"]
    t0 = time.perf_counter()
    engine = make_engine(shape, device, dtype, mode.startswith("graphs"), tok,
                         fused_ops="unfused" not in mode,
                         max_batched_tokens=2048 if mode.endswith("_2k") else None,
                         tmp_dir=tempfile.gettempdir(), piecewise="_nopiece" not in mode,
                         async_scheduling=False if "_sync" in mode else None)
    start_s = time.perf_counter() - t0
    r = run_bucketserve(engine, reqs, device, profile=args.profile and mode == "graphs",
                        repeats=args.repeats, detokenize=args.detokenize)
    r.update(piecewise_steps=engine.runner.num_piecewise_steps)
    r.update(async_scheduling=engine.async_scheduling)
    r.update(model=shape, mode=mode, detokenize=args.detokenize, startup_s=start_s, cuda_info=engine.cuda_info,
             kv_blocks=engine.block_manager.num_usable_blocks)
    prof = r.pop("profile_top", None)
    print(json.dumps(r), flush=True)
    if prof:
        print(prof, flush=True)
        r["profile_top"] = prof
    res["runs"].append(r)
    if mode.endswith("_2k") or not batches:
        return  # same decode graphs as "graphs": no separate step times
    for st in step_times(engine, batches, 512, vocab, device):
        st.update(model=shape, mode=mode)
        if device == "cuda":
            st["bound_ms"] = bound_ms(shape, st["batch"], 512, bw)
        res["step_times"].append(st)
        print(json.dumps(st), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--modes", default="graphs,graphs_nopiece,graphs_2k,eager,graphs_unfused",
                    help="graphs / eager: decode graphs on / off; _unfused: no fused Triton ops; "
                         "_sync: overlapped scheduling off")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs; out_tok_s = median")
    ap.add_argument("--profile", action="store_true", help="cProfile the graphs run")
    ap.add_argument("--peers", default=None, help="path of hf_peers_gpu.py to run after ours")
    ap.add_argument("--peers-only", default="hf_static_bs64,hf_continuous,hf_continuous_graphs")
    ap.add_argument("--vllm", default=None, help="path of vllm_peer_gpu.py, run per shape first")
    ap.add_argument("--detokenize", action="store_true", help="bucketserve returns text too")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    res: dict = {"env": {"torch": torch.__version__, "argv": sys.argv[1:]}, "runs": [],
                 "step_times": []}
    bw = None
    if device == "cuda":
        res["env"]["gpu"] = torch.cuda.get_device_name()
        res["env"]["copy_bw_gbs"] = bw = copy_bandwidth_gbs()
    out_json = Path(args.out) / "gpu_throughput.json"

    def save() -> None:
        out_json.write_text(json.dumps(res, indent=1))

    batches = [int(b) for b in args.batches.split(",") if b]
    if args.vllm:  # before ours: its start-up holds most of the GPU memory, then exits
        for shape in args.shapes.split(","):
            for row in run_vllm(args.vllm, shape, args.out):
                res["runs"].append(row)
                print(json.dumps(row)[:3000], flush=True)
            save()
    for shape in args.shapes.split(","):
        vocab = SHAPES[shape]["vocab_size"]
        tok = word_tokenizer(vocab)
        reqs = mixed_workload(vocab, n=args.requests)
        for mode in args.modes.split(","):
            try:
                run_mode(res, shape, mode, device, dtype, tok, reqs, batches, args, bw)
            except Exception as e:  # keep the other modes and the peers
                import traceback

                res["runs"].append({"model": shape, "mode": mode, "error": repr(e)[:500],
                                    "tb": traceback.format_exc()[-1500:]})
                print(res["runs"][-1], flush=True)
            save()
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.peers:
        for row in run_peers(args.peers, args.out, args.peers_only):
            row.pop("tb", None)
            res["runs"].append(row)
            print(json.dumps(row)[:600], flush=True)
            save()
    # summary table
    print("\nmodel         mode    out tok/s (median of runs; bucketserve)   seconds (first run)")
    for r in res["runs"]:
        if "out_tok_s" in r:
            print(f"{r.get('model', '?'):13s} {r.get('mode', r.get('system', '?')):28s} "
                  f"{r['out_tok_s']:10.0f} {r['seconds']:8.2f}")
    print("\nmodel         mode    batch  step ms  bound ms")
    for s in res["step_times"]:
        print(f"{s['model']:13s} {s['mode']:14s} {s['batch']:5d} {s['step_ms']:8.3f} "
              f"{s.get('bound_ms', float('nan')):8.3f}")
    save()


if __name__ == "__main__":
    main()
