#!/usr/bin/env python3
"""The default front end against every explicit one: `bucketserve serve` with no
--api-workers (auto: sized from the device and the cores) and with --api-workers N, served
under the same closed-loop load, medians of --reps timed runs each (issue 28, must-show 4).

For each model and each setting a fresh server (prefix caching off: the runs repeat prompts,
no embeddings) gets a warm-up, then --reps timed runs of `bucketserve bench` (streaming
completions, ignore_eos; the workload of the H200 comparisons: --num-requests requests,
prompts loguniform:16:1024 token ids, max_tokens uniform:16:256, seed 0). Per run: output
tok/s, TTFT p50, the client's ITL p50, the client's tokens per token event, the server's
SSE tokens per event and the engine's median step time (both from /metrics scraped before
and after the run). The verdict per model: auto's tok/s / the best explicit setting's
(>= 0.95 asked), auto's ITL p50 / engine step p50 (<= 1.5) and tokens per event (<= 1.5).

GPU (random weights of real shapes, from SmolLM2's tokenizer/config in --tok):
    PYTHONPATH=. python bench/frontend_sizing.py --device cuda --tok DIR \\
        --shapes smollm2-135m,llama-1b --out $OUT/frontend_sizing_h200.json
CPU dry run (a registry model, tiny settings):
    PYTHONPATH=. python bench/frontend_sizing.py --device cpu --model smollm2-135m-instruct \\
        --settings auto,1,2 --streams 16 --num-requests 32 --output-len 24 --prompt-len \\
        uniform:16:64 --reps 1 --warmup 4 --client-workers 1 --out /tmp/frontend_sizing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frontend_capacity import free_port, machine

HERE = Path(__file__).resolve().parent
SHAPES = {  # Llama-3.2-1B's shape with SmolLM2's 49,152-token vocabulary
    "smollm2-135m": {},
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}
KEYS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "engine_step_p50_ms",
        "client_tokens_per_event", "server_tokens_per_event")


def make_model(tok: str, shape: str, device: str, directory: Path) -> str:
    """A random-weight model of `shape` with SmolLM2's tokenizer (no weights travel)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(tok):
        if os.path.isfile(os.path.join(tok, f)):
            shutil.copy(os.path.join(tok, f), directory)
    cfg = LlamaConfig.from_pretrained(directory)
    cfg.update(SHAPES[shape])
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(directory)
    return str(directory)


