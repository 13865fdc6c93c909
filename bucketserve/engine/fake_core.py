"""A stand-in engine core for measuring the front end alone (bench/frontend_capacity.py).

Passed in by a benchmark (`Seams(make_core=partial(FakeCore, step_s=0.005))`, see
bucketserve/bench/hooks.py); no production module imports it, nothing in the HTTP API can
turn it on. `step_s` is the step period in seconds. The real engine is still built (model, tokenizer, limits, warm-up: the front
end sees exactly what it sees in production), but the loop never runs the model: every
`step` (at most one per period) admits waiting requests up to max_running, gives each
running sequence one token at once, and finishes it with "length" after its max_tokens. So
a front end that keeps up sees max_running / period tokens per second, and what it does
not keep up with shows as lower throughput, measured against an engine that costs nothing.

Token ids cycle through a band of ordinary vocabulary entries, so detokenization does the
same work per token as for real text. Logprobs are not produced.
"""

from __future__ import annotations

import time
from collections import deque

from bucketserve.engine.core import EngineCore
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    FinishRequests,
    SeqOutput,
    StepOutputs,
)


class _Seq:
    __slots__ = ("rid", "left", "made", "arrival", "next_id")

    def __init__(self, msg: AddRequest, first_id: int) -> None:
        self.rid = msg.request_id
        self.left = msg.params.max_tokens
        self.made = 0
        self.arrival = msg.arrival_time
        self.next_id = first_id


class FakeCore(EngineCore):
    """EngineCore's interface (handle / has_work / has_news / step / ready) without a model."""

    def __init__(self, engine: LLMEngine, step_s: float) -> None:
        super().__init__(engine)
        self.step_s = step_s
        self.max_running = engine.max_running
        self.waiting: deque[_Seq] = deque()
        self.running: dict[str, _Seq] = {}
        vocab = engine.limits.vocab_size
        self._lo, self._hi = min(1000, vocab // 4), max(min(vocab - 1, 30000), vocab // 2)
        self._last = 0.0

    def handle(self, msg: CoreInput) -> None:
        if isinstance(msg, AddRequest):
            self.num_added += 1
            start = self._lo + (self.num_added * 7919) % (self._hi - self._lo)
            self.waiting.append(_Seq(msg, start))
        elif isinstance(msg, (AbortRequests, FinishRequests)):
            reason = "abort" if isinstance(msg, AbortRequests) else "stop"
            for rid in msg.request_ids:
                if self.running.pop(rid, None) is not None or self._drop_waiting(rid):
                    self._finished.append(SeqOutput(rid, [], reason))

    def _drop_waiting(self, rid: str) -> bool:
        for s in self.waiting:
            if s.rid == rid:
                self.waiting.remove(s)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepOutputs:
        wait = self._last + self.step_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        now = self._last = time.monotonic()
        outputs, self._finished = self._finished, []
        while self.waiting and len(self.running) < self.max_running:
            s = self.waiting.popleft()
            self.running[s.rid] = s
        lo, span = self._lo, self._hi - self._lo
        done = []
        for s in self.running.values():
            token = s.next_id
            s.next_id = lo + (token - lo + 1) % span
            s.made += 1
            s.left -= 1
            metrics = None
            if s.made == 1:
                metrics = {"first_scheduled": now, "first_token": now}
            if s.left <= 0:
                done.append(s.rid)
                metrics = {"arrival": s.arrival, "first_scheduled": now, "first_token": now,
                           "finished": now} if s.made == 1 else {"finished": now}
                outputs.append(SeqOutput(s.rid, [token], "length", None, metrics))
            else:
                outputs.append(SeqOutput(s.rid, [token], None, None, metrics))
        for rid in done:
            del self.running[rid]
        return StepOutputs(outputs=outputs, stats=None, num_waiting=len(self.waiting),
                           num_running=len(self.running), kv_blocks_used=0,
                           num_added=self.num_added)
