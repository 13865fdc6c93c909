"""Bench requests: read from JSONL (workload files, request logs, traces) or generated from a seed.

A JSONL line may be
- a workload line (`/work/shared/workloads`): {"prompt", "prompt_tokens", "max_tokens"};
- a request-log line (`bucketserve serve --request-log`): {"arrival", "endpoint",
  "prompt_tokens", "output_tokens", ...} or, for embeddings, {"endpoint": "embeddings",
  "input_tokens": [...]};
- any JSONL with an arrival time or offset in seconds (`arrival`, `arrival_s`, `offset_s`,
  `timestamp` or `t`) and lengths (`prompt_tokens` / `prompt_len` / `input_len`,
  `output_tokens` / `max_tokens` / `output_len`, `input_tokens` for embeddings).
Lines without prompt text get a synthetic prompt of the recorded length: token ids (exact
length) or text of that many words (about one token per word; usage tells the real count).

Length distributions for generated workloads (`parse_dist`):
  `128`, `uniform:16:1024`, `loguniform:16:1024`, `normal:40:8[:MIN:MAX]`,
  `mix:0.7*normal:40:8+0.3*normal:700:60`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

KINDS = ("completion", "chat", "embedding")
ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions",
             "embedding": "/v1/embeddings"}
_ENDPOINT_KIND = {"completions": "completion", "completion": "completion",
                  "/v1/completions": "completion", "chat": "chat",
                  "chat.completions": "chat", "/v1/chat/completions": "chat",
                  "embeddings": "embedding", "embedding": "embedding",
                  "/v1/embeddings": "embedding"}
_ARRIVAL_KEYS = ("arrival", "arrival_s", "offset_s", "timestamp", "t")
_PROMPT_KEYS = ("prompt_tokens", "prompt_len", "input_len")
_OUTPUT_KEYS = ("output_tokens", "max_tokens", "output_len")
# Common words that are one token each in BPE and WordPiece vocabularies (with a leading space).
_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "was", "on",
          "be", "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an",
          "they", "which", "one", "you", "were", "her", "all", "she", "there", "would", "their")


class WorkloadError(ValueError):
    """A workload or trace file that cannot be read; the message names the line."""


@dataclass
class BenchRequest:
    kind: str  # "completion" | "chat" | "embedding"
    prompt_tokens: int  # embeddings: the sum of the input lengths
    max_tokens: int = 0  # embeddings: 0
    prompt: str | list[int] | None = None  # completion / chat
    inputs: list | None = None  # embeddings: strings or token-id lists
    input_lengths: list[int] = field(default_factory=list)  # embeddings
    arrival: float | None = None  # seconds from the first request of a trace
    extra: dict | None = None  # merged into this request's body (a workload line's "extra")


# ---------------------------------------------------------------------------- distributions
def parse_dist(spec: str) -> Callable[[np.random.Generator, int], np.ndarray]:
    """A length sampler from a spec string (see the module docstring); values are ints >= 1."""
    spec = spec.strip()
    if spec.startswith("mix:"):
        parts = []
        for item in spec[4:].split("+"):
            weight, _, sub = item.partition("*")
            if not sub:
                raise WorkloadError(f"bad mix component {item!r}; expected WEIGHT*DIST")
            parts.append((float(weight), parse_dist(sub)))
        weights = np.array([w for w, _ in parts], dtype=float)
        weights /= weights.sum()

        def mix(rng: np.random.Generator, n: int) -> np.ndarray:
            which = rng.choice(len(parts), size=n, p=weights)
            out = np.empty(n, dtype=np.int64)
            for k, (_, f) in enumerate(parts):
                idx = np.nonzero(which == k)[0]
                if len(idx):
                    out[idx] = f(rng, len(idx))
            return out

        return mix
    name, _, rest = spec.partition(":")
    args = [float(x) for x in rest.split(":")] if rest else []
    try:
        if not rest:
            value = int(name)
            return lambda rng, n: np.full(n, max(1, value), dtype=np.int64)
        if name == "uniform":
            lo, hi = int(args[0]), int(args[1])
            return lambda rng, n: rng.integers(lo, hi + 1, size=n)
        if name == "loguniform":
            lo, hi = args[0], args[1]
            return lambda rng, n: np.clip(np.floor(np.exp(rng.uniform(
                math.log(lo), math.log(hi + 1), size=n))), lo, hi).astype(np.int64)
        if name == "normal":
            mean, sd = args[0], args[1]
            lo = args[2] if len(args) > 2 else 1
            hi = args[3] if len(args) > 3 else math.inf
            return lambda rng, n: np.clip(np.rint(rng.normal(mean, sd, size=n)), lo,
                                          hi).astype(np.int64).clip(1)
    except (IndexError, ValueError) as exc:
        raise WorkloadError(f"bad length distribution {spec!r}: {exc}") from None
    raise WorkloadError(f"unknown length distribution {spec!r}; expected N, uniform:A:B, "
                        "loguniform:A:B, normal:MEAN:SD[:MIN:MAX] or mix:W*DIST+W*DIST")


# ---------------------------------------------------------------------------- synthetic prompts
class PromptMaker:
    """Synthetic prompts of a given length: token ids (exact) or words (about one token each)."""

    def __init__(self, kind: str = "ids", seed: int = 0, id_range: tuple[int, int] = (1000, 20000)
                 ) -> None:
        if kind not in ("ids", "text"):
            raise WorkloadError(f"prompt kind must be 'ids' or 'text', got {kind!r}")
        self.kind = kind
        self.rng = np.random.default_rng([seed, 7])
        self.id_range = id_range

    def __call__(self, n: int) -> str | list[int]:
        if self.kind == "ids":
            return self.rng.integers(*self.id_range, size=n).tolist()
        words = self.rng.integers(0, len(_WORDS), size=n)
        return " ".join(_WORDS[w] for w in words).capitalize()


def generate(n: int, prompt_len: str, output_len: str, seed: int = 0, kind: str = "completion",
             prompt_kind: str = "ids", embedding_fraction: float = 0.0,
             embedding_len: str = "uniform:8:128", embedding_inputs: str = "1",
             rate: float | None = None) -> list[BenchRequest]:
    """`n` seeded requests; with `rate`, Poisson arrival offsets (the first at 0)."""
    rng = np.random.default_rng(seed)
    plens = parse_dist(prompt_len)(rng, n)
    olens = parse_dist(output_len)(rng, n)
    is_emb = rng.random(n) < embedding_fraction
    n_inputs = parse_dist(embedding_inputs)(rng, n)
    elen = parse_dist(embedding_len)
    make = PromptMaker(prompt_kind, seed)
    arrivals = None
    if rate is not None:
        gaps = rng.exponential(1.0 / rate, size=n)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    out = []
    for i in range(n):
        arrival = float(arrivals[i]) if arrivals is not None else None
        if is_emb[i]:
            lengths = [int(x) for x in elen(rng, int(n_inputs[i]))]
            out.append(BenchRequest("embedding", sum(lengths), inputs=[make(m) for m in lengths],
                                    input_lengths=lengths, arrival=arrival))
        else:
            p = int(plens[i])
            out.append(BenchRequest(kind, p, int(olens[i]), prompt=make(p), arrival=arrival))
    return out


# ---------------------------------------------------------------------------- reading files
def _first(d: dict, keys: tuple[str, ...]):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def parse_line(d: dict, make: PromptMaker, default_kind: str = "completion",
               keep_text: bool = True) -> BenchRequest | None:
    """One JSON object as a request (None for lines that are not requests, e.g. failed ones)."""
    endpoint = d.get("endpoint")
    kind = _ENDPOINT_KIND.get(str(endpoint), default_kind) if endpoint is not None else default_kind
    if d.get("kind") in KINDS:
        kind = d["kind"]
    arrival = _first(d, _ARRIVAL_KEYS)
    arrival = float(arrival) if arrival is not None else None
    if kind == "embedding" or "input_tokens" in d or "input_lengths" in d:
        lengths = d.get("input_tokens") or d.get("input_lengths")
        if isinstance(lengths, int):
            lengths = [lengths]
        if not lengths:
            return None
        lengths = [int(x) for x in lengths]
        texts = d.get("input") if keep_text and isinstance(d.get("input"), list) else None
        return BenchRequest("embedding", sum(lengths),
                            inputs=texts or [make(m) for m in lengths],
                            input_lengths=lengths, arrival=arrival)
    plen = _first(d, _PROMPT_KEYS)
    olen = _first(d, _OUTPUT_KEYS)
    if plen is None or olen is None:
        raise WorkloadError("needs a prompt length (prompt_tokens) and an output length "
                            "(output_tokens or max_tokens)")
    plen, olen = int(plen), int(olen)
    if olen < 1:
        return None  # a request that produced nothing (aborted, timed out): no replay
    prompt = d.get("prompt") if keep_text and isinstance(d.get("prompt"), str) else None
    extra = d.get("extra")
    if extra is not None and not isinstance(extra, dict):
        raise WorkloadError("extra must be a JSON object (fields merged into the request body)")
    return BenchRequest(kind, plen, olen, prompt=prompt if prompt is not None else make(plen),
                        arrival=arrival, extra=extra)


def load_jsonl(path: str, prompt_kind: str = "ids", seed: int = 0,
               default_kind: str = "completion", keep_text: bool = True) -> list[BenchRequest]:
    """Requests of a workload / trace / request-log file; arrivals shifted to start at 0."""
    make = PromptMaker(prompt_kind, seed)
    reqs: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise WorkloadError("expected a JSON object")
                req = parse_line(d, make, default_kind, keep_text)
            except (json.JSONDecodeError, WorkloadError, TypeError, ValueError) as exc:
                raise WorkloadError(f"{path}:{no}: {exc}") from None
            if req is not None:
                reqs.append(req)
    if not reqs:
        raise WorkloadError(f"{path}: no requests")
    times = [r.arrival for r in reqs if r.arrival is not None]
    if times:
        if len(times) != len(reqs):
            raise WorkloadError(f"{path}: some lines have an arrival time and some not")
        t0 = min(times)
        reqs.sort(key=lambda r: r.arrival)  # type: ignore[arg-type, return-value]
        for r in reqs:
            r.arrival = r.arrival - t0  # type: ignore[operator]
    return reqs


def save_trace(reqs: list[BenchRequest], path: str) -> None:
    """Writes requests as a replayable trace (lengths and arrival offsets, no text)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            d: dict = {"arrival_s": r.arrival if r.arrival is not None else 0.0,
                       "endpoint": {"completion": "completions", "chat": "chat",
                                    "embedding": "embeddings"}[r.kind]}
            if r.kind == "embedding":
                d["input_tokens"] = r.input_lengths
            else:
                d["prompt_tokens"] = r.prompt_tokens
                d["output_tokens"] = r.max_tokens
            f.write(json.dumps(d) + "\n")


# ---------------------------------------------------------------------------- request bodies
def payload(req: BenchRequest, model: str, stream: bool = True, ignore_eos: bool = True,
            extra: dict | None = None, temperature: float = 0.0,
            embedding_model: str | None = None) -> dict:
    """The OpenAI request body of one bench request."""
    if req.kind == "embedding":
        body: dict = {"input": req.inputs}
        if embedding_model:
            body["model"] = embedding_model
    else:
        body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True
        if req.kind == "chat":
            content = req.prompt if isinstance(req.prompt, str) else " ".join(
                _WORDS[t % len(_WORDS)] for t in (req.prompt or []))
            body["messages"] = [{"role": "user", "content": content}]
        else:
            body["prompt"] = req.prompt
    if extra and req.kind != "embedding":
        body.update(extra)
    if req.extra:
        body.update(req.extra)
    return body
