#!/usr/bin/env python3
"""Tuned buckets vs the shipped default on a skewed trace, and request-log replay fidelity.

    PYTHONPATH=. python bench/bucket_tuning.py --out-dir bench/results/bucket_tuning_cpu [--device cpu]
        [--serve-args "--model DIR --embedding-model DIR"] [--request-embedding-model '']

1. A seeded skewed trace: generation prompts clustered around 40 and 700 tokens, embedding
   inputs around 12 and 180 tokens, Poisson arrivals.
2. `bucketserve serve` with the shipped buckets and --request-log: the trace is replayed at its
   pace (`bench --trace`), then run closed-loop (`bench --workload`, --concurrency) for
   throughput. The replay's request log is kept.
3. `bucketserve tune-buckets` on the request log of both runs of step 2 (the traffic the
   tuned file is then measured on) -> tuned.toml (checked).
4. The same server with tuned.toml: the replay's request log of step 2 is replayed (its
   arrival pattern), then the same closed-loop run.
5. Inter-arrival gaps of the recorded log (step 2) vs the log recorded while replaying it
   (step 4): histograms and the two-sample KS statistic.
Both servers run with the prefix cache off (default_buckets.toml: the shipped buckets with
`prefix_caching = false`, also the tuner's base) unless --prefix-caching: the closed-loop runs
repeat the trace's prompts, and with the cache on every run after a server's first sight of
them skips their prefill (the default server sees them in its replay, the tuned one only in its
first closed run), so the two would not compare the same work.
Everything lands in --out-dir: JSON per run, the logs, tuned.toml, figures, summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "bucketserve.server.cli", *args]


SERVE_ARGS: list[str] = []  # --serve-args
BASE: list[str | None] = [None]  # the default server's buckets file (None: the shipped one)
EMBEDDING_NAME = ["all-minilm-l6-v2"]  # --request-embedding-model ("": none sent)


def start(port: int, buckets: str | None, log: str, out_dir: str, name: str, device: str):
    args = cli("serve", "--port", str(port), "--request-log", log, "--device", device,
               "--log-level", "warning", *SERVE_ARGS)
    if buckets:
        args += ["--buckets", buckets]
    out = open(os.path.join(out_dir, f"server_{name}.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"server {name} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server {name} did not come up")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(port: int, out_dir: str, name: str, *args: str) -> dict:
    out = os.path.join(out_dir, f"{name}.json")
    cmd = cli("bench", "--base-url", f"http://127.0.0.1:{port}", "--out", out, "--label", name,
              *(["--embedding-model", EMBEDDING_NAME[0]] if EMBEDDING_NAME[0] else []), *args)
    print("+", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=False)
    with open(out) as f:
        return json.load(f)


def closed(port: int, out_dir: str, name: str, runs: int, *args: str) -> dict:
    """`runs` closed-loop runs: the median one (output tok/s), with every run's figures."""
    results = [bench(port, out_dir, name if i == 0 else f"{name}_{i + 1}", *args)
               for i in range(runs)]
    ranked = sorted(results, key=lambda r: r["output_throughput"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["runs_output_tok_s"] = [r["output_throughput"] for r in results]
    return median


def gaps(path: str) -> list[float]:
    with open(path) as f:
        times = sorted(json.loads(line)["arrival"] for line in f if line.strip())
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results", "bucket_tuning_cpu"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--rate", type=float, default=1.0, help="trace arrival rate, requests/s")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop runs")
    ap.add_argument("--closed-runs", type=int, default=1,
                    help="closed-loop runs per configuration; the median (by output tok/s) is "
                         "reported with every run's tok/s, each run's JSON kept (<name>.json, "
                         "<name>_2.json, ...)")
    ap.add_argument("--output-len", default="16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true",
                    help="reuse the default-buckets runs already in --out-dir")
    ap.add_argument("--serve-args", default="",
                    help="more `bucketserve serve` arguments, e.g. '--model DIR --embedding-model "
                         "DIR' (a GPU machine without the model packages)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep the servers' prefix cache on (off by default: the closed-loop "
                         "runs repeat the trace's prompts, so with it on every run after the "
                         "first skips their prefill, and the two servers would not compare the "
                         "same work)")
    ap.add_argument("--abba-rounds", type=int, default=0,
                    help="then N rounds of fresh servers, default then tuned in even rounds and "
                         "tuned then default in odd ones (2: A B B A), each running "
                         "--closed-runs closed loops: the order effects of one server after "
                         "the other cancel out")
    ap.add_argument("--abba-only", action="store_true",
                    help="only the --abba-rounds, with the tuned.toml already in --out-dir")
    ap.add_argument("--request-embedding-model", default=EMBEDDING_NAME[0],
                    help="model name sent with embedding requests ('' sends none)")
    a = ap.parse_args()
    # a SIGTERM (timeout(1)) unwinds like an exception: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    SERVE_ARGS[:] = shlex.split(a.serve_args)
    EMBEDDING_NAME[0] = a.request_embedding_model
    os.makedirs(a.out_dir, exist_ok=True)
    d = a.out_dir
    trace = os.path.join(d, "skewed_trace.jsonl")
    log_default = os.path.join(d, "request_log_default.jsonl")
    summary: dict = {"trace": trace, "requests": a.requests, "rate": a.rate, "device": a.device,
                     "prefix_caching": a.prefix_caching}
    # the shipped buckets, with the prefix cache off unless --prefix-caching: the default
    # server runs with this file and tune-buckets takes it as its base (the tuned file keeps it)
    BASE[0] = None
    if not a.prefix_caching:
        BASE[0] = os.path.join(d, "default_buckets.toml")
        with open(BASE[0], "w") as f:
            f.write("# the shipped defaults with the prefix cache off (bench/bucket_tuning.py)\n"
                    "[kv_cache]\nprefix_caching = false\n")
    port = free_port()
    if a.abba_only:
        abba(a, d, trace, port)
        return 0
    if a.resume and os.path.exists(log_default):
        for run in ("default_replay", "default_closed"):
            with open(os.path.join(d, f"{run}.json")) as f:
                summary[run] = json.load(f)
    else:
        run_default(a, d, trace, log_default, port, summary)
    tune_and_run_tuned(a, d, trace, log_default, port, summary)
    if a.abba_rounds:
        abba(a, d, trace, port)
    return 0


def abba(a, d, trace, port) -> None:
    """--abba-rounds rounds of fresh servers in the order A B, B A, ... (A: the default
    buckets, B: tuned.toml), each with --closed-runs closed loops; into summary.json["abba"]."""
    tuned = os.path.join(d, "tuned.toml")
    files = {"default": BASE[0], "tuned": tuned}
    rows = []
    for r in range(a.abba_rounds):
        for name in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
            live = os.path.join(d, f".live_abba_{name}.jsonl")
            proc = start(port, files[name], live, d, f"abba{r}_{name}", a.device)
            try:
                extra = ["--buckets", tuned] if name == "tuned" else []
                res = closed(port, d, f"abba{r}_{name}", a.closed_runs, "--workload", trace,
                             "--concurrency", str(a.concurrency), *extra)
            finally:
                stop(proc)
            if os.path.exists(live):
                os.remove(live)
            rows.append({"round": r, "config": name, "runs_output_tok_s": res["runs_output_tok_s"],
                         "median_output_tok_s": res["output_throughput"],
                         "embedding_padding": res.get("server", {}).get("embedding_padding_waste"),
                         "load_avg": res["machine"].get("load_avg")})
            print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(d, "summary.json")
    summary: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    summary["abba"] = rows
    for name in ("default", "tuned"):
        runs = sorted(x for row in rows if row["config"] == name for x in row["runs_output_tok_s"])
        summary[f"abba_{name}_median"] = runs[(len(runs) - 1) // 2] if runs else None
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print("abba medians over all runs: default", summary["abba_default_median"], "tuned",
          summary["abba_tuned_median"], flush=True)


def run_default(a, d, trace, log_default, port, summary) -> None:
    subprocess.run(cli("bench", "--num-requests", str(a.requests), "--seed", str(a.seed),
                       "--rate", str(a.rate), "--output-len", a.output_len,
                       "--prompt-len", "mix:0.7*normal:40:6:16:64+0.3*normal:700:50:560:840",
                       "--embedding-fraction", "0.4", "--embedding-inputs", "uniform:1:8",
                       "--embedding-len", "mix:0.6*normal:12:3:4:24+0.4*normal:180:15:140:220",
                       "--save-trace", trace, "--dry-run"), check=True)
    # default buckets: replay the trace (recording its log), then closed loop
    live = os.path.join(d, ".live_default.jsonl")
    for p in (log_default, live):
        if os.path.exists(p):
            os.remove(p)
    proc = start(port, BASE[0], live, d, "default", a.device)
    try:
        summary["default_replay"] = bench(port, d, "default_replay", "--trace", trace,
                                          "--plot", os.path.join(d, "plots_default"))
        shutil.copy(live, log_default)
        summary["default_closed"] = closed(port, d, "default_closed", a.closed_runs,
                                           "--workload", trace, "--concurrency", str(a.concurrency))
    finally:
        stop(proc)
    # the log of both runs: the traffic the tuned file is measured on (its closed loop runs
    # more requests at once than the paced replay ever does)
    shutil.move(live, tuning_log(log_default))


def tuning_log(log_default: str) -> str:
    return log_default.replace(".jsonl", "_all.jsonl")


def tune_and_run_tuned(a, d, trace, log_default, port, summary) -> None:
    tuned = os.path.join(d, "tuned.toml")
    source = tuning_log(log_default)
    if not os.path.exists(source):  # --resume on results from before the whole log was kept
        source = log_default
    summary["tuned_from"] = source
    base = ["--base", BASE[0]] if BASE[0] else []
    subprocess.run(cli("tune-buckets", source, "--out", tuned, "--device", a.device, *base),
                   check=True)
    check = subprocess.run([sys.executable, "-m", "bucketserve.buckets", "check", tuned],
                           capture_output=True, text=True)
    summary["tuned_check_rc"] = check.returncode

    log_tuned = os.path.join(d, "request_log_tuned.jsonl")
    live = os.path.join(d, ".live_tuned.jsonl")
    for p in (log_tuned, live):
        if os.path.exists(p):
            os.remove(p)
    proc = start(port, tuned, live, d, "tuned", a.device)
    try:
        summary["tuned_replay"] = bench(port, d, "tuned_replay", "--trace", log_default,
                                        "--buckets", tuned,
                                        "--plot", os.path.join(d, "plots_tuned"))
        shutil.copy(live, log_tuned)
        summary["tuned_closed"] = closed(port, d, "tuned_closed", a.closed_runs, "--workload",
                                         trace, "--concurrency", str(a.concurrency),
                                         "--buckets", tuned)
    finally:
        stop(proc)
    os.remove(live)

    from bucketserve.bench.replay import compare_gaps, plot_gaps

    g1, g2 = gaps(log_default), gaps(log_tuned)
    summary["replay_fidelity"] = compare_gaps(g1, g2)
    plot_gaps(g1, g2, os.path.join(d, "replay_interarrival.png"),
              "recorded request log", "log recorded while replaying it")
    brief = {}
    for run in ("default_replay", "default_closed", "tuned_replay", "tuned_closed"):
        r = summary[run]
        brief[run] = {"output_tok_s": r["output_throughput"], "req_s": r["request_throughput"],
                      "embedding_inputs_s": r.get("embedding", {}).get("inputs_per_s"),
                      "errors": r["errors"],
                      "engine_padding": r.get("server", {}).get("padding_waste"),
                      "embedding_padding": r.get("server", {}).get("embedding_padding_waste"),
                      "embedding_batches": r.get("server", {}).get("embedding_batches"),
                      "ttft_p50_ms": r["ttft_ms"]["p50"], "e2e_p50_ms": r["e2e_ms"]["p50"],
                      "load_avg": r["machine"].get("load_avg"),
                      "runs_output_tok_s": r.get("runs_output_tok_s")}
    summary["brief"] = brief
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({"brief": brief, "replay_fidelity": summary["replay_fidelity"]}, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
