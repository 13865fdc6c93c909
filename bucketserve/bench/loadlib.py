"""Shared pieces of the load scripts (soak.py, overload.py): a server process to sample, the
mixed requests a client sends, and how each outcome is classified.

Outcomes: "ok" (2xx, a stream that ended with [DONE]), "refused" (503 with Retry-After),
"client_error" (4xx), "server_error" (5xx other than a refusal), "stream_error" (a 200
stream that carried an error event), "cancelled" / "abandoned" (the client went away on
purpose), "hung" (no answer within the client's limit), "transport" (connection failures).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers:", "Once upon a time, in a small village,",
           "Explain what a hash table is in one sentence.", "def fibonacci(n):"]
ABANDON_AFTER_S = 0.2  # an abandoning client's patience
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.",
         "A short one.", "Serving engines batch requests to keep the hardware busy, " * 3]


# ------------------------------------------------------------------------ the server process
def descendants(pid: int) -> list[int]:
    """pid and all its children, grandchildren, ... (from /proc)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, pp in parent_of.items() if pp in frontier and p not in found]
        found += frontier
    return found


def _status_kib(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib(pid: int) -> float:
    """Resident memory of the process tree (server and any child processes), MiB."""
    return sum(_status_kib(p, "VmRSS") for p in descendants(pid)) / 1024


def peak_rss_mib(pid: int) -> float:
    """Sum of the per-process peaks (VmHWM) of the tree, MiB."""
    return sum(_status_kib(p, "VmHWM") for p in descendants(pid)) / 1024


def open_fds(pid: int) -> int:
    total = 0
    for p in descendants(pid):
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return total


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics", timeout=30)).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][^ ]*) ([^ ]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# ------------------------------------------------------------------------ requests
@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    missing_retry_after: int = 0
    samples: list[str] = field(default_factory=list)  # a few bodies of unexpected answers

    def add(self, kind: str, outcome: str, status: int | None = None,
            latency: float | None = None, note: str | None = None) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if status is not None:
            self.statuses[status] += 1
        if latency is not None and outcome == "ok":
            self.latencies.append(latency)
        if note and len(self.samples) < 10:
            self.samples.append(f"{kind} {outcome} {status}: {note[:300]}")

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else None
        return {"outcomes": dict(self.outcomes),
                "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "http_5xx": sum(v for k, v in self.statuses.items() if k >= 500),
                "refused_without_retry_after": self.missing_retry_after,
                "latency_s": {"p50": pct(0.5), "p99": pct(0.99), "max": lat[-1] if lat else None},
                "unexpected_samples": self.samples}


def classify_error(resp_status: int, headers: httpx.Headers, tally: Tally, kind: str,
                   latency: float, body: str) -> None:
    if resp_status == 503:
        if "retry-after" not in headers:
            tally.missing_retry_after += 1
        tally.add(kind, "refused", resp_status, latency)
    elif resp_status >= 500:
        tally.add(kind, "server_error", resp_status, latency, body)
    else:
        tally.add(kind, "client_error", resp_status, latency, body)


def make_request(rng: random.Random, max_tokens: int, embeddings: bool,
                 cancel_rate: float = 0.0, abandon_rate: float = 0.0) -> tuple[str, str, dict, str]:
    """(kind, path, body, mode) for one random request; mode is "plain", "stream",
    "cancel" (stream, closed after its first event) or "abandon" (the client gives up)."""
    choices = ["completion", "completion_stream", "chat", "chat_stream"]
    if embeddings:
        choices += ["embeddings"]
    kind = rng.choice(choices)
    n_tokens = rng.randint(max(1, max_tokens // 4), max_tokens)
    if kind == "embeddings":
        body = {"input": rng.sample(TEXTS, rng.randint(1, len(TEXTS)))}
        path, mode = "/v1/embeddings", "plain"
    elif kind.startswith("completion"):
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": n_tokens, "temperature": 0.7,
                "seed": rng.randint(0, 1000)}
        path = "/v1/completions"
        mode = "stream" if kind.endswith("stream") else "plain"
    else:
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": n_tokens, "temperature": 0.7}
        path = "/v1/chat/completions"
        mode = "stream" if kind.endswith("stream") else "plain"
    if mode == "stream":
        body["stream"] = True
        if rng.random() < cancel_rate:
            mode, kind = "cancel", kind + "_cancelled"
    elif kind != "embeddings" and rng.random() < abandon_rate:
        mode, kind = "abandon", kind + "_abandoned"
    return kind, path, body, mode


async def send(client: httpx.AsyncClient, kind: str, path: str, body: dict, mode: str,
               tally: Tally, limit_s: float) -> None:
    """Sends one request and records its outcome in `tally`."""
    t0 = time.monotonic()
    try:
        if mode == "abandon":  # the client gives up long before the answer
            try:
                await client.post(path, json=body, timeout=ABANDON_AFTER_S)
            except httpx.TimeoutException:
                tally.add(kind, "abandoned")
                return
            tally.add(kind, "ok", 200, time.monotonic() - t0)
            return
        if mode == "plain":
            resp = await client.post(path, json=body, timeout=limit_s)
            if resp.status_code == 200:
                tally.add(kind, "ok", 200, time.monotonic() - t0)
            else:
                classify_error(resp.status_code, resp.headers, tally, kind,
                               time.monotonic() - t0, resp.text)
            return
        async with client.stream("POST", path, json=body, timeout=limit_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                classify_error(resp.status_code, resp.headers, tally, kind,
                               time.monotonic() - t0, text)
                return
            events = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    tally.add(kind, "ok", 200, time.monotonic() - t0)
                    return
                if '"error"' in data and "error" in json.loads(data):
                    tally.add(kind, "stream_error", 200, None, data)
                    return
                events += 1
                if mode == "cancel" and events >= 2:
                    tally.add(kind, "cancelled", 200)
                    return  # leaving the block closes the connection mid-stream
            tally.add(kind, "stream_error", 200, None, "stream ended without [DONE]")
    except httpx.TimeoutException as exc:
        tally.add(kind, "hung", None, None, repr(exc))
    except httpx.TransportError as exc:
        tally.add(kind, "transport", None, None, repr(exc))


async def watch_health(client: httpx.AsyncClient, stop: asyncio.Event, every_s: float,
                       out: dict) -> None:
    """Polls /health while the load runs: how often it answered 200, and its slowest answer."""
    out.update(checks=0, ok=0, slowest_s=0.0)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            resp = await client.get("/health", timeout=30)
            out["ok"] += resp.status_code == 200
        except httpx.HTTPError:
            pass
        out["checks"] += 1
        out["slowest_s"] = round(max(out["slowest_s"], time.monotonic() - t0), 3)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
