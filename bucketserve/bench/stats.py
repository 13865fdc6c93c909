"""Bench statistics: percentiles, throughput and goodput from per-request results.

Definitions (as vLLM's serving benchmark):
  output tokens   usage.completion_tokens when the server sent usage, else token events;
  TPOT            per request (E2E - TTFT) / (output tokens - 1), requests with > 1 token;
  throughput      completed requests (or their tokens) / duration, duration = from the
                  first send to the last response's end;
  goodput         completed requests meeting every SLO given (TTFT, TPOT, E2E) / duration;
  percentiles     linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def given(self) -> bool:
        return any(x is not None for x in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
        for limit, value in ((self.ttft_ms, ttft_s), (self.tpot_ms, tpot_s),
                             (self.e2e_ms, e2e_s)):
            if limit is not None and value is not None and value * 1000.0 > limit:
                return False
        return True


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    return _sorted_percentile(sorted(values), p)


def _sorted_percentile(xs: list[float], p: float) -> float:
    pos = (len(xs) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist_ms(values_s: list[float]) -> dict:
    """mean / p50 / p90 / p99 in milliseconds."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values_s)
    ms = {f"p{p}": 1000.0 * _sorted_percentile(xs, p) for p in (50, 90, 99)}
    return {"mean": 1000.0 * float(np.mean(xs)), **ms}


def output_tokens(r: dict) -> int:
    n = r.get("usage_completion_tokens")
    return int(n) if n is not None else int(r.get("chunks") or 0)


def tpot_s(r: dict) -> float | None:
    n = output_tokens(r)
    if r.get("e2e") is None or r.get("ttft") is None or n <= 1:
        return None
    return (r["e2e"] - r["ttft"]) / (n - 1)


def summarize(results: list[dict], duration_s: float, slo: SLO | None = None) -> dict:
    ok = [r for r in results if r.get("error") is None and r.get("e2e") is not None]
    gen = [r for r in ok if r["kind"] != "embedding"]
    emb = [r for r in ok if r["kind"] == "embedding"]
    errors = [r for r in results if r not in ok]
    out_toks = [output_tokens(r) for r in gen]
    in_toks = [r["usage_prompt_tokens"] if r.get("usage_prompt_tokens") is not None
               else r["prompt_tokens"] for r in ok]
    tpots = [t for t in (tpot_s(r) for r in gen) if t is not None]
    itls = [x for r in gen for x in r["itl"]]
    events = int(sum(r.get("chunks") or 0 for r in gen))
    dur = max(duration_s, 1e-9)
    slo = slo or SLO()
    good = [r for r in ok if slo.met(r.get("ttft"), tpot_s(r), r.get("e2e"))]
    s = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": [r.get("error") for r in errors[:5]],
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "output_throughput": sum(out_toks) / dur,
        "total_token_throughput": (sum(out_toks) + sum(in_toks)) / dur,
        "total_input_tokens": int(sum(in_toks)),
        "total_output_tokens": int(sum(out_toks)),
        "token_events": events,
        "tokens_per_token_event": sum(out_toks) / events if events else None,
        "output_ne_max_tokens": sum(1 for r, n in zip(gen, out_toks, strict=True) if n != r["max_tokens"]),
        "ttft_ms": dist_ms([r["ttft"] for r in gen]),
        "tpot_ms": dist_ms(tpots),
        "itl_ms": dist_ms(itls),
        "e2e_ms": dist_ms([r["e2e"] for r in gen]),
    }
    if emb:
        s["embedding"] = {"requests": len(emb),
                          "inputs_per_s": sum(len_inputs(r) for r in emb) / dur,
                          "e2e_ms": dist_ms([r["e2e"] for r in emb])}
    if slo.given:
        s["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
        s["goodput_requests_per_s"] = len(good) / dur
        s["goodput_output_tokens_per_s"] = sum(output_tokens(r) for r in good
                                               if r["kind"] != "embedding") / dur
        s["slo_attainment"] = len(good) / len(results) if results else None
    return s


def engine_line(info: dict[str, str] | None) -> str:
    """The report header's line on what the server runs (its bucketserve_engine_info)."""
    if info is None:
        return "engine: not reported (no bucketserve_engine_info in the server's /metrics)"
    keys = ("model", "device", "dtype", "quantization", "kv_cache_dtype")
    line = "engine: " + ", ".join(f"{k} {info.get(k, '?')}" for k in keys)
    if "structured_backend" in info:  # (servers before it did not say)
        line += f", structured_backend {info['structured_backend']}"
    return line


def len_inputs(r: dict) -> int:
    return int(r.get("inputs") or 1)


def machine() -> dict:
    """CPU model, core count and feature flags of this machine, for the JSON."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_model": platform.processor() or None}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not info.get("cpu_model_name"):
                    info["cpu_model_name"] = value.strip()
                elif key == "flags" and "cpu_flags" not in info:
                    flags = value.split()
                    keep = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                            "amx_tile", "fma", "sse4_2", "f16c")
                    info["cpu_flags"] = [f for f in keep if f in flags]
    except OSError:
        pass
    try:
        info["load_avg"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def table(s: dict, title: str = "") -> str:
    """A readable text table of a summary."""
    def f(x: float | None, nd: int = 1) -> str:
        return "-" if x is None else f"{x:,.{nd}f}"

    lines = [title] if title else []
    lines.append(f"requests {s['completed']}/{s['requests']} ok, {s['errors']} errors, "
                 f"{f(s['duration_s'], 2)} s")
    lines.append(f"output tok/s {f(s['output_throughput'])}   requests/s "
                 f"{f(s['request_throughput'], 2)}   total tok/s {f(s['total_token_throughput'])}")
    if "goodput_requests_per_s" in s:
        lines.append(f"goodput req/s {f(s['goodput_requests_per_s'], 2)}   goodput tok/s "
                     f"{f(s['goodput_output_tokens_per_s'])}   SLO attainment "
                     f"{f(100 * (s['slo_attainment'] or 0), 1)}%")
    if s.get("tokens_per_token_event") is not None:
        lines.append(f"token events {s['token_events']:,}   tokens per event "
                     f"{f(s['tokens_per_token_event'], 2)}")
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    rows = [("TTFT", s["ttft_ms"]), ("TPOT", s["tpot_ms"]), ("ITL", s["itl_ms"]),
            ("E2E", s["e2e_ms"])]
    if "embedding" in s:
        rows.append(("emb", s["embedding"]["e2e_ms"]))
    for name, d in rows:
        lines.append(f"{name:<6}{f(d['mean'], 2):>10}{f(d['p50'], 2):>10}{f(d['p90'], 2):>10}"
                     f"{f(d['p99'], 2):>10}")
    if "embedding" in s:
        lines.append(f"embedding inputs/s {f(s['embedding']['inputs_per_s'])}")
    return "\n".join(lines)
