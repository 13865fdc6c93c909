"""The engine core: a loop that only takes requests in, steps the engine and sends results out.

    while running:
        take every waiting input (add / abort / finish / shutdown)   -- the step boundary
        if there is work: one LLMEngine.step(), then ONE StepOutputs message for the step
        elif some requests were finished by the inputs: one StepOutputs with just those

Requests reach the core with `detokenize=False` and no stop strings: text and stop strings
are the front end's work (engine/async_engine.py), so a step's message holds token ids only.
The same loop runs in its own process (`run_core_process`, ZeroMQ + msgpack: the default
for `bucketserve serve`) or in a thread of the front end's process (AsyncEngine.in_process:
the Python API, tests), so both modes share every line of it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from bucketserve.engine.faults import FaultPlan, Seams
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreReady,
    FinishRequests,
    SeqOutput,
    Shutdown,
    StepOutputs,
    TokenizerSpec,
    input_codec,
    output_codec,
)
from bucketserve.engine.options import EngineOptions
from bucketserve.engine.outputs import RequestOutput
from bucketserve.engine.sequence import GuidedDecoding, SamplingParams, Sequence

log = logging.getLogger("bucketserve.core")

# benchmarks only: the core process profiles its loop with cProfile into this file
IDLE_WAIT_S = 0.1  # how long an idle core waits for input before it checks on its parent


def tokenizer_spec(tokenizer) -> TokenizerSpec:
    return TokenizerSpec(backend_json=tokenizer.backend.to_str(), bos_token=tokenizer.bos_token,
                         eos_token=tokenizer.eos_token,
                         eos_token_ids=sorted(tokenizer.eos_token_ids),
                         chat_template=tokenizer.chat_template)


def tokenizer_from_spec(spec: TokenizerSpec):
    """The core's tokenizer, rebuilt in the front end (no model file is read)."""
    from tokenizers import Tokenizer as Backend

    from bucketserve.models.tokenizer import Tokenizer

    tok = Tokenizer(Backend.from_str(spec.backend_json), bos_token=spec.bos_token,
                    eos_token=spec.eos_token, chat_template=spec.chat_template)
    tok.eos_token_ids = set(spec.eos_token_ids)
    return tok


