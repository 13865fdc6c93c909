"""Time to first token of a 1-token request that arrives while a long prompt is prefilled.

For each value of `[scheduler] max_prefill_share` a fresh `bucketserve serve` (SmolLM2) gets
one 8,190-token prompt (token ids, max_tokens 2); `--delay` seconds later a short request
(1-token prompt, max_tokens 1, streamed) is sent, and its time to first token measured, with
the long request's own latency. Share 1.0 is the behaviour before the limit (one prompt may
take the whole step).

    python bench/long_prompt_ttft.py --shares 1.0,0.25 --out bench/results/long_prompt_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import httpx

from bucketserve.bench.launch import start_server  # noqa: E402


def measure(base_url: str, long_len: int, delay_s: float) -> dict:
    result: dict = {}

    def long_request() -> None:
        t0 = time.perf_counter()
        r = httpx.post(base_url + "/v1/completions", timeout=900,
                       json={"prompt": [1000 + i % 5000 for i in range(long_len)],
                             "max_tokens": 2, "temperature": 0})
        result["long_status"] = r.status_code
        result["long_latency_s"] = time.perf_counter() - t0

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(delay_s)
    t0 = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/completions", timeout=900,
                      json={"prompt": [1000], "max_tokens": 1, "temperature": 0,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                result.setdefault("short_ttft_s", time.perf_counter() - t0)
    result["short_status"] = r.status_code
    t.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shares", default="1.0,0.25")
    ap.add_argument("--long-len", type=int, default=8190)
    ap.add_argument("--delay", type=float, default=5.0)
    ap.add_argument("--out", default="bench/results/long_prompt_ttft.json")
    args = ap.parse_args()
    load = os.getloadavg()
    rows = []
    for share in [float(s) for s in args.shares.split(",")]:
        toml = f"[scheduler]\nmax_prefill_share = {share}\n[kv_cache]\ncpu_memory_gib = 0.5\n"
        srv = start_server(Path("/tmp/bucketserve-bench"), f"ttft-{share}", toml)
        try:
            row = {"max_prefill_share": share, **measure(srv.base_url, args.long_len, args.delay)}
        finally:
            srv.stop()
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"long_prompt_tokens": args.long_len, "short_sent_after_s": args.delay,
           "loadavg_at_start": load, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
