"""The engine: add requests, step, generate.

One step: `scheduler.schedule()` picks the work, `runner.launch()` queues the forward and
the sampling on the device, `scheduler.on_launched()` counts the step's tokens as computed;
then a step's sampled ids are read back (`RunnerStep.result()`, the one host sync) and
`_resolve` hands each token to `scheduler.on_sampled()` (stops, freeing blocks) and to the
output processor (text, stop strings).

Overlapped scheduling (`async_scheduling`, by default on for CUDA): step N is resolved after step
N+1 has been scheduled and launched, so the host schedules, builds inputs and processes
outputs while the device computes. A decode row of N+1 reads its input id from N's sampled
ids on the device; a stop found in N's tokens ends the sequence one step late, and the
token N+1 computed for it is dropped. Without it, each step is resolved right after its
launch. Greedy outputs are the same either way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable

import torch

from bucketserve.buckets import BucketsConfig, BucketSpec, load_buckets
from bucketserve.engine.admission import RequestError, admit
from bucketserve.engine.block_manager import BlockManager
from bucketserve.engine.faults import FaultPlan
from bucketserve.engine.kv_budget import KVLayout, StepLimits, gpu_kv_budget_blocks
from bucketserve.engine.messages import RequestLimits
from bucketserve.engine.output_processor import OutputProcessor
from bucketserve.engine.outputs import RequestOutput
from bucketserve.engine.runner import ModelRunner, QueuedForward, RunnerStep
from bucketserve.engine.sampler import Sampler
from bucketserve.engine.scheduler import ScheduledBatch, Scheduler
from bucketserve.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from bucketserve.engine.stats import EngineStats, StepStats
from bucketserve.kernels.cpu_plan import CpuPlan, resolve_cpu_plan
from bucketserve.kernels.quant import QuantPlan, resolve_quant_plan

log = logging.getLogger(__name__)


FINISHED = SequenceStatus.FINISHED
# (sequence, error): a sequence that got a token or ended in a step; error: why it failed
News = tuple[Sequence, str | None]

# Steps failing one after the other before the engine gives up (a part that stays broken).
MAX_FAILED_STEPS = 3


OVERLAP_FILL_ENV = "BUCKETSERVE_OVERLAP_FILL"


def _once_per_sequence(news: list[News]) -> list[News]:
    """News with one entry per sequence, the last of each (an error, if any, is kept)."""
    last: dict[int, News] = {}
    for seq, error in news:
        prev = last.get(id(seq))
        last[id(seq)] = (seq, error if error is not None or prev is None else prev[1])
    return list(last.values()) if len(last) < len(news) else news


def _thread_accepts(seqs: list[Sequence], out) -> tuple[dict[int, bool], object | None]:
    """`_accept_guided` with the xgrammar rows' accepts left for the fill thread
    (BUCKETSERVE_OVERLAP_FILL=4): ({row: accepted} of the rows accepted here, llguidance's,
    and a structured.BatchAccepts of xgrammar's, not yet run, or None where fewer than two
    are left: then they are accepted here too)."""
    accepted: dict[int, bool] = {}
    states, tokens, js = [], [], []
    for j, (i, token) in enumerate(zip(out.seqs, out.ids, strict=True)):
        seq = seqs[i]
        grammar = seq.grammar
        if grammar is not None and seq.status is not FINISHED:
            if grammar.llguidance:
                accepted[j] = grammar.accept(token)
            else:
                states.append(grammar)
                tokens.append(token)
                js.append(j)
    if len(js) < 2:
        for grammar, token, j in zip(states, tokens, js, strict=True):
            accepted[j] = grammar.accept(token)
        return accepted, None
    from bucketserve.engine.structured import BatchAccepts

    return accepted, BatchAccepts(states, tokens, js)


def _accept_guided(seqs: list[Sequence], out) -> dict[int, bool]:
    """The guided sequences' grammars accept a step's sampled tokens (`out`: the step's
    RunnerOutput over `seqs`), ahead of the rest of its resolve: {index in out: accepted}.
    (One batch call here, structured.BatchAccepts, took as long as this loop on a 2-core
    Xeon, 0.52-0.53 against 0.51-0.54 ms a step for 128 rows: the matchers' own work, not
    the calls, is most of it.)"""
    accepted: dict[int, bool] = {}
    for j, (i, token) in enumerate(zip(out.seqs, out.ids, strict=True)):
        seq = seqs[i]
        if seq.grammar is not None and seq.status is not FINISHED:
            accepted[j] = seq.grammar.accept(token)
    return accepted


class LLMEngine:
    def __init__(self, loaded, buckets: BucketsConfig, device: str | torch.device = "cpu",
                 num_blocks: int | None = None, cuda_graphs: bool = True,
                 piecewise_graphs: bool = True, async_scheduling: bool | None = None,
                 nvtx: bool = False, quant: QuantPlan | None = None,
                 faults: FaultPlan | None = None, cpu: CpuPlan | None = None,
                 frontend_gpu_bytes: int = 0) -> None:
        """`loaded` is a models.LoadedModel; `num_blocks` overrides the KV budget (tests);
        `faults`: a test's injected failures (engine/faults.py; None in production);
        `cuda_graphs` (CUDA only) captures one decode graph per decode batch size and, with
        `piecewise_graphs`, prefill and mixed steps as graphs too (at the TOML's
        prefill.piecewise_sizes; prefill.mixed_graphs: whole steps, or everything but
        attention). `async_scheduling` overlaps each step's
        host work with the previous step's device work (None: the TOML's
        scheduler.async_scheduling). `nvtx` (CUDA only) wraps each step in an NVTX range
        named by its kind and bucket ("decode b=64", "mixed t=2048") for Nsight Systems.
        `quant`: the start-up's kernels.quant.QuantPlan (None: resolved here from the model's
        quantization and the TOML's kv_cache.dtype); its KV dtype is the pool's. `cpu`: the
        start-up's kernels.cpu_plan.CpuPlan (None on the CPU: resolved here from the TOML's
        [cpu] keys). `frontend_gpu_bytes`: what the server's front ends hold on this GPU
        (their encoders), counted against gpu_memory_fraction when the KV pool is sized."""
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = loaded.max_model_len
        self.buckets = buckets
        self.frontend_gpu_bytes = frontend_gpu_bytes
        self.device = torch.device(device)
        # the step token budget on this device ("auto" resolves per device)
        self.max_batched_tokens = buckets.step_token_budget(self.device.type)
        self.max_running = buckets.running_limit(self.device.type)
        decode_sizes = buckets.decode_graph_sizes(self.device.type)  # none above max_running
        cfg = loaded.config
        dtype = next(loaded.model.parameters()).dtype
        weights = getattr(loaded.model, "quantization", "none")
        if quant is None:
            quant = resolve_quant_plan(self.device, weights, buckets.kv_cache_dtype)
        elif quant.weights != weights:
            raise ValueError(f"the quantization plan says weights {quant.weights!r}; the "
                             f"model was loaded with {weights!r}")
        self.quant = quant
        self.kv_dtype = quant.kv_dtype(dtype)
        layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, buckets.block_size,
                          self.kv_dtype)
        limits = StepLimits(max_num_seqs=self.max_running,
                            max_num_tokens=self.max_batched_tokens,
                            max_model_len=self.max_model_len)
        per_block = layout.bytes_per_block()
        if num_blocks is None:
            num_blocks = self._budget_blocks(layout, limits, cuda_graphs and piecewise_graphs)
        log.info("%s; KV pool %s: %d blocks = %d tokens (%.2f GiB)", quant.describe(),
                 str(self.kv_dtype).removeprefix("torch."), num_blocks,
                 num_blocks * buckets.block_size, num_blocks * per_block / 2**30)
        # prefix cache: block hashes also cover the model, dtype and quantization
        self.block_manager = BlockManager(num_blocks, buckets.block_size,
                                          enable_caching=buckets.prefix_caching,
                                          cache_key=(loaded.name, str(dtype), quant.weights,
                                                     str(self.kv_dtype)))
        self.scheduler = Scheduler(
            self.block_manager,
            prefill_buckets=buckets.prefill_spec,
            decode_buckets=BucketSpec(decode_sizes),
            max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids,
            policy=buckets.policy,
            max_prefill_tokens=buckets.prefill_chunk_tokens(self.device.type),
        )
        sampler = Sampler(self.tokenizer.eos_token_ids)
        if cpu is None and self.device.type == "cpu":
            cpu = resolve_cpu_plan(buckets.cpu_isa, buckets.cpu_gemm, buckets.cpu_threads,
                                   buckets.cpu_c_kernels, buckets.cpu_prefill_attention)
        self.runner = ModelRunner(loaded.model, layout, num_blocks, limits, self.device, dtype,
                                  sampler, cpu)
        self.cuda_info: dict = {}
        if self.device.type == "cuda":
            pw = buckets.piecewise_token_counts(self.max_batched_tokens) if piecewise_graphs else None
            self.cuda_info = self.runner.setup_cuda(
                decode_sizes, use_cuda_graphs=cuda_graphs, piecewise_sizes=pw,
                piecewise_choice=buckets.piecewise_choice, mixed_graphs=buckets.mixed_graphs,
                gemv=buckets.decode_gemv, max_step_tokens=self.max_batched_tokens)
        if async_scheduling is None:
            async_scheduling = buckets.use_async_scheduling(self.device.type)
        self.async_scheduling = async_scheduling
        self.nvtx = nvtx and self.device.type == "cuda"
        self._inflight: RunnerStep | None = None  # launched, not yet resolved (async only)
        # a step whose forward is queued and whose sampling waits for the next call (async
        # only: its sampling reads _inflight's tokens on the host; _after_launch)
        self._queued: tuple[ScheduledBatch, QueuedForward] | None = None
        # A queued guided (or penalised) step's host work, BUCKETSERVE_OVERLAP_FILL (read here;
        # docs/structured-output.md has the measurements):
        #   3 (the default; `schedule_ahead`): the step's mask fill starts on a thread once the
        #     previous step's tokens are accepted, and while xgrammar fills (it releases the
        #     GIL) the rest of that resolve runs, the step after is scheduled and its inputs
        #     prepared, so that its forward is queued right behind this step's sampling;
        #   0: none of that: the fill runs inside the sampling, the next step is scheduled
        #     after it (as before 2026-12-07);
        #   1 (`overlap_fill` alone) and 2 (`early_fill`: the fill starts at the end of the
        #     call that queued the step, when the tokens are on the host by then): experiments
        #   4 (`accepts_on_thread`, experiment): 3, with the previous step's xgrammar accepts
        #     run on the fill thread ahead of the fill (one batch call, which releases the
        #     GIL) while the engine thread resolves the other rows; the guided rows are
        #     resolved last, once their accepts are in
        overlap = os.environ.get(OVERLAP_FILL_ENV, "").strip() or "3"
        if overlap not in ("0", "1", "2", "3", "4"):
            raise ValueError(f"{OVERLAP_FILL_ENV}={overlap!r}: expected 0, 1, 2, 3 or 4")
        self.overlap_fill = overlap != "0"
        self.early_fill = overlap == "2"
        self.schedule_ahead = overlap in ("3", "4")
        self.accepts_on_thread = overlap == "4"
        # schedule_ahead's state: (the next batch, its PreparedForward), and whether this
        # call's step was taken by the scheduler (on_launched) before its sampling
        self._ahead: tuple | None = None
        self._launched_early = False
        # early_fill's account (logged with the core loop's at exit): steps whose tokens were
        # on the host at the end of the call ("taken") or not yet ("missed")
        self.early_fills = {"taken": 0, "missed": 0}
        if overlap in ("1", "2"):
            log.info("experiment: guided mask fills start on a thread %s (%s=%s)",
                     "once the tokens reach the host, as early as the end of the previous call"
                     if self.early_fill else "during the resolve", OVERLAP_FILL_ENV, overlap)
        elif overlap == "0":
            log.info("guided steps: the mask fill inside the sampling, the next step scheduled "
                     "after it (%s=0)", OVERLAP_FILL_ENV)
        elif overlap == "4":
            log.info("experiment: guided accepts on the fill thread, ahead of the fill (%s=4)",
                     OVERLAP_FILL_ENV)
        if os.environ.get("BUCKETSERVE_FILL_THREADS", "").strip():  # a bad value fails here
            from bucketserve.engine.structured import fill_threads

            log.info("experiment: guided mask fills on %d xgrammar threads "
                     "(BUCKETSERVE_FILL_THREADS)", fill_threads())
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.stats.kv_blocks_total = self.block_manager.num_usable_blocks
        self._seqs: dict[str, Sequence] = {}
        self.faults = faults
        self.num_failed_steps = 0  # in a row

    @functools.cached_property
    def grammar_compiler(self):
        """engine/structured.GrammarCompiler, built at the first guided request (xgrammar's
        tokenizer info from our tokenizer, once per engine)."""
        from bucketserve.engine.structured import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size,
                               backend=self.buckets.structured_backend)

    @classmethod
    def from_names(cls, model: str = "smollm2-135m-instruct", buckets_path: str | None = None,
                   device: str = "cpu", dtype: torch.dtype | None = None) -> LLMEngine:
        from bucketserve.models import load_model

        dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        loaded = load_model(model, device=device, dtype=dtype)
        buckets = load_buckets(buckets_path, max_model_len=loaded.max_model_len)
        return cls(loaded, buckets, device)

    def _budget_blocks(self, layout: KVLayout, limits: StepLimits, piecewise_graphs: bool) -> int:
        # No point in more blocks than the running sequences can ever fill.
        useful = self.max_running * -(-self.max_model_len // self.buckets.block_size) + 1
        if self.device.type == "cuda":
            # sized after a warm-up forward at the largest step (kv_budget.gpu_kv_budget_blocks)
            blocks, _ = gpu_kv_budget_blocks(
                self.loaded.model, layout, limits, self.buckets.gpu_memory_fraction, self.device,
                reserve_graph_activations=piecewise_graphs,
                frontend_bytes=self.frontend_gpu_bytes)
            return max(2, min(blocks, useful))
        budget = self.buckets.cpu_memory_gib * 2**30
        return max(2, min(int(budget // layout.bytes_per_block()), useful))

    def info(self) -> dict[str, str]:
        """What runs, for /metrics (bucketserve_engine_info) and `bucketserve bench`'s report:
        model, device, dtype, quantization ("none" | "fp8") and kv_cache_dtype ("auto" |
        "fp8"), those two from the quantization plan resolved at start-up, and
        structured_backend ("xgrammar" | "llguidance")."""
        return {"model": self.model_name, "device": self.device.type,
                "dtype": str(next(self.loaded.model.parameters()).dtype).removeprefix("torch."),
                "quantization": self.quant.weights, "kv_cache_dtype": self.quant.kv_cache,
                "structured_backend": self.buckets.structured_backend}

    # ---- requests ----------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        """What admission checks a request against (engine/admission.py)."""
        return RequestLimits(
            max_model_len=self.max_model_len, vocab_size=self.tokenizer.vocab_size,
            num_kv_blocks=self.block_manager.num_usable_blocks,
            block_size=self.block_manager.block_size, max_waiting=self.buckets.max_waiting,
            queue_timeout_s=self.buckets.queue_timeout_s)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> Sequence:
        if request_id is not None and request_id in self._seqs:
            raise RequestError("request_id", f"request id {request_id!r} is already in use")
        admit(self.limits, prompt_token_ids, params, self.scheduler.num_waiting)
        seq = Sequence(prompt_token_ids, params, request_id=request_id, priority=priority,
                       arrival_time=arrival_time, queue_timeout_s=self.buckets.queue_timeout_s)
        self.add_sequence(seq)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queues a sequence already admitted (engine/admission.py) by the caller."""
        if seq.params.guided is not None:
            seq.grammar = self.grammar_compiler.state(seq.params.guided)
        self._seqs[seq.request_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Takes effect at the next step boundary."""
        if request_id in self._seqs:
            self.scheduler.abort(request_id)

    def finish_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request now with reason "stop" (the front end found a stop string) and
        gives its blocks back; call it between steps. Its final output, or None if it had
        already finished."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, FinishReason.STOP)
        self._ended(seq)
        return self.outputs.output(seq)

    def has_unfinished(self) -> bool:
        return (self._inflight is not None or self._queued is not None
                or self.scheduler.has_unfinished())

    # ---- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and launches one step and returns the outputs of the step resolved in
        this call: the previous one with overlapped scheduling, else this one."""
        output = self.outputs.output
        return [output(seq, error) for seq, error in self.step_news()]

    def step_news(self) -> list[News]:
        """`step()` without building its outputs: (sequence, error) for each sequence that
        got a token or ended in the step, in `step()`'s order. The caller makes each one's
        output (`outputs.output`, or the core's `outputs.seq_output`) before the next step:
        the output processor keeps what was sent, and drops a finished sequence's state."""
        t0 = time.perf_counter()
        results: list[News] = []
        queued, self._queued = self._queued, None
        if queued is not None:
            # the previous call queued this step's forward; its sampling waited for the
            # in-flight step's tokens, which are resolved now, inside sample_queued
            # (its faults fired when its forward was queued)
            batch, forward = queued
            start = ((lambda accepts: self._start_masks(forward, accepts))
                     if self.overlap_fill else None)
            ahead = self.schedule_ahead
            # (with schedule_ahead on_launched counts the step's own token before it
            # samples: a pending offset of -1)
            step = self._launch(batch, results, lambda held: self.runner.sample_queued(
                forward, held, pending_offset=-1 if ahead else 0), needs_host_tokens=True,
                fire_faults=False, start_masks=start,
                then=(lambda: self._schedule_ahead(batch, forward, results)) if ahead else None)
            if step is not None:
                self._after_launch(batch, step, results, t0)
            return results
        batch = self.scheduler.schedule()
        results += self._finished_by_scheduler(batch)
        bm = self.block_manager
        if batch.is_empty:
            prev, self._inflight = self._inflight, None
            if prev is not None:
                results += self._resolve(prev)
            self.stats.set_prefix_cache(bm.query_tokens, bm.hit_tokens, bm.num_cached_blocks)
            self.stats.set_queue(self.scheduler.num_waiting, self.scheduler.num_running,
                                 bm.num_used_blocks)
            return results
        step = self._launch(batch, results, lambda held: self.runner.launch(batch, held))
        if step is not None:
            self._after_launch(batch, step, results, t0)
        return results

    def _finished_by_scheduler(self, batch) -> list[News]:
        return [self._ended(seq, seq.grammar.error if seq.grammar is not None else None)
                for seq in batch.finished]

    def _launch(self, batch, results: list[News],
                launch: Callable[[Callable[[], None] | None], RunnerStep],
                needs_host_tokens: bool | None = None,
                fire_faults: bool = True,
                start_masks: Callable[..., None] | None = None,
                then: Callable[[], None] | None = None) -> RunnerStep | None:
        """Launches `batch` (`launch(before_sample)`: the whole step, or the sampling of a
        queued forward) and resolves the in-flight step: inside the launch, after the forward
        is queued and before the sampling, when this step's sampling reads the newest tokens
        on the host (a grammar's mask or a penalty: the host work overlaps the forward),
        else after it. `needs_host_tokens`: that test's answer where the caller has it (None:
        asked here). `start_masks`: called by the held resolve once its tokens are
        accepted (`overlap_fill`). None: the step failed (its requests' news are in
        `results`). `then`: runs after the held resolve, before the sampling
        (`schedule_ahead`)."""
        prev, self._inflight = self._inflight, None
        held: list[RunnerStep] = []
        if prev is not None and (self._needs_host_tokens(batch) if needs_host_tokens is None
                                 else needs_host_tokens):
            held, prev = [prev], None

        def resolve_held() -> None:
            if held:
                results.extend(self._resolve(held.pop(), start_masks))

        def before_sample() -> None:
            resolve_held()
            if then is not None:
                then()

        self._launched_early = False
        try:
            if fire_faults:
                self._fire_step_faults(batch)
            with self._nvtx(batch):
                step = launch(before_sample if held or then is not None else None)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            resolve_held()
            if prev is not None:
                results += self._resolve(prev)
            results += self._fail_step(batch, exc)
            ahead, self._ahead = self._ahead, None
            if ahead is not None:  # its placeholders wait for tokens this step never made
                results += self._fail_step(ahead[0], exc)
            # a sequence whose token the held resolve gave before the sampling failed has
            # its error too: one entry each (the caller takes one per sequence)
            results[:] = _once_per_sequence(results)
            return None
        resolve_held()
        if not self._launched_early:
            self.scheduler.on_launched(batch, step.sample_seqs)
        if self.async_scheduling:
            self._inflight = step
            if prev is not None:
                results += self._resolve(prev)
        else:
            results += self._resolve(step)
        return step

    def _after_launch(self, batch, step: RunnerStep, results: list[News], t0: float) -> None:
        """Records the step; then, with overlapped scheduling, when the next step's sampling
        must wait for this one's tokens (a grammar, a penalty), schedules it and queues its
        forward now, behind this step's sampling: the device computes it while the caller
        sends this step's outputs and the next call resolves this step. Otherwise the next
        step is scheduled by the next call, as usual."""
        bm = self.block_manager
        # after on_launched: it registers the blocks this step computed
        self.stats.set_prefix_cache(bm.query_tokens, bm.hit_tokens, bm.num_cached_blocks)
        self.stats.record(StepStats(
            kind=batch.kind, bucket=batch.bucket, num_seqs=len(batch.seqs),
            num_prefill_seqs=len(batch.seqs) - batch.num_decodes, num_decode_seqs=batch.num_decodes,
            computed_tokens=batch.num_tokens + step.num_padding, useful_tokens=batch.useful_tokens,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_usable_blocks,
            num_preemptions=batch.num_preemptions, num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running, step_time_s=time.perf_counter() - t0,
            padding_tokens=step.num_padding))
        prepared = None
        if self._launched_early:  # schedule_ahead: the next step is scheduled and prepared
            ahead, self._ahead = self._ahead, None
            if ahead is None:
                return
            nxt, prepared = ahead
        else:
            if not (self.async_scheduling and self._inflight is step and step.sample_seqs
                    and self._needs_host_tokens(batch)):
                return
            nxt = self.scheduler.schedule()
            results += self._finished_by_scheduler(nxt)
            if nxt.is_empty:
                return
        if not self._needs_host_tokens(nxt):  # nothing waits on the host: the whole step now
            t1 = time.perf_counter()
            if prepared is None:
                step = self._launch(nxt, results, lambda held: self.runner.launch(nxt, held),
                                    needs_host_tokens=False)
            else:  # (its faults fired where it was prepared)
                step = self._launch(nxt, results, lambda held: self.runner.sample_queued(
                    self.runner.enqueue_forward(prepared), held), needs_host_tokens=False,
                    fire_faults=False)
            if step is not None:
                self._after_launch(nxt, step, results, t1)
            # this call resolved two steps: a sequence of both has two entries, and the
            # caller takes one per sequence (the core's output state of a sequence that ended
            # goes with its first): keep one, the last (its output covers every new token)
            results[:] = _once_per_sequence(results)
            return
        try:
            if prepared is None:
                self._fire_step_faults(nxt)
            with self._nvtx(nxt):
                self._queued = (nxt, self.runner.launch_forward(nxt) if prepared is None
                                else self.runner.enqueue_forward(prepared))
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            results += self._fail_step(nxt, exc)
            return
        if self.early_fill:
            self._accept_early()

    def _schedule_ahead(self, batch, forward, results: list[News]) -> None:
        """`schedule_ahead`, inside a queued step's launch, after the previous step's resolve
        (the fill of this step's masks running on the thread) and before this step's
        sampling: the scheduler takes this step (on_launched: its sampling then runs with a
        pending offset of -1), and, where `_after_launch` would queue the next step's
        forward, that step is scheduled and its inputs prepared now; `_after_launch` queues
        it right behind the sampling."""
        samples = forward.plan.sample_seqs
        if not samples:
            return
        self.scheduler.on_launched(batch, samples)
        self._launched_early = True
        if not self._needs_host_tokens(batch):
            return
        nxt = self.scheduler.schedule()
        results += self._finished_by_scheduler(nxt)
        if nxt.is_empty:
            return
        try:
            self._fire_step_faults(nxt)
            self._ahead = (nxt, self.runner.prepare_forward(nxt, after=forward))
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            results += self._fail_step(nxt, exc)

    def _accept_early(self) -> None:
        """`early_fill`: when the in-flight step's tokens are on the host already, its guided
        rows accept them now and the queued step's masks start filling on the fill thread,
        while the caller sends this call's outputs; the next call's resolve takes the kept
        accept results (`RunnerStep.early_accepted`). Otherwise that resolve does both, as
        with `overlap_fill`. Never waits for the device."""
        step, queued = self._inflight, self._queued
        if step is None or queued is None or not step.sample_seqs:
            return
        if not step.done():
            self.early_fills["missed"] += 1
            return
        try:
            out = step.result()
        except Exception:  # noqa: BLE001 - raised again, and handled, in the resolve
            return
        step.early_accepted = _accept_guided(step.batch.seqs, out)
        self.early_fills["taken"] += 1
        try:
            self._start_masks(queued[1])
        except Exception:  # noqa: BLE001 - the sampling then fills the masks itself
            log.exception("starting the grammar masks on the fill thread failed")

    def _fire_step_faults(self, batch) -> None:
        """The injected faults of a step's model run (tests and benchmarks only), once per
        step: where its forward is queued, not again at its sampling."""
        if self.faults is not None:
            self.faults.fire("step", (s.token_ids[0] for s in batch.seqs))
            self.faults.fire("oom", (s.token_ids[0] for s in batch.seqs))

    def _start_masks(self, forward, accepts=None) -> None:
        """Starts the grammar masks of a queued step's sampling (`overlap_fill`); `accepts`
        (`accepts_on_thread`): the previous step's, to run first on the fill thread (where
        no fill starts, they do not run: the caller sees `accepts.started` False)."""
        seqs = forward.plan.sampled(forward.batch.seqs)
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if len(rows) > 1:
            self.runner.sampler.start_masks(rows, [seqs[i].grammar for i in rows], len(seqs),
                                            self.grammar_compiler.vocab_size, self.runner.device,
                                            accepts)

    def _resolve(self, step: RunnerStep,
                 start_masks: Callable[..., None] | None = None) -> list[News]:
        """Hands a launched step's sampled tokens to the scheduler and the output processor.
        A sequence that finished after the step was launched (a stop in the previous step's
        tokens, an abort) drops its token: it is never emitted. With `start_masks`, the
        grammars accept their tokens first, then `start_masks(None)` runs, then the rest; where
        `_accept_early` accepted them already (and started the masks), the rest alone. With
        `accepts_on_thread`, the xgrammar rows' accepts run on the fill thread
        (`start_masks(accepts)`): the other rows are resolved meanwhile, those rows last."""
        try:
            out = step.result()  # the step's device work (and errors) surface here
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            return self._fail_step(step.batch, exc)
        self.num_failed_steps = 0
        results: list[News] = []
        seqs = step.batch.seqs
        accepted: dict[int, bool] | None = step.early_accepted  # (`_accept_early`)
        on_thread = None  # structured.BatchAccepts (`accepts_on_thread`)
        if accepted is None and start_masks is not None:
            # a token the next pass ends the sequence with (EOS, max_tokens, a stop) is
            # accepted too: harmless, the sequence ends; a rejection then counts only where
            # the sequence goes on, as when the accept comes after on_sampled
            if self.accepts_on_thread:
                accepted, on_thread = _thread_accepts(seqs, out)
            else:
                accepted = _accept_guided(seqs, out)
            try:
                start_masks(on_thread)
            except Exception:  # noqa: BLE001 - the sampling then fills the masks itself
                log.exception("starting the grammar masks on the fill thread failed")
            if on_thread is not None and not on_thread.started:  # no fill took them
                on_thread()
        rows: Iterable[int] = range(len(out.ids))
        wait_at = -1
        if on_thread is not None:  # those rows last, after the wait for their accepts
            last = set(on_thread.js)
            rows = [j for j in rows if j not in last] + on_thread.js
            wait_at = len(rows) - len(on_thread.js)
        faults = self.faults
        logprobs = out.logprobs
        on_sampled, on_text = self.scheduler.on_sampled, self.outputs.on_text
        out_seqs, out_ids = out.seqs, out.ids
        now = time.monotonic()
        for n, j in enumerate(rows):
            if n == wait_at:
                accepted.update(on_thread.results())
            seq, token = seqs[out_seqs[j]], out_ids[j]
            if seq.status is FINISHED:
                continue
            finished = on_sampled(seq, token)
            grammar = seq.grammar
            if grammar is not None and not finished:
                if not (accepted[j] if accepted is not None else grammar.accept(token)):
                    self.scheduler.finish(seq, FinishReason.ERROR)
                    self.outputs.drop_text(seq)
                    results.append(self._ended(
                        seq, f"the grammar rejected sampled token {token}"))
                    continue
                if grammar.terminated:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    finished = True
            if seq.first_token_time is None:
                seq.first_token_time = now
            if logprobs is not None and logprobs[j] is not None:
                seq.logprobs.append(logprobs[j])
            if seq.params.detokenize:  # text and stop strings (else: the front end's)
                try:
                    if faults is not None:
                        faults.fire("detok", (seq.token_ids[0],))
                    stop = on_text(seq, token)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    log.exception("output processing failed for %s", seq.request_id)
                    self.scheduler.finish(seq, FinishReason.ERROR)
                    self.outputs.drop_text(seq)
                    results.append(self._ended(
                        seq, f"turning the output into text failed: {type(exc).__name__}: {exc}"))
                    continue
                if stop and not finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    finished = True
            results.append(self._ended(seq) if finished else (seq, None))
        return results

    @staticmethod
    def _needs_host_tokens(batch) -> bool:
        """A sequence with a pending token whose sampling reads its token history
        (repetition, presence or frequency penalties; a grammar, whose matcher must accept
        the pending token before it gives the next mask): the previous step must be resolved
        before this one samples."""
        for seq in batch.seqs:  # (Sequence.penalised: read from the params once)
            if seq.num_pending and (seq.penalised or seq.grammar is not None):
                return True
        return False

    def _nvtx(self, batch):
        if not self.nvtx:
            return contextlib.nullcontext()
        if batch.kind == "decode":
            name = f"decode b={batch.bucket}"
        else:
            name = f"{batch.kind} t={batch.num_tokens}"
        return torch.cuda.nvtx.range(name)

    def _ended(self, seq: Sequence, error: str | None = None) -> News:
        self._seqs.pop(seq.request_id, None)
        self.stats.record_finished(seq.finish_reason.value)
        return seq, error

    def _fail_step(self, batch, exc: Exception) -> list[News]:
        """A step whose model run raised: its sequences end with an error and give their KV
        blocks back; the engine serves on. After MAX_FAILED_STEPS failures in a row the part
        is taken as broken and the exception goes on (the engine loop stops)."""
        self.num_failed_steps += 1
        log.error("engine step failed (%d in a row) for %d request(s): %s: %s",
                  self.num_failed_steps, len(batch.seqs), type(exc).__name__, exc,
                  exc_info=exc)
        if isinstance(exc, torch.OutOfMemoryError) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.num_failed_steps >= MAX_FAILED_STEPS:
            raise exc
        message = f"the engine step running this request failed: {type(exc).__name__}: {exc}"
        outputs = []
        for seq in batch.seqs:
            if seq.is_finished:  # ended before (a stop learnt late, an abort): reported then
                continue
            self.scheduler.finish(seq, FinishReason.ERROR)
            self.outputs.drop_text(seq)
            outputs.append(self._ended(seq, message))
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 priorities: list[int] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion; one final output per prompt, in order.

        Each output carries the whole text and token ids of its request."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            seq = self.add_request(prompt, p, priority=priorities[i] if priorities else 0)
            ids.append(seq.request_id)
        final: dict[str, RequestOutput] = {}
        output = self.outputs.output
        while self.has_unfinished():
            for seq, error in self.step_news():
                if seq.status is FINISHED:  # (only the final outputs are returned: all
                    final[seq.request_id] = output(seq, error)  # tokens, text, logprobs)
        return [final[rid] for rid in ids]
