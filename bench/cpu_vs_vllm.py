"""CPU, one run: bucketserve vs vLLM's CPU build, served and offline, on the same weights.

Parts (all by default, in this order, one system at a time on the same machine):

  served   `bucketserve serve` and vLLM's OpenAI server (prefix caching off), each driven by
           the shared load client (../shared/bench/loadgen.py: streaming completions, closed
           loop at --concurrency, EOS ignored) on each workload, --runs times after a warm-up,
           the systems' runs interleaved (all servers up, one driven at a time); medians of
           output tokens/s. bucketserve variants (--systems bucketserve-inproc,...):
           `-inproc` the engine core in a thread of the server's process (--engine-in-process),
           `-t1` / `-t2` --cpu-threads 1 / 2 (vLLM's CPU build runs its model on one
           core and keeps the other for its front end), `-pin` BUCKETSERVE_CPU_AFFINITY=auto,
           `-mkl` --cpu-gemm mkl, `-spin` / `-nospin` GOMP_SPINCOUNT=10000 / 0
  offline  the engine alone (LLMEngine.generate, as bench/offline_throughput.py) vs vLLM's
           offline LLM.generate on the same token ids (prefix caching off), --offline-runs
           timed runs each after a warm-up
  hf       transformers static `generate` (batches of 16, left padding, as
           bench/offline_throughput.py) on mixed, offline in its own process (an upper bound
           for the same system behind HTTP)

--cpu-isa avx2 forces both systems onto AVX2 on an AVX-512 host: both servers get
ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS (torch's, oneDNN's and
MKL's limits; kernels/cpu_plan.isa_environment), bucketserve gets --cpu-isa avx2 (its C
kernels built for -march=x86-64-v3), and vLLM's processes see torch.cpu's AVX-512 / AMX
probes answer False (a sitecustomize on their PYTHONPATH), so that vLLM loads its
_C_AVX2 kernels, as it does on an AVX2-only machine. The JSON records the variables and
what each system's torch then reports.

Both systems load the same Hugging Face directory (the SmolLM2-135M-Instruct GGUF dequantized
to float32 by ../shared/bench/make_smollm2_hf.py), in float32. Records the CPU model and
flags, thread settings and the 1-minute load average before each part.

    .venv/bin/python bench/cpu_vs_vllm.py --hf-dir /tmp/peers/smollm2-hf \\
        --vllm-python /work/vllm-cpu-venv/bin/python --out bench/results/cpu_vs_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ../shared beside the checkout (or two levels up, from a git worktree under wt/)
SHARED = next((p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared") if p.is_dir()),
              ROOT.parent / "shared")
WORKLOADS = SHARED / "workloads"
LOADGEN = SHARED / "bench" / "loadgen.py"


def cpu_info() -> dict:
    model, flags = platform.processor(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
            "amx_tile", "amx_bf16")
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in keep if f in flags],
            "machine": platform.machine()}


# vLLM picks its C++ kernels (_C_AVX512 / _C_AVX2) and attention ISA from torch.cpu's
# hardware probes, which ignore ATEN_CPU_CAPABILITY: held to AVX2, its processes see them False
FORCE_AVX2_SITE = """import os
if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
    import torch.cpu
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported",
                 "_is_avx512_vnni_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        setattr(torch.cpu, name, lambda: False)
