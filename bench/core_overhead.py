#!/usr/bin/env python3
"""The engine's host cost per step, offline and served, with the model taken out.

The engine runs with the fake runner (engine/fake_runner.py): every step does all of its
host work (scheduling, input buffers, token stops, outputs, the core's messages) but no
forward and no sampling. So the CPU time the engine spends per step here is what a GPU step
of a small model waits on the host for (with overlapped scheduling the slower of host and
device sets the pace). Measured on the same requests (1,024 by default: token-id prompts of
16..1024 tokens log-uniform, max_tokens 16..256 uniform, EOS ignored, greedy, seed 0):

  offline  `LLMEngine.generate` on every request at once, in a child process: CPU s / steps;
           also two parts of it per step: StepInputs.fill and Scheduler.schedule;
  served   `bucketserve serve` (engine core in its own process, --api-workers N) under
           `bucketserve bench` at --streams concurrent streams: the core process's CPU s
           (from /proc) / its steps (from /metrics). The fake device takes --served-step-s a
           step, so that the running batch fills as on a GPU while the front end keeps up.

With --profile the served core of the first --api-workers value also runs under cProfile
(BUCKETSERVE_CORE_PROFILE) in an extra run, and its top functions are reported.

    PYTHONPATH=. python bench/core_overhead.py --code before=/tmp/core_before --code after=$PWD \\
        --rounds 2 --profile --out bench/results/core_overhead_cpu.json

Each --code NAME=PYTHONPATH is a checkout; rounds interleave them (offline, served w1, w2),
so a change in the machine's load hits all alike: compare within one run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# GPU-like scheduling: the CUDA step budget, overlapped scheduling, no prefix cache (the
# timed runs repeat prompts); a small real KV pool (the fake runner brings its own blocks)
BUCKETS = ("[scheduler]\nmax_running = 256\nmax_batched_tokens = 8192\n"
           "async_scheduling = true\n[kv_cache]\ncpu_memory_gib = 0.25\nprefix_caching = false\n")


def machine() -> dict:
    model, flags = None, []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in have]
    return {"cpu_model": model, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0], "loadavg_start": os.getloadavg()}


def workload_args(a: argparse.Namespace) -> list[str]:
    return ["--num-requests", str(a.num_requests), "--prompt-len", a.prompt_len,
            "--output-len", a.output_len, "--prompt-kind", "ids", "--seed", str(a.seed)]


# ---- offline (child process, so that each checkout runs its own code) -------------------------


def offline_child(a: argparse.Namespace) -> None:
    from bucketserve.bench.workload import generate
    from bucketserve.engine.fake_runner import install
    from bucketserve.engine.llm_engine import LLMEngine
    from bucketserve.engine.sequence import SamplingParams

    reqs = generate(a.num_requests, a.prompt_len, a.output_len, seed=a.seed, prompt_kind="ids")
    engine = LLMEngine.from_names(a.model, buckets_path=a.buckets, device="cpu")
    fake = install(engine, a.step_s)
    # two parts of the host work, timed apart: StepInputs.fill (the fake runner's prepare)
    # and Scheduler.schedule
    sched, schedule = engine.scheduler, engine.scheduler.schedule
    schedule_s = [0.0]

    def timed_schedule():
        t = time.perf_counter()
        batch = schedule()
        schedule_s[0] += time.perf_counter() - t
        return batch

    sched.schedule = timed_schedule
    prompts = [r.prompt for r in reqs]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                             detokenize=False) for r in reqs]
    engine.generate(prompts[:16], params[:16])  # warm-up
    prof = None
    if a.offline_profile:
        import cProfile

        prof = cProfile.Profile()
    s0, tok0 = engine.stats.num_steps, engine.stats.computed_tokens_total
    steps0 = dict(engine.stats.bucket_steps)
    fake.step_timing["prepare_s"] = schedule_s[0] = 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = engine.generate(prompts, params)
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.offline_profile)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = engine.stats.num_steps - s0
    ntok = sum(len(o.token_ids) for o in outs)
    kinds: dict[str, int] = {}
    for (kind, b), n in engine.stats.bucket_steps.items():
        kinds[kind] = kinds.get(kind, 0) + n - steps0.get((kind, b), 0)
    print(json.dumps({"steps": steps, "wall_s": wall, "cpu_s": cpu, "output_tokens": ntok,
                      "computed_tokens": engine.stats.computed_tokens_total - tok0,
                      "kinds": kinds, "fill_s": fake.step_timing["prepare_s"],
                      "schedule_s": schedule_s[0]}))


def run_offline(path: str, a: argparse.Namespace, buckets: str, profile: str | None,
                step_s: float = 0.0) -> dict:
    cmd = [sys.executable, __file__, "--offline-child", "--buckets", buckets, "--model", a.model,
           "--step-s", str(step_s), *workload_args(a)]
    if profile:
        cmd += ["--offline-profile", profile]
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if p.returncode != 0:
        raise RuntimeError(f"offline run failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    out = summarize(r["steps"], r["cpu_s"], r["wall_s"], r["output_tokens"], r["computed_tokens"],
                    r["kinds"])
    out["fill_us_per_step"] = 1e6 * r["fill_s"] / r["steps"]
    out["schedule_us_per_step"] = 1e6 * r["schedule_s"] / r["steps"]
    return out


def summarize(steps: int, cpu_s: float, wall_s: float, out_tokens: float,
              computed: float, kinds: dict[str, float]) -> dict:
    return {"steps": steps, "cpu_s": cpu_s, "wall_s": wall_s, "output_tokens": out_tokens,
            "steps_by_kind": {k: int(v) for k, v in sorted(kinds.items())},
            "host_us_per_step": 1e6 * cpu_s / steps, "steps_per_s": steps / wall_s,
            "host_us_per_token": 1e6 * cpu_s / max(out_tokens, 1),
            "mean_tokens_per_step": computed / steps, "loadavg": os.getloadavg()}


# ---- served --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_served(path: str, a: argparse.Namespace, buckets: str, workers: int, tmp: str,
               profile: str | None) -> dict:
    import httpx
    import psutil

    port = free_port()
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               BUCKETSERVE_FAKE_RUNNER=str(a.served_step_s))
    if profile:
        env["BUCKETSERVE_CORE_PROFILE"] = profile
    log_path = Path(tmp) / f"server_{port}.log"
    cmd = [sys.executable, "-c", "import sys; from bucketserve.bench.hooks import main; "
           "sys.exit(main())", "serve", "--port", str(port), "--buckets", buckets,
           "--model", a.model, "--embedding-model", "none", "--api-workers", str(workers)]
    # cwd: not a checkout (`python -c` / `-m` put the cwd first on sys.path, before PYTHONPATH)
    proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        m = re.search(r"engine core ready in process (\d+)", log_path.read_text())
        core = psutil.Process(int(m.group(1)))

        def core_cpu() -> float:
            t = core.cpu_times()
            return t.user + t.system

        def core_threads() -> dict[str, float]:
            """CPU s of the core's main thread (the loop) and of its other threads (ZeroMQ's
            I/O thread, torch's pools), user + system."""
            main = other = 0.0
            for th in core.threads():
                if th.id == core.pid:
                    main += th.user_time + th.system_time
                else:
                    other += th.user_time + th.system_time
            return {"main": main, "other": other}

        def steps() -> tuple[float, float]:
            text = httpx.get(base + "/metrics", timeout=10).text
            kinds: dict[str, float] = {}
            for m in re.finditer(r'^bucketserve_bucket_steps_total\{[^}]*kind="(\w+)"[^}]*\} '
                                 r'([0-9.e+]+)$', text, re.M):
                kinds[m.group(1)] = kinds.get(m.group(1), 0) + float(m.group(2))
            return (metric(text, "bucketserve_engine_steps_total"),
                    metric(text, "bucketserve_computed_tokens_total"), kinds)

        bench = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url", base,
                 "--concurrency", str(a.streams), "--workers", str(a.client_workers)]
        subprocess.run([*bench, *workload_args(a), "--limit", "64"], env=env, check=True,
                       capture_output=True, cwd=tmp)  # warm-up
        s0, k0, kinds0 = steps()
        th0 = core_threads()
        c0, t0 = core_cpu(), time.perf_counter()
        out = Path(tmp) / f"bench_{port}.json"
        p = subprocess.run([*bench, *workload_args(a), "--out", str(out)], env=env,
                           capture_output=True, text=True, cwd=tmp)
        wall, cpu = time.perf_counter() - t0, core_cpu() - c0
        if p.returncode != 0:
            raise RuntimeError(f"bench failed:\n{p.stderr[-3000:]}")
        th1 = core_threads()
        s1, k1, kinds1 = steps()
        r = json.loads(out.read_text())
        res = summarize(int(s1 - s0), cpu, wall, r["output_throughput"] * r["duration_s"], k1 - k0,
                        {k: kinds1[k] - kinds0.get(k, 0) for k in kinds1})
        res["core_main_thread_cpu_s"] = th1["main"] - th0["main"]
        res["core_other_threads_cpu_s"] = th1["other"] - th0["other"]
        res.update(output_tok_s=r["output_throughput"], errors=r["errors"],
                   itl_p50_ms=r["itl_ms"]["p50"], ttft_p50_ms=r["ttft_ms"]["p50"])
        return res
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def top_costs(path: str, n: int = 25) -> list[str]:
    s = io.StringIO()
    st = pstats.Stats(path, stream=s)
    st.sort_stats("tottime").print_stats(n)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return lines[start:start + n + 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", action="append", default=None,
                    help="NAME=PYTHONPATH of a checkout (repeatable; default: this one)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--prompt-len", default="loguniform:16:1024")
    ap.add_argument("--output-len", default="uniform:16:256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--api-workers", default="1 2")
    ap.add_argument("--client-workers", type=int, default=1)
    ap.add_argument("--served-step-s", type=float, default=0.01,
                    help="the fake device's step time in the served runs")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile the served core (extra run)")
    ap.add_argument("--skip-served", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--buckets", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-kind", default="ids", help=argparse.SUPPRESS)
    ap.add_argument("--offline-profile", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.offline_child:
        offline_child(a)
        return 0
    codes = [c.split("=", 1) for c in (a.code or [f"this={HERE.parent}"])]
    workers = [int(w) for w in a.api_workers.split()]
    info = machine()
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name, _ in codes}
    profiles: dict[str, dict[str, list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="coreoh-") as tmp:
        buckets = os.path.join(tmp, "buckets.toml")
        Path(buckets).write_text(BUCKETS)
        for rnd in range(a.rounds):
            for name, path in codes:
                # offline twice: at host speed, and with the served runs' fake device step
                # (each step then waits as a served step does, with the same cold caches)
                kinds = [("offline", None), ("offline_dev", 0)] + (
                    [] if a.skip_served else [(f"served_w{w}", w) for w in workers])
                for kind, w in kinds:
                    r = (run_offline(path, a, buckets, None, 0.0 if w is None else a.served_step_s)
                         if not w else run_served(path, a, buckets, w, tmp, None))
                    runs[name].setdefault(kind, []).append(r)
                    extra = (f"  {r['output_tok_s']:8,.0f} tok/s ITL p50 {r['itl_p50_ms']:.1f} ms"
                             f"  core loop thread {1e6 * r['core_main_thread_cpu_s'] / r['steps']:.0f}"
                             f" us/step, other threads "
                             f"{1e6 * r['core_other_threads_cpu_s'] / r['steps']:.0f}"
                             if "core_main_thread_cpu_s" in r else "")
                    if "fill_us_per_step" in r:
                        extra += (f"  (fill {r['fill_us_per_step']:.0f}, schedule "
                                  f"{r['schedule_us_per_step']:.0f} us/step)")
                    extra += f"  {r['steps_by_kind']}"
                    print(f"round {rnd} {name:>8} {kind:>10}: {r['host_us_per_step']:7.0f} host "
                          f"us/step  {r['host_us_per_token']:5.2f} us/token  "
                          f"{r['mean_tokens_per_step']:6.1f} tokens/step  {r['steps']:5d} steps  "
                          f"{r['steps_per_s']:6.0f} steps/s{extra}", flush=True)
        if a.profile:
            for name, path in codes:
                prof = os.path.join(tmp, f"{name}_offline.prof")
                run_offline(path, a, buckets, prof)
                profiles.setdefault(name, {})["offline"] = top_costs(prof)
                if not a.skip_served:
                    prof = os.path.join(tmp, f"{name}_served.prof")
                    run_served(path, a, buckets, workers[0], tmp, prof)
                    profiles[name][f"served_w{workers[0]}"] = top_costs(prof)
                for kind, lines in profiles[name].items():
                    print(f"\n== {name} {kind}: cProfile, top by own time ==")
                    print("\n".join(lines))
    summary = {}
    for name, kinds in runs.items():
        summary[name] = {k: {"host_us_per_step_median": statistics.median(
                                 r["host_us_per_step"] for r in rs),
                             "host_us_per_token_median": statistics.median(
                                 r["host_us_per_token"] for r in rs),
                             "mean_tokens_per_step": statistics.median(
                                 r["mean_tokens_per_step"] for r in rs),
                             **{f"{part}_us_per_step_median": statistics.median(
                                 r[f"{part}_us_per_step"] for r in rs)
                                for part in ("fill", "schedule") if f"{part}_us_per_step" in rs[0]}}
                         for k, rs in kinds.items()}
        off = summary[name].get("offline", {}).get("host_us_per_step_median")
        dev = summary[name].get("offline_dev", {}).get("host_us_per_step_median")
        for k, v in summary[name].items():
            if off and k != "offline":
                v["vs_offline_per_step"] = v["host_us_per_step_median"] / off
            if dev and k.startswith("served"):
                v["vs_offline_dev_per_step"] = v["host_us_per_step_median"] / dev
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": info, "config": vars(a), "buckets_toml": BUCKETS,
                       "runs": runs, "summary": summary, "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
