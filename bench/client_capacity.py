#!/usr/bin/env python3
"""How fast is `bucketserve bench` itself? It loads the stub server (which streams at once).

    PYTHONPATH=. python bench/client_capacity.py [--stub-procs 1] [--workers 1 2] [--out FILE]

Two loads per client worker count, each against --stub-procs stub processes sharing one port:
  tokens   --streams concurrent streaming completions of --tokens tokens each
           (one SSE event, one HTTP chunk per token): output tokens/s the client sustains;
  requests --streams concurrent completions of 1 token: requests/s.
The machine (CPU model, cores, load average) is in the JSON: on a shared machine the figures
are a lower bound of the client's capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stub-procs", type=int, default=1)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "client_capacity_cpu.json"))
    a = ap.parse_args()
    port = free_port()
    stubs = [subprocess.Popen([sys.executable, "-m", "bucketserve.bench.stub_server", "--port",
                               str(port)], stdout=subprocess.PIPE) for _ in range(a.stub_procs)]
    for s in stubs:
        s.stdout.readline()
    runs = []
    try:
        for workers in a.workers:
            for load, out_len, n in (("tokens", a.tokens, a.requests),
                                     ("requests", 1, 4 * a.requests)):
                out = f"/tmp/client_capacity_{os.getpid()}.json"
                cmd = [sys.executable, "-m", "bucketserve.bench", "bench", "--base-url",
                       f"http://127.0.0.1:{port}", "--model", "stub", "--num-requests", str(n),
                       "--prompt-len", "16", "--output-len", str(out_len), "--concurrency",
                       str(a.streams), "--workers", str(workers), "--out", out]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    r = json.load(f)
                os.remove(out)
                runs.append({"load": load, "workers": workers, "streams": a.streams,
                             "output_tokens_per_s": r["output_throughput"],
                             "requests_per_s": r["request_throughput"],
                             "token_events": r["token_events"], "errors": r["errors"],
                             "itl_p50_ms": r["itl_ms"]["p50"], "duration_s": r["duration_s"],
                             "client_cpu_s": r["client_cpu_s"],
                             "client_cpu_us_per_request": 1e6 * r["client_cpu_s"] / n,
                             "client_cpu_us_per_token_event":
                                 r["client_cpu_us_per_token_event"],
                             "machine": r["machine"]})
                print(f"{load:>8} workers={workers}: {r['output_throughput']:,.0f} tok/s, "
                      f"{r['request_throughput']:,.0f} req/s, errors {r['errors']}, client "
                      f"{r['client_cpu_us_per_token_event']:.1f} CPU us per token event",
                      flush=True)
    finally:
        for s in stubs:
            s.terminate()
            s.wait(10)
    with open(a.out, "w") as f:
        json.dump({"stub_procs": a.stub_procs, "measured_unix": time.time(), "runs": runs}, f,
                  indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