class EngineCore:
    """An LLMEngine behind the input messages, producing one StepOutputs per step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_added = 0
        self._finished: list[SeqOutput] = []  # ended by inputs, reported with the next message

    def ready(self) -> CoreReady:
        e = self.engine
        return CoreReady(model_name=e.model_name, limits=e.limits,
                         kv_blocks_total=e.block_manager.num_usable_blocks,
                         tokenizer=tokenizer_spec(e.tokenizer), pid=os.getpid(), info=e.info())

    def handle(self, msg: CoreInput) -> None:
        if isinstance(msg, AddRequest):
            # Admitted by the front end (engine/admission.py): no second check here.
            self.engine.add_sequence(Sequence(
                msg.prompt_token_ids, msg.params, request_id=msg.request_id,
                priority=msg.priority, arrival_time=msg.arrival_time,
                queue_timeout_s=self.engine.buckets.queue_timeout_s))
            self.num_added += 1
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort(rid)
        elif isinstance(msg, FinishRequests):
            for rid in msg.request_ids:
                out = self.engine.finish_request(rid)
                if out is not None:
                    self._finished.append(seq_output(out))

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def has_news(self) -> bool:
        return bool(self._finished)

    def step(self) -> StepOutputs:
        """One engine step (if there is work) and everything it produced, in one message."""
        engine = self.engine
        outputs, self._finished = self._finished, []
        stats = None
        rids: list[str] = []
        tokens: list[int] = []
        if engine.has_unfinished():
            steps = engine.stats.num_steps
            engine.outputs.add_news(engine.step_news(), outputs, rids, tokens)
            if engine.stats.num_steps != steps:
                stats = engine.stats.recent[-1]
        sched, bm = engine.scheduler, engine.block_manager
        return StepOutputs(outputs=outputs, stats=stats, num_waiting=sched.num_waiting,
                           num_running=sched.num_running, kv_blocks_used=bm.num_used_blocks,
                           num_added=self.num_added, prefix_queries_total=bm.query_tokens,
                           prefix_hits_total=bm.hit_tokens,
                           prefix_cached_blocks=bm.num_cached_blocks,
                           token_request_ids=rids, tokens=tokens)


def seq_output(out: RequestOutput) -> SeqOutput:
    return SeqOutput(out.request_id, out.new_token_ids, out.finish_reason,
                     out.new_logprobs or None, out.metrics or None,
                     out.error if out.finish_reason == "error" else None)


def run_core_loop(core: EngineCore, receive: Callable[[float], Iterable[CoreInput]],
                  send: Callable[[StepOutputs], None],
                  keep_going: Callable[[], bool] = lambda: True,
                  timing: dict[str, float] | None = None) -> None:
    """The core loop. `receive(timeout_s)` returns every input available, waiting up to
    timeout_s for the first; `send` delivers one message; `keep_going` is asked between
    steps (the process core checks that its front end still exists). `timing` (optional)
    accumulates the busy loop's seconds: "intake_s" (reading and handling inputs while
    there is work), "step_s" (the engine step and its message), "send_s", and "steps"."""
    clock = time.perf_counter
    t = timing if timing is not None else {}
    for key in ("intake_s", "step_s", "send_s", "steps"):
        t.setdefault(key, 0.0)
    while keep_going():
        busy = core.has_work() or core.has_news()
        t0 = clock()
        for msg in receive(0.0 if busy else IDLE_WAIT_S):
            if isinstance(msg, Shutdown):
                return
            core.handle(msg)
        if core.has_work() or core.has_news():
            t1 = clock()
            msg = core.step()
            t2 = clock()
            send(msg)
            if busy:
                t["intake_s"] += t1 - t0
            t["step_s"] += t2 - t1
            t["send_s"] += clock() - t2
            t["steps"] += 1


def log_core_timing(timing: dict[str, float], engine: LLMEngine) -> None:
    """One line at exit: where the busy core loop's host time went, per step."""
    n = int(timing.get("steps", 0))
    if not n:
        return
    rt = engine.runner.step_timing
    per = {k: timing[k] / n * 1e6 for k in ("intake_s", "step_s", "send_s")}
    log.info("core loop: %d steps; per step (us): intake %.0f, engine step + message %.0f "
             "(runner: prepare %.0f, forward launch %.0f, sampling launch %.0f, waiting for "
             "the device %.0f), send %.0f", n, per["intake_s"], per["step_s"],
             rt["prepare_s"] / n * 1e6, rt["forward_s"] / n * 1e6, rt["sample_s"] / n * 1e6,
             rt.get("wait_s", 0.0) / n * 1e6, per["send_s"])
    if getattr(engine, "early_fill", False):
        log.info("early mask fills (BUCKETSERVE_OVERLAP_FILL=2): %(taken)d steps with the "
                 "tokens on the host at the end of the call, %(missed)d without",
                 engine.early_fills)


# ---- the core in its own process ---------------------------------------------------------


