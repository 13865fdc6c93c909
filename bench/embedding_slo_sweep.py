#!/usr/bin/env python3
"""Embeddings under a Poisson sweep: the deadline-driven batcher (latency_slo_ms) against fixed
max_queue_delay_ms settings, p99 latency vs the SLO and throughput per rate (issue 15).

    PYTHONPATH=. python bench/embedding_slo_sweep.py --device cpu \
        --out bench/results/embedding_slo_sweep_cpu.json [--rates 10,15,20,30,100,2000]
        [--slo-ms 500] [--fixed-ms 0,5,50,200] [--duration-s 10] [--max-requests 2000]
        [--rounds 3] [--warmup 60]
        [--serve-args "--model DIR --embedding-model DIR"]  (bench/issue15_h200.sh on a GPU)

One `bucketserve serve` per setting (its TOML differs only in [embedding] latency_slo_ms or
max_queue_delay_ms; the LLM it also loads gets a tiny KV pool and is not used). Each request
carries one token-id input (exact length) from a seeded mix of two clusters, about 12 and 180
tokens (60% / 40%), as in the skewed trace of bench/bucket_tuning.py. At each rate every
setting gets the same requests at the same Poisson arrival times: rate x --duration-s
requests (at least --min-requests, at most --max-requests; above the server's capacity the
run lasts until the backlog drains or max_waiting refuses the excess with 503).

Every server first answers --warmup requests (not recorded). On the CPU all servers are up
together and, at each rate, the settings run one after another in an order that rotates with
the rate and the round, so the load other processes put on the machine falls on all of them
alike. On CUDA (one GPU: each server profiles the memory left to it) the settings run one at a
time, each over all rates. --rounds N runs every (setting, rate) N times; the verdict and the
plot use the medians (on the 2-core CPU one setting's throughput varied by up to 30% between
rounds of the same requests).

Per run: p50 / p99 of the end-to-end latency (client send to the whole response) over the
completed requests, p99 over all requests with failures counted as infinitely late, the
share within the SLO, throughput (completed inputs per second, first send to last response:
bucketserve bench's definition; below saturation it is the offered rate less the last
request's latency over the run's length), goodput (inputs answered within the SLO per second
of the arrival window), and from /metrics the batches, the mean batch size, the
padding and the deadline misses of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from bucketserve.bench import runner  # noqa: E402
from bucketserve.bench import workload as wl  # noqa: E402

MODEL = "all-minilm-l6-v2"
LENGTHS = "mix:0.6*normal:12:3:4:24+0.4*normal:180:15:140:220"
DEFAULTS = {  # device -> (SLO ms, fixed delays ms, rates texts/s)
    # 2 shared cores serve about 20 of these texts/s: the points crowd below that, then two
    # saturated ones (100, 2,000)
    "cpu": (500.0, [0.0, 5.0, 50.0, 200.0], "10,15,20,30,100,2000"),
    "cuda": (50.0, [0.0, 2.0, 5.0, 20.0], "10,30,100,300,1000,2000"),
}
METRICS = ("bucketserve_embedding_batches_total", "bucketserve_embedding_inputs_total",
           "bucketserve_embedding_computed_tokens_total",
           "bucketserve_embedding_useful_tokens_total",
           "bucketserve_embedding_deadline_misses_total",
           "bucketserve_embedding_encoder_seconds_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_for(setting: str, slo_ms: float, device: str) -> str:
    head = ("[kv_cache]\ncpu_memory_gib = 0.1\n" if device == "cpu"
            else "[kv_cache]\ngpu_memory_fraction = 0.5\n")
    if setting == "feedback":
        return head + f"[embedding]\nlatency_slo_ms = {slo_ms}\n"
    return head + f"[embedding]\nmax_queue_delay_ms = {float(setting.split('=')[1])}\n"


class Server:
    def __init__(self, setting: str, slo_ms: float, device: str, work: str,
                 extra: list[str] | None = None) -> None:
        self.setting = setting
        self.port = free_port()
        name = setting.replace("=", "_")
        path = os.path.join(work, f"{name}.toml")
        with open(path, "w") as f:
            f.write(toml_for(setting, slo_ms, device))
        self.log = open(os.path.join(work, f"{name}.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bucketserve.server.cli", "serve", "--port", str(self.port),
             "--buckets", path, "--device", device, "--embedding-model", MODEL,
             "--log-level", "warning", *(extra or [])],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_up(self, limit_s: float = 900.0) -> None:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.setting} exited {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server {self.setting} did not come up")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][^ {]*) ([^ ]+)$", line)
            if m and m.group(1) in METRICS:
                out[m.group(1)] = float(m.group(2))
        batches = [float(v) for v in re.findall(
            r'^bucketserve_embedding_batches_total\{[^}]*\} ([^ ]+)$', text, re.M)]
        out["bucketserve_embedding_batches_total"] = sum(batches)
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def requests_for(rate: float, a) -> list:
    n = int(min(max(rate * a.duration_s, a.min_requests), a.max_requests))
    return wl.generate(n, "1", "1", seed=a.seed, embedding_fraction=1.0,
                       embedding_len=LENGTHS, embedding_inputs="1", rate=rate)


def pct(xs: list[float], p: float) -> float | None:
    """Linearly interpolated percentile; an infinite value it lands on (or between) gives inf."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return xs[lo]
    if math.isinf(xs[hi]):
        return math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one_run(server: Server, rate: float, reqs: list, a, slo_s: float) -> dict:
    host, port = "127.0.0.1", server.port
    cfg = runner.RunConfig(host, port, "unused", open_loop=True, workers=a.workers,
                           embedding_model=a.request_model or None,
                           request_timeout_s=a.request_timeout_s)
    before = server.metrics()
    load = os.getloadavg()
    results, _t0, duration, cpu_s = asyncio.run(runner.run(cfg, reqs))
    after = server.metrics()
    ok = [r for r in results if r["status"] == 200 and r["error"] is None]
    failed = [r for r in results if not (r["status"] == 200 and r["error"] is None)]
    lat = [r["e2e"] for r in ok]
    all_lat = lat + [math.inf] * (len(results) - len(ok))
    window = max(r["scheduled"] for r in results if r.get("scheduled") is not None)
    lag = [r["start"] - r["scheduled"] for r in results if r.get("scheduled") is not None]
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}
    batches = d["bucketserve_embedding_batches_total"]
    computed = d["bucketserve_embedding_computed_tokens_total"]
    ms = (lambda x: None if x is None else (x * 1000 if math.isfinite(x) else "inf"))  # noqa: E731
    errors: dict[str, int] = {}
    for r in failed:
        key = str(r["status"] or r["error"])[:60]
        errors[key] = errors.get(key, 0) + 1
    return {
        "setting": server.setting, "rate": rate, "requests": len(results), "slo_ms": slo_s * 1000,
        "completed": len(ok), "errors": errors,
        "duration_s": duration,
        "throughput_inputs_s": len(ok) / duration if duration else 0.0,
        "goodput_inputs_s": sum(x <= slo_s for x in lat) / window if window else None,
        "p50_ms": ms(pct(lat, 50)), "p90_ms": ms(pct(lat, 90)), "p99_ms": ms(pct(lat, 99)),
        "p99_all_ms": ms(pct(all_lat, 99)),
        "within_slo": sum(x <= slo_s for x in lat) / len(results) if results else 0.0,
        "slo_met": pct(all_lat, 99) <= slo_s,
        "client_send_lag_p99_ms": ms(pct(lag, 99)),
        "client_cpu_s": cpu_s,
        "server": {"batches": batches,
                   "mean_batch_size": d["bucketserve_embedding_inputs_total"] / batches
                   if batches else None,
                   "padding": 1 - d["bucketserve_embedding_useful_tokens_total"] / computed
                   if computed else None,
                   "encoder_s": d["bucketserve_embedding_encoder_seconds_total"],
                   "deadline_misses": d["bucketserve_embedding_deadline_misses_total"]},
        "load_avg_before": load,
    }