"""


def isa_env(args) -> dict:
    """The environment that holds both systems to --cpu-isa (empty: the host's own ISA)."""
    from bucketserve.kernels.cpu_plan import isa_environment

    return isa_environment(args.cpu_isa)


def peer_env(args=None, tmp: Path | None = None) -> dict:
    """vLLM runs in the caller's environment (bucketserve sets OMP_WAIT_POLICY=PASSIVE for
    itself on import; vLLM keeps its own thread settings), plus --cpu-isa's."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as bucketserve's cpu_memory_gib
    forced = isa_env(args) if args is not None else {}
    if forced and tmp is not None:
        site = tmp / "force_isa_site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(FORCE_AVX2_SITE)
        env["PYTHONPATH"] = str(site) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(forced)
    return env


ISA_PROBE = ("import json, torch; print(json.dumps({'torch_capability': "
             "torch.backends.cpu.get_cpu_capability(), 'torch_cpu_avx512': "
             "torch.cpu._is_avx512_supported()}))")


def isa_check(args, tmp: Path) -> dict:
    """What torch reports in each system's environment (the proof that --cpu-isa took)."""
    from bucketserve.kernels.cpu_plan import resolve_cpu_plan

    out = {}
    for name, python, env in (("bucketserve", sys.executable, {**os.environ, **isa_env(args)}),
                              ("vllm", args.vllm_python, peer_env(args, tmp))):
        p = subprocess.run([python, "-c", ISA_PROBE], env=env, capture_output=True, text=True,
                           check=True)
        out[name] = json.loads(p.stdout.strip().splitlines()[-1])
    os.environ.update(isa_env(args))  # this process resolves the plan bucketserve will run
    out["bucketserve"]["plan"] = resolve_cpu_plan(args.cpu_isa).describe()
    return out


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not healthy after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def loadgen(client_python: str, port: int, model: str, workload: Path, concurrency: int,
            out: Path, label: str, limit: int | None = None) -> dict:
    cmd = [client_python, str(LOADGEN), "--base-url", f"http://127.0.0.1:{port}", "--model", model,
           "--workload", str(workload), "--concurrency", str(concurrency),
           "--extra", '{"ignore_eos": true}', "--label", label, "--out", str(out)]
    if limit:
        cmd += ["--limit", str(limit)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def no_prefix_cache_toml(tmp: Path) -> Path:
    """A buckets file with prefix caching off (the defaults otherwise), for bucketserve."""
    path = tmp / "no_prefix_cache.toml"
    path.write_text("[kv_cache]\nprefix_caching = false\n")
    return path


def start_server(system: str, args, tmp: Path) -> tuple[subprocess.Popen, int, dict]:
    port = free_port()
    env = ({**os.environ, **isa_env(args)} if system.startswith("bucketserve")
           else peer_env(args, tmp))
    if system.startswith("bucketserve"):
        # the rounds repeat the same prompts and vLLM runs with its prefix cache off: ours off too
        cmd = [sys.executable, "-m", "bucketserve.server.cli", "serve", "--port", str(port),
               "--model", args.hf_dir, "--embedding-model", "none", "--dtype", "float32",
               "--log-level", "warning", "--buckets", str(no_prefix_cache_toml(tmp)),
               "--cpu-isa", args.cpu_isa]
        for variant in system.split("-")[1:]:
            if variant not in VARIANTS:
                raise SystemExit(f"unknown system {system!r}: variants are {sorted(VARIANTS)}")
            flags, extra_env = VARIANTS[variant]
            cmd += flags
            env.update(extra_env)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    else:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_dir,
               "--served-model-name", MODEL, "--dtype", "float32", "--port", str(port),
               "--no-enable-prefix-caching", "--max-model-len", "8192"]
    return launch(system, cmd, env, port, MODEL, args, tmp)


def launch(system: str, cmd: list[str], env: dict, port: int, model: str, args,
           tmp: Path) -> tuple[subprocess.Popen, int, dict]:
    """Starts `cmd` (a server on `port` answering to `model`, its log in tmp), waits for
    /health, then warms it up with `args.concurrency` short requests; (process, port,
    {command, start_s})."""
    t0 = time.perf_counter()
    with open(tmp / f"{system}_server.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(ROOT))
    info: dict = {"command": " ".join(cmd)}
    try:
        wait_health(f"http://127.0.0.1:{port}/health", proc, args.start_timeout)
        info["start_s"] = round(time.perf_counter() - t0, 1)
        # warm-up: the first requests pay one-time costs (kernel builds, allocator growth)
        loadgen(args.client_python, port, model, WORKLOADS / "short.jsonl", args.concurrency,
                tmp / f"{system}_warmup.json", "warmup", limit=args.concurrency)
    except BaseException:
        stop(proc)
        raise
    return proc, port, info


MODEL = "smollm2-hf"  # the served name both servers answer to

# bucketserve systems: "bucketserve" (defaults) plus "-VARIANT"s, e.g. "bucketserve-inproc-t1"
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "inproc": (["--engine-in-process"], {}),  # the engine core in a thread of the server
    "t1": (["--cpu-threads", "1"], {}),  # one compute thread (vLLM CPU's layout)
    "t2": (["--cpu-threads", "2"], {}),  # two compute threads
    "pin": ([], {"BUCKETSERVE_CPU_AFFINITY": "auto"}),  # engine and front end on their own cores
    "mkl": (["--cpu-gemm", "mkl"], {}),  # MKL's packed sgemm (before oneDNN)
    # OpenMP threads spin ~0.1 ms (10,000 spins) before they sleep, instead of sleeping at once
    "spin": ([], {"GOMP_SPINCOUNT": "10000"}),
    "nospin": ([], {"GOMP_SPINCOUNT": "0"}),  # sleep at once (OMP_WAIT_POLICY=PASSIVE alone)
}


def served(systems: list[str], args, workloads: list[Path], tmp: Path) -> dict:
    """All servers up at once (idle ones wait on their sockets), then the runs interleaved:
    for each run index, each workload, each system in turn, so that a change in the
    machine's load during the run falls on every system alike."""
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    out: dict = {}
    try:
        for system in systems:
            proc, port, info = start_server(system, args, tmp)
            servers[system] = (proc, port)
            out[system] = {**info, **{wl.stem: {"runs": []} for wl in workloads}}
        for r in range(args.runs):
            for wl in workloads:
                for system in systems:
                    la = load_avg()
                    s = loadgen(args.client_python, servers[system][1], MODEL, wl,
                                args.concurrency, tmp / f"{system}_{wl.stem}_{r}.json",
                                f"{system} {wl.stem} run {r}", limit=args.limit)
                    run = {"output_tok_s": round(s["output_throughput"], 1),
                           "duration_s": round(s["duration_s"], 2),
                           "errors": s["errors"], "completed": s["completed"],
                           "output_tokens": s["total_output_tokens"],
                           "expected_output_tokens": s["expected_output_tokens"],
                           "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1),
                           "itl_p50_ms": round(s["itl_ms"]["p50"], 1),
                           "tpot_p50_ms": round(s["tpot_ms"]["p50"], 1),
                           "load_avg_1m_start": la}
                    out[system][wl.stem]["runs"].append(run)
                    print(f"served {system} {wl.stem} run {r}: {run}", flush=True)
        for system in systems:
            for wl in workloads:
                runs = out[system][wl.stem]["runs"]
                out[system][wl.stem]["median_output_tok_s"] = statistics.median(
                    x["output_tok_s"] for x in runs)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return out


OFFLINE_OURS = r"""
import json, os, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.kernels import cpu_decode
from bucketserve.models import load_model
reqs = json.load(open(sys.argv[1])); runs = int(sys.argv[3])
loaded = load_model(sys.argv[2], dtype=torch.float32)
# the timed runs repeat the prompts and vLLM runs with prefix caching off: ours off too
engine = LLMEngine(loaded, load_buckets(sys.argv[5], max_model_len=loaded.max_model_len))
def go(rs):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in rs]
    t0 = time.perf_counter()
    outs = engine.generate([ids for ids, _ in rs], params)
    dt = time.perf_counter() - t0
    n = sum(o.num_output_tokens for o in outs)
    assert n == sum(m for _, m in rs)
    return n / dt, dt
go(reqs[:4])
res = []
for _ in range(runs):
    la = round(os.getloadavg()[0], 2)
    tps, dt = go(reqs)
    res.append({"output_tok_s": round(tps, 1), "seconds": round(dt, 2), "load_avg_1m_start": la})
    print("offline bucketserve", res[-1], file=sys.stderr, flush=True)
with open(sys.argv[4], "w") as f:
    json.dump({"runs": res, "torch_threads": torch.get_num_threads(),
               "cpu_kernels": cpu_decode.build_info()}, f)
"""

OFFLINE_VLLM = r"""
import json, os, sys, time


def main():
    from vllm import LLM, SamplingParams
    import vllm
    reqs = json.load(open(sys.argv[1])); runs = int(sys.argv[3])
    llm = LLM(model=sys.argv[2], dtype="float32", enable_prefix_caching=False, max_model_len=8192)

    def go(rs):
        prompts = [{"prompt_token_ids": ids} for ids, _ in rs]
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in rs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n == sum(m for _, m in rs), n
        return n / dt, dt

    go(reqs[:4])
    res = []
    for _ in range(runs):
        la = round(os.getloadavg()[0], 2)
        tps, dt = go(reqs)
        res.append({"output_tok_s": round(tps, 1), "seconds": round(dt, 2), "load_avg_1m_start": la})
        print("offline vllm", res[-1], file=sys.stderr, flush=True)
    with open(sys.argv[4], "w") as f:
        json.dump({"runs": res, "vllm_version": vllm.__version__}, f)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
"""


def offline(system: str, args, reqs_path: Path, tmp: Path) -> dict:
    script = tmp / f"offline_{system}.py"
    script.write_text(OFFLINE_OURS if system == "bucketserve" else OFFLINE_VLLM)
    python = sys.executable if system == "bucketserve" else args.vllm_python
    env = {**os.environ, **isa_env(args)} if system == "bucketserve" else peer_env(args, tmp)
    if system == "bucketserve":
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result = tmp / f"offline_{system}.json"
    with open(tmp / f"offline_{system}.log", "w") as log:
        subprocess.run([python, str(script), str(reqs_path), args.hf_dir, str(args.offline_runs),
                        str(result), str(no_prefix_cache_toml(tmp))], env=env, stdout=log,
                       stderr=subprocess.STDOUT, check=True, cwd=str(tmp))
    out = json.loads(result.read_text())
    out["median_output_tok_s"] = statistics.median(r["output_tok_s"] for r in out["runs"])
    print(f"offline {system}: {out['median_output_tok_s']} tok/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", default="/tmp/peers/smollm2-hf")
    ap.add_argument("--vllm-python", default="/work/vllm-cpu-venv/bin/python")
    ap.add_argument("--client-python", default=None,
                    help="python with aiohttp + numpy for the load client (default: --vllm-python)")
    ap.add_argument("--workloads", default="mixed,short")
    ap.add_argument("--parts", default="served,offline,hf")
    ap.add_argument("--systems", default="bucketserve,vllm")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--offline-runs", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests (smoke runs)")
    ap.add_argument("--cpu-isa", default="auto", choices=("auto", "avx512", "avx2", "baseline"),
                    help="hold both systems to this instruction set (see above)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_vs_vllm.json")
    ap.add_argument("--hf-worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--table", type=Path, default=None,
                    help="print the README table of a results JSON and exit")
    args = ap.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return
    if args.hf_worker:
        reqs = json.loads(args.hf_worker.read_text())
        print(json.dumps(run_hf_static_dir(reqs, args.hf_dir, 16)))
        return
    args.client_python = args.client_python or args.vllm_python
    parts = args.parts.split(",")
    systems = args.systems.split(",")
    workloads = [WORKLOADS / f"{w}.jsonl" for w in args.workloads.split(",")]
    import torch

    result: dict = {
        "cpu": cpu_info(), "load_avg_1m_at_start": load_avg(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "omp_wait_policy_caller": os.environ.get("OMP_WAIT_POLICY"),
        "weights": args.hf_dir, "concurrency": args.concurrency, "runs": args.runs,
        "command": " ".join(sys.argv), "cpu_isa": args.cpu_isa,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    # the servers' logs and the load client's JSON stay there for inspection
    tmp = Path(tempfile.mkdtemp(prefix="cpu_vs_vllm_"))
    print(f"logs: {tmp}", flush=True)
    result["logs"] = str(tmp)
    result["isa_env"] = isa_env(args)
    result["isa_check"] = isa_check(args, tmp)
    print("ISA:", json.dumps(result["isa_check"]), flush=True)
    if "served" in parts:
        result["served_load_avg_1m_start"] = load_avg()
        result["served"] = served(systems, args, workloads, tmp)
        save()
        if "vllm" in systems:
            peer = result["served"]["vllm"]
            for system in systems:
                if system.startswith("bucketserve"):
                    key = "served_ratio" + system[len("bucketserve"):].replace("-", "_")
                    result[key] = {
                        wl.stem: round(result["served"][system][wl.stem]["median_output_tok_s"]
                                       / peer[wl.stem]["median_output_tok_s"], 2)
                        for wl in workloads}
                    print(f"served ratio ({system} / vLLM):", result[key], flush=True)
            save()
    if "offline" in parts or "hf" in parts:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.hf_dir)
        rows = [json.loads(x) for x in (WORKLOADS / "mixed.jsonl").read_text().splitlines() if x.strip()]
        reqs = [(tok.encode(r["prompt"], add_special_tokens=False), int(r["max_tokens"]))
                for r in rows[:args.limit]]
        reqs_path = tmp / "mixed_ids.json"
        reqs_path.write_text(json.dumps(reqs))
    if "offline" in parts:
        result["offline"] = {}
        for system in [s for s in systems if s in ("bucketserve", "vllm")]:
            result["offline"][system] = {"load_avg_1m_start": load_avg(),
                                         **offline(system, args, reqs_path, tmp)}
            save()
        if set(systems) >= {"bucketserve", "vllm"}:
            result["offline_ratio"] = round(result["offline"]["bucketserve"]["median_output_tok_s"]
                                            / result["offline"]["vllm"]["median_output_tok_s"], 2)
            print("offline ratio (bucketserve / vLLM):", result["offline_ratio"], flush=True)
    if "hf" in parts:
        la = load_avg()
        # its own process, with OMP_WAIT_POLICY=PASSIVE as bench/offline_throughput.py runs it
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        p = subprocess.run([sys.executable, __file__, "--hf-worker", str(reqs_path),
                            "--hf-dir", args.hf_dir], env=env, check=True,
                           stdout=subprocess.PIPE, text=True)
        hf = json.loads(p.stdout.strip().splitlines()[-1])
        hf["load_avg_1m_start"] = la
        result["transformers_static"] = hf
        print("transformers static:", hf, flush=True)
        if "served" in result and "bucketserve" in result["served"]:
            ours = result["served"]["bucketserve"]["mixed"]["median_output_tok_s"]
            result["served_mixed_vs_transformers_static"] = round(ours / hf["output_tokens_per_s"], 2)
    result["load_avg_1m_at_end"] = load_avg()
    save()
    print(json.dumps({k: v for k, v in result.items() if k.endswith("ratio") or k.startswith("served_mixed")}))


VARIANT_LABELS = {
    "bucketserve-inproc": "engine core in the server's process",
    "bucketserve-t1": "1 compute thread",
    "bucketserve-pin": "engine on core 0 with 1 thread, front end on core 1",
    "bucketserve-mkl": "MKL sgemm instead of oneDNN",
    "bucketserve-spin": "OpenMP threads spin 10,000 times before sleeping",
    "bucketserve-nospin": "OpenMP threads sleep at once",
}


def markdown_table(r: dict) -> str:
    """The docs table of one results JSON."""
    rows = ["| | bucketserve | vLLM CPU | ratio |", "|---|---|---|---|"]
    served_ = r.get("served", {})
    for wl in ("mixed", "short"):
        ours = served_.get("bucketserve", {}).get(wl)
        peer = served_.get("vllm", {}).get(wl)
        if ours and peer:
            runs = lambda x: ", ".join(str(y["output_tok_s"]) for y in x["runs"])  # noqa: E731
            rows.append(f"| served `{wl}`, {r['concurrency']} streams, output tok/s (median of "
                        f"{r['runs']}: runs) | **{ours['median_output_tok_s']}** ({runs(ours)}) | "
                        f"{peer['median_output_tok_s']} ({runs(peer)}) | "
                        f"**{ours['median_output_tok_s'] / peer['median_output_tok_s']:.2f}x** |")
            for key, what in (("itl_p50_ms", "ITL p50"), ("ttft_p50_ms", "TTFT p50")):
                a, b = (statistics.median(x[key] for x in v["runs"]) for v in (ours, peer))
                rows.append(f"| served `{wl}`, {what} ms (median of the runs' p50) | {a} | {b} | "
                            f"{a / b:.2f}x |")
        for system, res in served_.items():
            var = res.get(wl)
            if not system.startswith("bucketserve-") or not var or not peer:
                continue
            runs_v = ", ".join(str(y["output_tok_s"]) for y in var["runs"])
            rows.append(f"| served `{wl}`, `{system}` ({VARIANT_LABELS.get(system, system)}) | "
                        f"{var['median_output_tok_s']} ({runs_v}) | | "
                        f"{var['median_output_tok_s'] / peer['median_output_tok_s']:.2f}x |")
    off = r.get("offline", {})
    if "bucketserve" in off and "vllm" in off:
        rows.append(f"| offline `mixed` (engine alone vs `LLM.generate`), output tok/s | "
                    f"**{off['bucketserve']['median_output_tok_s']}** | "
                    f"{off['vllm']['median_output_tok_s']} | **"
                    f"{off['bucketserve']['median_output_tok_s'] / off['vllm']['median_output_tok_s']:.2f}x** |")
    hf = r.get("transformers_static")
    if hf and "served_mixed_vs_transformers_static" in r:
        rows.append(f"| transformers static `generate` (batch 16), `mixed`, offline | | | "
                    f"{hf['output_tokens_per_s']} tok/s: served bucketserve is "
                    f"**{r['served_mixed_vs_transformers_static']:.1f}x** |")
    return "\n".join(rows)


def run_hf_static_dir(requests, hf_dir: str, batch_size: int) -> dict:
    """bench/offline_throughput.time_hf_static on the HF directory both systems load."""
    import torch
    from offline_throughput import time_hf_static
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return time_hf_static(model, requests, batch_size)


if __name__ == "__main__":
    main()