class Router:
    """The core's side of several front-end processes (--api-workers N).

    Each AddRequest names its front end (`client`); every step's StepOutputs is split into
    one message per front end holding the outputs of its own requests (so each still gets
    exactly one message per step), with the step's stats and queue depths in every one (each
    front end's engine metrics see every step) and that front end's own count of taken-in
    requests. A Shutdown ends the core only once every front end has sent one."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.owner: dict[str, int] = {}
        self.added = [0] * num_clients
        self.shutdowns = 0

    def take(self, msg: CoreInput) -> bool:
        """Notes an input; False for one the core loop must not see (an early Shutdown)."""
        if isinstance(msg, AddRequest):
            if not 0 <= msg.client < self.num_clients:
                raise ValueError(f"AddRequest from unknown front end {msg.client}")
            if self.num_clients > 1:
                self.owner[msg.request_id] = msg.client
            self.added[msg.client] += 1
        elif isinstance(msg, Shutdown):
            self.shutdowns += 1
            return self.shutdowns >= self.num_clients
        return True

    def split(self, msg: StepOutputs) -> list[StepOutputs]:
        if self.num_clients == 1:
            return [msg]
        k = self.num_clients
        parts: list[list[SeqOutput]] = [[] for _ in range(k)]
        rids: list[list[str]] = [[] for _ in range(k)]
        toks: list[list[int]] = [[] for _ in range(k)]
        owner = self.owner
        for o in msg.outputs:
            client = (owner.get(o.request_id, 0) if o.finish_reason is None
                      else owner.pop(o.request_id, 0))
            parts[client].append(o)
        get = owner.get
        for rid, tok in zip(msg.token_request_ids, msg.tokens, strict=True):
            client = get(rid, 0)
            rids[client].append(rid)
            toks[client].append(tok)
        return [msgspec.structs.replace(msg, outputs=parts[c], num_added=self.added[c],
                                        token_request_ids=rids[c], tokens=toks[c])
                for c in range(k)]




@dataclass(frozen=True)
class CoreConfig:
    """What `bucketserve serve` hands the core process (picklable)."""

    options: EngineOptions
    # one (input, output) address pair per front-end process (--api-workers): the core PULLs
    # requests from every input address and PUSHes each front end's StepOutputs to its own
    input_addresses: tuple[str, ...]
    output_addresses: tuple[str, ...]
    parent_pid: int
    seams: Seams | None = None  # a test's or benchmark's stand-ins (engine/faults.py)


def build_engine(options: EngineOptions, faults: FaultPlan | None = None,
                 engine_cores: int | None = None) -> LLMEngine:
    """Model, buckets, KV pool and a warm-up generation (every stage runs once).
    options.quantization / kv_cache_dtype / cpu_* (the CLI flags) override the TOML's
    model.quantization, kv_cache.dtype and [cpu] keys; FP8 on a device without FP8 tensor
    cores raises QuantizationUnsupported, a CPU plan that cannot run here CpuPlanError (both
    one-line ValueErrors) before anything is loaded. `engine_cores`: the cores the engine
    was pinned to (its compute threads where [cpu] threads is "auto")."""
    import dataclasses

    import torch

    from bucketserve.buckets import load_buckets
    from bucketserve.kernels.cpu_plan import resolve_cpu_plan
    from bucketserve.kernels.quant import resolve_quant_plan
    from bucketserve.models import load_model

    device, dtype = options.device, options.dtype
    torch_dtype = ((torch.bfloat16 if device == "cuda" else torch.float32) if dtype == "auto"
                   else getattr(torch, dtype))
    buckets = load_buckets(options.buckets_path)
    threads = options.cpu_threads or buckets.cpu_threads
    buckets = dataclasses.replace(
        buckets, quantization=options.quantization or buckets.quantization,
        kv_cache_dtype=options.kv_cache_dtype or buckets.kv_cache_dtype,
        cpu_isa=options.cpu_isa or buckets.cpu_isa, cpu_gemm=options.cpu_gemm or buckets.cpu_gemm,
        cpu_threads=engine_cores if threads == "auto" and engine_cores else threads,
        structured_backend=options.structured_backend or buckets.structured_backend)
    quant = resolve_quant_plan(device, buckets.quantization, buckets.kv_cache_dtype)
    log.info("%s", quant.describe())
    cpu = None
    if torch.device(device).type == "cpu":
        cpu = resolve_cpu_plan(buckets.cpu_isa, buckets.cpu_gemm, buckets.cpu_threads,
                               buckets.cpu_c_kernels, buckets.cpu_prefill_attention)
    t0 = time.perf_counter()
    loaded = load_model(options.model, device=device, dtype=torch_dtype, quantization=quant.weights)
    t_model = time.perf_counter() - t0
    buckets = buckets.check_model(loaded.max_model_len)
    frontend = options.frontend_gpu_bytes
    if options.frontend_gpu_count and options.frontend_gpu_dir:
        from bucketserve.engine.kv_budget import wait_frontend_reports

        t1 = time.perf_counter()
        frontend += wait_frontend_reports(options.frontend_gpu_dir, options.frontend_gpu_count)
        log.info("%d front ends hold %.2f GiB of the GPU (their encoders; waited %.1f s): "
                 "counted against gpu_memory_fraction", options.frontend_gpu_count,
                 frontend / 2**30, time.perf_counter() - t1)
    engine = LLMEngine(loaded, buckets, device, nvtx=options.nvtx, quant=quant, faults=faults,
                       cpu=cpu, frontend_gpu_bytes=frontend)
    bm = engine.block_manager
    log.info("model %s loaded in %.1f s (max_model_len %d); KV pool: %d blocks of %d tokens",
             engine.model_name, t_model, engine.max_model_len, bm.num_usable_blocks, bm.block_size)
    t1 = time.perf_counter()
    bos = engine.tokenizer.bos_token_id
    engine.generate([[bos if bos is not None else 0]], SamplingParams(max_tokens=2, temperature=0.0))
    # and one guided request: xgrammar's import, the tokenizer info and the device's mask
    # kernel (a JIT compile) happen here, not in the step of the first schema a user sends
    try:
        engine.generate([[bos if bos is not None else 0]], SamplingParams(
            max_tokens=2, temperature=0.0, guided=GuidedDecoding("choice", '["0"]')))
    except Exception as exc:  # noqa: BLE001 - plain requests still work; guided ones will say why
        log.warning("guided decoding warm-up failed: %s: %s", type(exc).__name__, exc)
    log.info("structured output: %s%s", buckets.structured_backend,
             " (EBNF grammars on xgrammar)" if buckets.structured_backend == "llguidance" else "")
    log.info("warm-up done in %.2f s; buckets prepared (eager on %s): prefill %s, decode batch sizes %s",
             time.perf_counter() - t1, device, list(buckets.prefill_boundaries),
             buckets.decode_graph_sizes(engine.device.type))
    log.info("scheduler: max_running %d, max_waiting %d, max_batched_tokens %d, queue timeout "
             "%.1f s, policy %s", engine.max_running, buckets.max_waiting,
             engine.max_batched_tokens, buckets.queue_timeout_s, buckets.policy)
    if engine.cuda_info.get("gemv"):
        log.info("one-row projections (decode.gemv = %s, measured in %.1f s): %s",
                 buckets.decode_gemv, engine.cuda_info.get("gemv_s", 0.0),
                 ", ".join(f"{k} {v['choice']}" for k, v in engine.cuda_info["gemv"].items()))
    return engine


SWITCH_INTERVAL_ENV = "BUCKETSERVE_SWITCH_INTERVAL_US"


def apply_switch_interval(value: str | None = None) -> float | None:
    """Experiment (off: Python's 5 ms): `$BUCKETSERVE_SWITCH_INTERVAL_US` sets the core
    process's GIL switch interval, in microseconds. A thread that wants the GIL back (the
    engine loop after a call that released it, a fill thread before and after its xgrammar
    call) waits up to that long for a thread running Python to hand it over. Returns the
    interval set, in seconds (None: unset). Raises ValueError on a malformed value."""
    value = os.environ.get(SWITCH_INTERVAL_ENV, "") if value is None else value
    if not value.strip():
        return None
    try:
        us = float(value)
    except ValueError:
        us = 0.0
    if not 1.0 <= us <= 1e6:
        raise ValueError(f"{SWITCH_INTERVAL_ENV}={value!r}: expected microseconds, 1 to 1e6")
    sys.setswitchinterval(us / 1e6)
    log.info("experiment: the core's GIL switch interval is %g us (%s)", us, SWITCH_INTERVAL_ENV)
    return us / 1e6


def run_core_process(cfg: CoreConfig) -> None:
    """Entry point of the core process: build the engine, say READY, loop until told to stop
    or until the front end is gone (no orphan core). Exits 1 if the engine fails."""
    import zmq

    # Ctrl-C / a supervisor's SIGTERM to the whole group is the front end's to handle: it
    # drains, then sends Shutdown. The core ends on that message or when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=cfg.options.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 1000)
    for address in cfg.input_addresses:  # one socket, fair-queued over every front end
        inbox.connect(address)
    outboxes = []
    for address in cfg.output_addresses:
        outbox = ctx.socket(zmq.PUSH)
        outbox.setsockopt(zmq.LINGER, 1000)
        outbox.connect(address)
        outboxes.append(outbox)
    in_enc, in_dec = input_codec()
    out_enc, _ = output_codec()
    del in_enc
    router = Router(len(outboxes))

    def send_all(data: bytes, flags: int = 0) -> None:
        for outbox in outboxes:
            outbox.send(data, flags)

    def parent_alive() -> bool:
        return os.getppid() == cfg.parent_pid

    code = 0
    try:
        try:
            # BUCKETSERVE_CPU_AFFINITY (kernels/cpu_threads.py)
            from bucketserve.kernels.cpu_threads import apply_engine_layout

            cores = apply_engine_layout(cfg.options.device)
            apply_switch_interval()
            if cfg.options.device != "cpu":
                cores = None  # (the CPU plan's threads only)
            seams = cfg.seams or Seams()
            engine = build_engine(cfg.options, seams.faults, cores)
            if seams.prepare_engine is not None:
                seams.prepare_engine(engine)
            core = (seams.make_core or EngineCore)(engine)
        except (FileNotFoundError, ValueError) as exc:  # a bad model name, file or config
            send_all(out_enc.encode(CoreFailed(str(exc))))
            code = 2
            return
        send_all(out_enc.encode(core.ready()))

        events, pollin, noblock = zmq.EVENTS, zmq.POLLIN, zmq.NOBLOCK

        def receive(timeout_s: float) -> list[CoreInput]:
            # a busy core asks the socket's event flags (no syscall, no exception) before
            # it reads; only an idle one polls, with a timeout
            msgs = []
            if timeout_s > 0:
                if not inbox.poll(int(timeout_s * 1000)):
                    return msgs
            elif not inbox.getsockopt(events) & pollin:
                return msgs
            while inbox.getsockopt(events) & pollin:
                msg = in_dec.decode(inbox.recv(noblock))
                if router.take(msg):
                    msgs.append(msg)
            return msgs

        def send(msg: StepOutputs) -> None:
            # copied sends: a zero-copy send of a message this small (a few KiB) costs more
            # (a frame object and a release callback per send) than the copy
            for outbox, part in zip(outboxes, router.split(msg), strict=True):
                outbox.send(out_enc.encode(part))

        profile_path = seams.profile_path  # benchmarks only: cProfile of the loop
        timing: dict[str, float] = {}
        if profile_path:
            import cProfile

            prof = cProfile.Profile()
            try:
                prof.runcall(run_core_loop, core, receive, send, parent_alive, timing)
            finally:
                prof.dump_stats(profile_path)
        else:
            run_core_loop(core, receive, send, parent_alive, timing)
        log_core_timing(timing, engine)
        if not parent_alive():
            log.warning("the front end is gone: engine core exits")
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, then exit 1
        log.exception("engine core failed")
        try:
            send_all(out_enc.encode(CoreFailed(f"{type(exc).__name__}: {exc}")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        code = 1
    finally:
        inbox.close(0)
        for outbox in outboxes:
            outbox.close()
        ctx.term()
        if code:
            sys.exit(code)
