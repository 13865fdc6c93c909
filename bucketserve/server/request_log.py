"""`bucketserve serve --request-log FILE`: one JSON line per finished request.

Generation (one line per choice, i.e. per engine request):
  {"arrival": unix s, "endpoint": "completions" | "chat", "request_id", "prompt_tokens",
   "output_tokens", "bucket": prefill bucket of its first step, "queue_s", "ttft_s", "e2e_s",
   "finish_reason"}
Embeddings (one line per HTTP request):
  {"arrival", "endpoint": "embeddings", "input_tokens": [length per input],
   "buckets": [bucket per input], "e2e_s", "finish_reason": "stop"}
Times are seconds; `arrival` is wall-clock (unix) time, converted from the engine's monotonic
clock. No prompt or output text is written unless the log was opened with `text=True`
(`--request-log-text`), and then only the generated text. `bucketserve bench --trace FILE`
replays such a file; `bucketserve tune-buckets FILE` tunes buckets for it.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TextIO

from bucketserve.engine.outputs import RequestOutput


def _endpoint(request_id: str) -> str:
    return "chat" if request_id.startswith("chatcmpl") else "completions"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class RequestLog:
    def __init__(self, path: str, text: bool = False) -> None:
        self.path = path
        self.text = text
        self._f: TextIO = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()
        # monotonic -> unix: fixed at start (both clocks advance together)
        self._offset = time.time() - time.monotonic()

    def _write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)

    def record_generation(self, out: RequestOutput) -> None:
        """A finished choice, from its final RequestOutput."""
        m = out.metrics
        arrival = m.get("arrival")
        if arrival is None:
            return

        def since(key: str) -> float | None:
            return _r(m[key] - arrival) if key in m else None

        bucket = m.get("bucket")
        record = {
            "arrival": round(arrival + self._offset, 6),
            "endpoint": _endpoint(out.request_id),
            "request_id": out.request_id,
            "prompt_tokens": out.num_prompt_tokens,
            "output_tokens": out.num_output_tokens,
            "bucket": int(bucket) if bucket is not None else None,
            "queue_s": since("first_scheduled"),
            "ttft_s": since("first_token"),
            "e2e_s": since("finished"),
            "finish_reason": out.finish_reason,
        }
        if self.text:
            record["text"] = out.text
        self._write(record)

    def record_embeddings(self, arrival_monotonic: float, lengths: list[int], buckets: list[int],
                          finish_reason: str = "stop") -> None:
        """A finished /v1/embeddings request (its inputs' token counts and buckets)."""
        self._write({
            "arrival": round(arrival_monotonic + self._offset, 6),
            "endpoint": "embeddings",
            "input_tokens": lengths,
            "buckets": buckets,
            "e2e_s": _r(time.monotonic() - arrival_monotonic),
            "finish_reason": finish_reason,
        })

    def close(self) -> None:
        with self._lock:
            self._f.close()