def machine(device: str) -> dict:
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "device": device}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        info["cpu_model"] = m.group(1) if m else None
        flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        keep = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "fma")
        info["cpu_flags"] = [x for x in (flags.group(1).split() if flags else []) if x in keep]
    except OSError:
        pass
    if device == "cuda":
        try:
            import torch

            info["gpu"] = torch.cuda.get_device_name(0)
        except Exception as exc:  # the servers will say more
            info["gpu"] = f"unknown ({exc})"
    return info


def medians(runs: list[dict]) -> list[dict]:
    """One record per (setting, rate): with --rounds > 1 the median of each figure over the
    rounds (the SLO counts as met when the median p99 over all requests is within it)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["setting"], r["rate"]), []).append(r)
    out = []
    for (setting, rate), rs in groups.items():
        if len(rs) == 1:
            out.append(rs[0])
            continue

        def med(key: str, rs: list[dict] = rs) -> float:
            vals = [math.inf if r[key] == "inf" else r[key] for r in rs if r[key] is not None]
            m = statistics.median(vals)
            return "inf" if math.isinf(m) else m

        rec = {"setting": setting, "rate": rate, "rounds": len(rs),
               "requests": rs[0]["requests"]}
        for key in ("throughput_inputs_s", "goodput_inputs_s", "p50_ms", "p99_ms",
                    "p99_all_ms", "within_slo"):
            rec[key] = med(key)
        rec["throughput_rounds"] = [r["throughput_inputs_s"] for r in rs]
        rec["slo_met_rounds"] = [r["slo_met"] for r in rs]
        rec["slo_met"] = rec["p99_all_ms"] != "inf" and rec["p99_all_ms"] <= rs[0]["slo_ms"]
        rec["server"] = {k: statistics.median(r["server"][k] for r in rs
                                              if r["server"][k] is not None)
                         if any(r["server"][k] is not None for r in rs) else None
                         for k in rs[0]["server"]}
        out.append(rec)
    return out


def verdict(runs: list[dict], rates: list[float], tol: float) -> list[dict]:
    """Per rate: does the feedback setting meet the SLO wherever a fixed one does, and is its
    throughput at least the best fixed one's (within `tol`, the run-to-run noise)? With
    several rounds, on the medians over rounds (`medians`)."""
    runs = medians(runs)
    out = []
    for rate in rates:
        at = [r for r in runs if r["rate"] == rate]
        fb = next(r for r in at if r["setting"] == "feedback")
        fixed = [r for r in at if r["setting"] != "feedback"]
        best = max(fixed, key=lambda r: r["throughput_inputs_s"])
        any_fixed_met = any(r["slo_met"] for r in fixed)
        out.append({"rate": rate, "any_fixed_meets_slo": any_fixed_met,
                    "feedback_meets_slo": fb["slo_met"],
                    "slo_ok": fb["slo_met"] or not any_fixed_met,
                    "best_fixed": best["setting"],
                    "throughput_ratio_vs_best_fixed":
                        fb["throughput_inputs_s"] / best["throughput_inputs_s"]
                        if best["throughput_inputs_s"] else None,
                    "throughput_ok": fb["throughput_inputs_s"]
                        >= (1 - tol) * best["throughput_inputs_s"],
                    "goodput_ratio_vs_best_fixed":
                        fb["goodput_inputs_s"] / max(r["goodput_inputs_s"] for r in fixed)
                        if max(r["goodput_inputs_s"] for r in fixed) else None})
    return out


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the JSON is written already; the figure can be made from it later
        print(f"matplotlib is not installed: no {path} (rerun with --merge JSON to draw it)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["rates"]
    slo = result["slo_ms"]
    runs = medians(result["runs"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setting in result["settings"]:
        rs = sorted((r for r in runs if r["setting"] == setting),
                    key=lambda r: r["rate"])
        label = (f"feedback (SLO {slo:g} ms)" if setting == "feedback"
                 else f"fixed delay {setting.split('=')[1]} ms")
        style = dict(lw=2.5, color="black") if setting == "feedback" else dict(lw=1.2)
        p99 = [r["p99_all_ms"] if r["p99_all_ms"] != "inf" else math.nan for r in rs]
        ax1.plot([r["rate"] for r in rs], p99, marker="o", label=label, **style)
        ax2.plot([r["rate"] for r in rs], [r["throughput_inputs_s"] for r in rs], marker="o",
                 label=label, **style)
    ax1.axhline(slo, color="red", ls="--", lw=1, label="SLO")
    ax1.set(xscale="log", yscale="log", xlabel="offered load (texts/s, Poisson)",
            ylabel="p99 end-to-end latency (ms)", title="p99 latency (failures count as late)")
    ax2.plot(rates, rates, color="grey", ls=":", lw=1, label="offered")
    ax2.set(xscale="log", yscale="log", xlabel="offered load (texts/s, Poisson)",
            ylabel="throughput (completed texts/s)", title="throughput")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"Embeddings (all-MiniLM-L6-v2, 1 text/request, ~12 and ~180 tokens) on "
                 f"{m.get('gpu') or m.get('cpu_model')} ({m['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rates", default=None,
                    help="texts/s; default: 10,15,20,30,100,2000 cpu; 10,30,100,300,1000,2000 cuda")
    ap.add_argument("--slo-ms", type=float, default=None, help="default: 500 cpu, 50 cuda")
    ap.add_argument("--fixed-ms", default=None, help="default: 0,5,50,200 cpu; 0,2,5,20 cuda")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--min-requests", type=int, default=100)
    ap.add_argument("--max-requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=1, help="client processes")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=60,
                    help="requests each server answers before the timed runs (at the highest "
                         "rate, not recorded): every setting starts warm (0: none)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every (setting, rate) this many times; the verdict and the plot "
                         "use the medians (the CPU's speed drifts between runs by 10-20%%)")
    ap.add_argument("--serve-args", default="",
                    help="more `bucketserve serve` arguments, e.g. '--model DIR --embedding-model "
                         "DIR' (a later --embedding-model replaces all-minilm-l6-v2)")
    ap.add_argument("--request-model", default=MODEL,
                    help="model name sent with each request ('' sends none: a served directory)")
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="throughput noise allowed in the verdict (fraction)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "embedding_slo_sweep_cpu.json"))
    ap.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    ap.add_argument("--only", default=None,
                    help="run only these settings (e.g. feedback,fixed=0): split a long sweep "
                         "into several commands, then --merge their JSONs")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="combine runs of earlier --only sweeps into --out (verdict, plot)")
    a = ap.parse_args(argv)
    # a SIGTERM (timeout(1)) unwinds like an exception: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.merge:
        parts = []
        for path in a.merge:
            with open(path) as f:
                parts.append(json.load(f))
        result = {**parts[0], "runs": [r for p in parts for r in p["runs"]],
                  "settings": list(dict.fromkeys(x for p in parts for x in p["settings"])),
                  "rates": sorted({x for p in parts for x in p["rates"]}),
                  "merged_from": a.merge}
        result["verdict"] = verdict(result["runs"], result["rates"], a.tolerance)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, a.plot or os.path.splitext(a.out)[0] + ".png")
        print(json.dumps(result["verdict"], indent=1))
        return 0
    slo_ms = a.slo_ms if a.slo_ms is not None else DEFAULTS[a.device][0]
    fixed = ([float(x) for x in a.fixed_ms.split(",")] if a.fixed_ms
             else DEFAULTS[a.device][1])
    rates = [float(x) for x in (a.rates or DEFAULTS[a.device][2]).split(",")]
    settings = ["feedback"] + [f"fixed={x:g}" for x in fixed]
    if a.only:
        settings = [x for x in settings if x in a.only.split(",")]
    work = tempfile.mkdtemp(prefix="slo_sweep_")  # the servers' TOMLs and logs
    result = {"machine": machine(a.device), "slo_ms": slo_ms, "rates": rates,
              "settings": settings, "lengths": LENGTHS, "duration_s": a.duration_s,
              "seed": a.seed, "rounds": a.rounds, "warmup": a.warmup, "command": " ".join(sys.argv), "runs": []}
    reqs = {rate: requests_for(rate, a) for rate in rates}
    extra = shlex.split(a.serve_args)
    result["serve_args"] = extra

    def warm(server: Server) -> None:
        if a.warmup > 0:
            top = max(rates)
            one_run(server, top, requests_for(top, a)[:a.warmup], a, slo_ms / 1000)

    def record(run: dict) -> None:
        result["runs"].append(run)
        print(f"{run['setting']:>10} {run['rate']:7g}/s  n={run['requests']:5d} "
              f"ok={run['completed']:5d} thr={run['throughput_inputs_s']:8.1f}/s "
              f"p50={run['p50_ms']} p99all={run['p99_all_ms']} "
              f"batch={run['server']['mean_batch_size']} load={run['load_avg_before'][0]:.1f}",
              flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    if a.device == "cpu":  # all up together, settings interleaved per rate
        servers = [Server(s, slo_ms, a.device, work, extra) for s in settings]
        try:
            for s in servers:
                s.wait_up()
            for s in servers:
                warm(s)
            for rnd in range(a.rounds):
                for k, rate in enumerate(rates):
                    shift = (k + rnd) % len(servers)
                    for s in servers[shift:] + servers[:shift]:
                        record({**one_run(s, rate, reqs[rate], a, slo_ms / 1000), "round": rnd})
        finally:
            for s in servers:
                s.stop()
    else:  # one server at a time
        for setting in settings:
            s = Server(setting, slo_ms, a.device, work, extra)
            try:
                s.wait_up()
                warm(s)
                for rnd in range(a.rounds):
                    for rate in rates:
                        record({**one_run(s, rate, reqs[rate], a, slo_ms / 1000), "round": rnd})
            finally:
                s.stop()
    if "feedback" in settings and len(settings) > 1:
        result["verdict"] = verdict(result["runs"], rates, a.tolerance)
        print(json.dumps(result["verdict"], indent=1))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.plot or os.path.splitext(a.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