class Server:
    def __init__(self, model: str, device: str, setting: str, workdir: Path,
                 pythonpath: str | None) -> None:
        self.port = free_port()
        buckets = workdir / "buckets.toml"
        buckets.write_text("[kv_cache]\nprefix_caching = false\n" +
                           ("cpu_memory_gib = 1.0\n" if device == "cpu" else ""))
        flags = [] if setting == "auto" else ["--api-workers", setting]
        cmd = [sys.executable, "-c",
               # bench.hooks: the plain server unless BUCKETSERVE_FAKE_RUNNER / _FAKE_CORE
               # are set (then their stand-ins: docs/frontend.md's fake-device runs)
               "import sys; from bucketserve.bench.hooks import main; sys.exit(main())",
               "serve", "--port", str(self.port), "--model", model, "--device", device,
               "--buckets", str(buckets), "--embedding-model", "none", *flags]
        self.log_path = workdir / f"server_{setting}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        # cwd: the work directory, so that `-c` (which puts the cwd first on sys.path) imports
        # bucketserve from PYTHONPATH, not from wherever this script was started
        self.proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, limit_s: float) -> None:
        import httpx

        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"server not ready after {limit_s} s")

    def front_end_line(self) -> str | None:
        m = re.search(r"front end: .*", self.log_path.read_text(errors="replace"))
        return m.group(0) if m else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench(server: Server, a: argparse.Namespace, out: Path, warmup: int) -> dict:
    cmd = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url",
           f"http://127.0.0.1:{server.port}", "--concurrency", str(a.streams),
           "--workers", str(a.client_workers), "--warmup", str(warmup), "--seed", "0",
           "--out", str(out)]
    cmd += (["--workload", a.workload] if a.workload else
            ["--num-requests", str(a.num_requests), "--prompt-len", a.prompt_len,
             "--output-len", a.output_len])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.run_limit_s)
    if done.returncode != 0:
        raise RuntimeError(f"bench failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    r = json.loads(out.read_text())
    srv = r.get("server") or {}
    return {"output_tok_s": r["output_throughput"], "ttft_p50_ms": r["ttft_ms"]["p50"],
            "itl_p50_ms": r["itl_ms"]["p50"], "itl_p90_ms": r["itl_ms"]["p90"],
            "engine_step_p50_ms": srv.get("engine_step_ms_p50"),
            "client_tokens_per_event": r["tokens_per_token_event"],
            "server_tokens_per_event": srv.get("sse_tokens_per_event"),
            "errors": r["errors"], "engine": r.get("engine"), "header": done.stdout.split(
                "\n", 2)[:2]}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def verdict(settings: dict[str, dict]) -> dict:
    explicit = {s: m for s, m in settings.items() if s != "auto" and m["output_tok_s"]}
    auto = settings.get("auto")
    if not explicit or auto is None:
        return {}
    best = max(explicit, key=lambda s: explicit[s]["output_tok_s"])
    step, itl = auto["engine_step_p50_ms"], auto["itl_p50_ms"]
    return {"best_explicit": best, "best_output_tok_s": explicit[best]["output_tok_s"],
            "auto_vs_best": auto["output_tok_s"] / explicit[best]["output_tok_s"],
            "auto_itl_p50_over_step_p50": itl / step if step else None,
            "auto_client_tokens_per_event": auto["client_tokens_per_event"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--tok", help="SmolLM2's tokenizer/config directory (random-weight shapes)")
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b",
                    help=f"with --tok: comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--model", help="instead of --tok/--shapes: one model as `serve` takes it")
    ap.add_argument("--settings", default="auto,2,4,8",
                    help="'auto' (no --api-workers flag) and explicit --api-workers values")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--prompt-len", default="loguniform:16:1024")
    ap.add_argument("--output-len", default="uniform:16:256")
    ap.add_argument("--workload", help="a `bucketserve bench --workload` file instead")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=64, help="requests before the timed runs")
    ap.add_argument("--client-workers", type=int, default=4)
    ap.add_argument("--server-pythonpath", default=None,
                    help="PYTHONPATH of the servers (e.g. another checkout: before / after); "
                         "default: this process's")
    ap.add_argument("--ready-limit-s", type=float, default=900.0)
    ap.add_argument("--run-limit-s", type=float, default=900.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "frontend_sizing.json"))
    a = ap.parse_args()
    if not a.model and not a.tok:
        ap.error("give --tok DIR (random-weight shapes) or --model")
    settings = a.settings.split(",")
    info = {**machine(), "usable_cores": len(os.sched_getaffinity(0))}
    results: dict = {"machine": info, "config": vars(a), "models": {}}
    with tempfile.TemporaryDirectory(prefix="fesize-") as tmp:
        models = ({a.model: a.model} if a.model else
                  {s: make_model(a.tok, s, a.device, Path(tmp) / s) for s in a.shapes.split(",")})
        for name, model in models.items():
            per: dict = {}
            for setting in settings:
                work = Path(tmp) / f"{name.replace('/', '_')}_{setting}"
                work.mkdir()
                server = Server(model, a.device, setting, work, a.server_pythonpath)
                try:
                    server.wait_ready(a.ready_limit_s)
                    runs = [bench(server, a, work / f"r{i}.json", a.warmup if i == 0 else 0)
                            for i in range(a.reps)]
                finally:
                    server.stop()
                    log = server.log_path.read_text(errors="replace")
                core = re.findall(r"core loop: .*", log)
                per[setting] = {**{k: median(runs, k) for k in KEYS},
                                "front_end": server.front_end_line(), "runs": runs,
                                "core_loop": core[-1] if core else None}
                m = per[setting]
                print(f"{name} {setting:>4}: {m['output_tok_s']:9,.0f} tok/s  TTFT p50 "
                      f"{m['ttft_p50_ms']:7.1f} ms  ITL p50 {m['itl_p50_ms']:6.2f} ms  "
                      f"engine step p50 {m['engine_step_p50_ms'] or float('nan'):6.2f} ms  "
                      f"tokens/event client {m['client_tokens_per_event']:.3f} server "
                      f"{m['server_tokens_per_event'] or float('nan'):.3f}  "
                      f"errors {sum(r['errors'] for r in runs)}  [{m['front_end']}]",
                      flush=True)
            results["models"][name] = {"settings": per, "verdict": verdict(per)}
            v = results["models"][name]["verdict"]
            if v:
                print(f"{name}: auto {v['auto_vs_best']:.3f}x the best explicit "
                      f"(--api-workers {v['best_explicit']}, {v['best_output_tok_s']:,.0f} "
                      f"tok/s); auto ITL p50 / engine step p50 "
                      f"{v['auto_itl_p50_over_step_p50'] or float('nan'):.2f}; tokens per event "
                      f"{v['auto_client_tokens_per_event']:.3f}", flush=True)
    results["measured_unix"] = time.time()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
