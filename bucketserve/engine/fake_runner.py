"""A stand-in model runner for measuring the engine's host work alone (bench/core_overhead.py).

Off unless a benchmark installs it: `install(engine, step_s)` in bench code, or passed to
the server as `Seams(prepare_engine=partial(install, step_s=S))` (bucketserve/bench/hooks.py);
no production module imports it, nothing in the HTTP API can turn it on. Everything of a
real step runs (scheduling, `StepInputs.fill` into the runner's own host buffers, the
placeholder bookkeeping of overlapped scheduling, token stops, output processing, the core's
message) except the forward and the sampling: each sampled row gets a token id at once,
from a band of ordinary vocabulary ids (never EOS), chosen from the sequence's length so
that runs repeat.

STEP_S > 0 stands in for the device: a step's ids are ready STEP_S seconds after its launch
(`RunnerStep.result()` sleeps until then), so with overlapped scheduling the host work of
the next step hides behind it exactly as it does behind a GPU step. STEP_S = 0: the steps
cost only their host work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bucketserve.engine.runner import ModelRunner, RunnerOutput, RunnerStep
from bucketserve.engine.scheduler import ScheduledBatch

log = logging.getLogger("bucketserve.core")


class _FakeStep(RunnerStep):
    def __init__(self, batch: ScheduledBatch, sample_seqs: list[int], ids: list[int],
                 ready_at: float) -> None:
        super().__init__(batch, 0, sample_seqs)
        self._ids = ids
        self._ready_at = ready_at

    def result(self) -> RunnerOutput:
        if self._output is None:
            wait = self._ready_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            self._output = RunnerOutput(self.sample_seqs, self._ids)
        return self._output


class FakeRunner:
    """ModelRunner's `launch` / `run` without a model: fill the host inputs, make up the ids."""

    def __init__(self, runner: ModelRunner, vocab_size: int, eos_token_ids: set[int],
                 step_s: float = 0.0) -> None:
        self.inputs = runner.inputs  # the real runner's host buffers: the same fill work
        self.step_s = step_s
        self.lo = min(1000, vocab_size // 4)
        self.span = max(min(vocab_size - 1, 30000), vocab_size // 2) - self.lo
        self.eos = set(eos_token_ids)
        self._busy_until = 0.0  # the fake device runs one step at a time
        self._last_index: dict = {}
        self.step_timing = runner.step_timing
        self.num_graph_steps = self.num_piecewise_steps = self.num_cost_eager_steps = 0
        self.num_placeholder_tokens = 0

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.launch(batch).result()

    def launch(self, batch: ScheduledBatch,
               before_sample: Callable[[], None] | None = None) -> RunnerStep:
        if before_sample is not None:
            before_sample()
        return self._made_up(batch)

    def launch_forward(self, batch: ScheduledBatch) -> ScheduledBatch:
        return batch  # (the ids are made up at the sampling: nothing to queue)

    def prepare_forward(self, batch: ScheduledBatch, after=None) -> ScheduledBatch:
        return batch  # (schedule_ahead's halves of launch_forward: nothing to prepare)

    def enqueue_forward(self, batch: ScheduledBatch) -> ScheduledBatch:
        return batch

    def sample_queued(self, batch: ScheduledBatch,
                      before_sample: Callable[[], None] | None = None,
                      pending_offset: int = 0) -> RunnerStep:
        return self.launch(batch, before_sample)  # (made-up ids: no min_tokens to offset)

    def _made_up(self, batch: ScheduledBatch) -> RunnerStep:
        t0 = time.perf_counter()
        plan = self.inputs.fill(batch, self._last_index)
        self.num_placeholder_tokens += len(plan.placeholder_rows)
        seq_lens, lo, span = plan.seq_lens, self.lo, self.span
        ids = [lo + (seq_lens[i] * 7919) % span for i in plan.sample_seqs]
        if self.eos:
            ids = [t + 1 if t in self.eos else t for t in ids]
        self._last_index = dict(zip(plan.sampled(batch.seqs), range(len(ids)), strict=True))
        now = time.perf_counter()
        self.step_timing["prepare_s"] += now - t0
        self._busy_until = max(now, self._busy_until) + self.step_s
        return _FakeStep(batch, plan.sample_seqs, ids, self._busy_until)


def install(engine, step_s: float = 0.0) -> FakeRunner:
    """Replaces `engine.runner` by a FakeRunner (after the engine's warm-up, with no request
    left). The KV pool is not used any more, so the block manager is rebuilt as large as the
    running sequences can ever fill (what a large GPU gives a small model), whatever the
    TOML's cpu_memory_gib allocated for the real runner's warm-up."""
    from bucketserve.engine.block_manager import BlockManager

    if engine.has_unfinished():
        raise RuntimeError("install the fake runner on an idle engine")
    fake = FakeRunner(engine.runner, engine.tokenizer.vocab_size, engine.tokenizer.eos_token_ids,
                      step_s)
    engine.runner = fake
    b, old = engine.buckets, engine.block_manager
    blocks = engine.max_running * -(-engine.max_model_len // b.block_size) + 1
    bm = BlockManager(blocks, b.block_size, enable_caching=old.enable_caching,
                      cache_key=(engine.model_name, "fake"))
    engine.block_manager = engine.scheduler.blocks = bm
    engine.stats.kv_blocks_total = bm.num_usable_blocks
    log.warning("FAKE RUNNER: no model forward, made-up token ids, %.1f ms steps", step_s * 1e3)
    return fake
