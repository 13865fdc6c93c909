"""The engine core loop and the front end over it, in process (CPU, tiny random Llama):
one message per step, the tokens equal LLMEngine.generate's, stop strings found by the front
end finish the sequence in the core and free its blocks, aborts free blocks, admission counts
requests the core has not taken in yet, and a dead core fails every open stream."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.admission import RequestError, admit
from bucketserve.engine.async_engine import AsyncEngine, EngineDeadError
from bucketserve.engine.core import EngineCore, run_core_loop
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.messages import (
    AddRequest,
    FinishRequests,
    RequestLimits,
    SeqOutput,
    Shutdown,
    StepOutputs,
)
from bucketserve.engine.outputs import QueueFullError
from bucketserve.engine.sequence import SamplingParams
from bucketserve.models import load_model

PROMPTS = [[100 + i for i in range(n)] for n in (5, 9, 12)]
MAX_TOKENS = [4, 6, 8]
WAIT_S = 60.0  # a bound for conditions the engine thread reaches; not a measurement


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def make_engine(loaded, tmp_path, toml: str = "") -> LLMEngine:
    path = tmp_path / "buckets.toml"
    path.write_text(toml)
    return LLMEngine(loaded, load_buckets(str(path), max_model_len=loaded.max_model_len),
                     num_blocks=64)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("overlap", [False, True])
def test_core_sends_one_message_per_step_holding_every_sequence(loaded, tmp_path,
                                                                overlap) -> None:
    engine = make_engine(loaded, tmp_path,
                         f"[scheduler]\nasync_scheduling = {str(overlap).lower()}\n")
    core = EngineCore(engine)
    adds = [AddRequest(f"r{i}", p, greedy(m, detokenize=False), 0, time.monotonic())
            for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))]
    pending = [adds]
    sent: list[StepOutputs] = []

    def receive(timeout_s: float) -> list:
        if pending:
            return pending.pop()
        return [] if core.has_work() else [Shutdown()]

    timing: dict[str, float] = {}
    run_core_loop(core, receive, sent.append, timing=timing)
    steps = [m for m in sent if m.stats is not None]
    assert engine.stats.num_steps == len(steps) > 0
    # the loop's own account: one entry per message sent, and time spent in each phase
    assert timing["steps"] == len(sent)
    assert timing["step_s"] > 0 and timing["send_s"] >= 0 and timing["intake_s"] >= 0
    # Overlapped, a message carries the tokens of the step launched before it, and one last
    # message without a step of its own brings the final step's tokens.
    assert len(sent) == len(steps) + overlap and (sent[-1].stats is None) == overlap
    tokens: dict[str, list[int]] = {a.request_id: [] for a in adds}
    plain = 0
    for k, m in enumerate(sent):
        news = m.news()
        plain += len(m.tokens)
        rids = [o.request_id for o in news]
        assert len(rids) == len(set(rids)), "one entry per sequence per message"
        ran = sent[k - overlap].stats if k >= overlap else None  # the step these tokens are of
        if ran is not None and ran.kind == "decode":
            assert len(news) == ran.num_seqs
        for o in news:
            tokens[o.request_id] += o.new_token_ids
    # every token but each request's first and last one went in the plain columns
    assert plain == sum(MAX_TOKENS) - 2 * len(MAX_TOKENS)
    assert max(m.stats.num_decode_seqs for m in steps) == 3  # the three decoded in one step
    last = sent[-1]
    assert last.num_added == 3 and last.kv_blocks_used == 0 and last.num_running == 0
    reasons = [o.finish_reason for m in sent for o in m.outputs if o.finish_reason]
    assert reasons == ["length"] * 3
    offline = make_engine(loaded, tmp_path).generate(PROMPTS, [greedy(m) for m in MAX_TOKENS])
    assert [tokens[f"r{i}"] for i in range(3)] == [o.token_ids for o in offline]


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_stop_string_ends_the_stream_and_the_core_frees_the_blocks(loaded, tmp_path) -> None:
    engine = make_engine(loaded, tmp_path)
    prompt = PROMPTS[2]

    async def scenario() -> None:
        ae = AsyncEngine.in_process(engine)
        ae.start()
        base = [o async for o in ae.generate(prompt, greedy(24), "base")]
        text = "".join(o.new_text for o in base)
        stop = next(s for k in range(len(text) // 2, len(text) - 3)
                    if text.index(s := text[k:k + 3]) > 0)
        expected = text[:text.index(stop)]
        cut = [o async for o in ae.generate(prompt, greedy(300, stop=[stop]), "cut")]
        assert "".join(o.new_text for o in cut) == expected
        assert cut[-1].finished and cut[-1].finish_reason == "stop"
        assert cut[-1].num_output_tokens < 24
        assert all(stop not in o.new_text for o in cut)
        # The core was told to finish it: its blocks go back, "stop" is counted once.
        await until(lambda: ae.stats.finished.get("stop") == 1)
        await until(lambda: ae.stats.kv_blocks_used == 0)
        assert not engine.has_unfinished()
        assert engine.block_manager.num_used_blocks == 0
        assert dict(ae.stats.finished) == {"length": 1, "stop": 1}
        await ae.shutdown(1.0)

    run(scenario)


def test_closing_a_stream_aborts_in_the_core_and_frees_the_blocks(loaded, tmp_path) -> None:
    engine = make_engine(loaded, tmp_path)

    async def scenario() -> None:
        ae = AsyncEngine.in_process(engine)
        ae.start()
        stream = ae.generate(PROMPTS[0], greedy(500), "long")
        first = await anext(stream)
        assert first.new_token_ids and not first.finished
        await stream.aclose()
        await until(lambda: ae.stats.finished.get("abort") == 1)
        await until(lambda: ae.stats.kv_blocks_used == 0)
        assert engine.block_manager.num_used_blocks == 0
        await ae.shutdown(1.0)

    run(scenario)


class ByteTokenizer:
    vocab_size = 256

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


class FakeCore:
    """A core that takes requests and sends nothing by itself: the test plays its part."""

    model_name = "fake"
    limits = RequestLimits(max_model_len=64, vocab_size=256, num_kv_blocks=8, block_size=16,
                           max_waiting=2, queue_timeout_s=60.0)
    kv_blocks_total = 8
    info = {"model": "fake", "device": "cpu", "dtype": "float32", "quantization": "none",
            "kv_cache_dtype": "auto"}
    tokenizer = ByteTokenizer()

    def __init__(self) -> None:
        self.sent: list = []
        self.alive = True

    def start(self, deliver, died) -> None:
        self.deliver, self.died = deliver, died

    def send(self, msg) -> None:
        self.sent.append(msg)

    def is_alive(self) -> bool:
        return self.alive

    def stop(self, timeout_s: float) -> None:
        self.alive = False


def step(outputs: list[SeqOutput], num_added: int, num_waiting: int = 0) -> StepOutputs:
    return StepOutputs(outputs=outputs, stats=None, num_waiting=num_waiting, num_running=0,
                       kv_blocks_used=0, num_added=num_added)


def test_admission_counts_requests_sent_but_not_yet_taken_in() -> None:
    async def scenario() -> None:
        core = FakeCore()
        ae = AsyncEngine(core)
        ae.start()
        streams = [ae.generate([1, 2], SamplingParams(max_tokens=4), f"r{i}") for i in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0)
        assert [m.request_id for m in core.sent] == ["r0", "r1"]
        with pytest.raises(QueueFullError):
            await anext(ae.generate([1, 2], SamplingParams(max_tokens=4), "r2"))
        ae._on_step(step([], num_added=1, num_waiting=1))  # one admitted, one still queued
        with pytest.raises(QueueFullError):
            await anext(ae.generate([1, 2], SamplingParams(max_tokens=4), "r2"))
        ae._on_step(step([], num_added=2, num_waiting=0))  # both running
        third = asyncio.ensure_future(anext(ae.generate([1, 2], SamplingParams(max_tokens=4), "r3")))
        await asyncio.sleep(0)
        assert core.sent[-1].request_id == "r3"
        for task in [*firsts, third]:
            task.cancel()
        await asyncio.gather(*firsts, third, return_exceptions=True)

    run(scenario)


def test_admission_refuses_what_can_never_run() -> None:
    limits = FakeCore.limits
    for prompt, params, param in (([], SamplingParams(), "prompt"),
                                  ([1, 999], SamplingParams(), "prompt"),
                                  ([1] * 60, SamplingParams(max_tokens=10), "max_tokens")):
        with pytest.raises(RequestError) as info:
            admit(limits, prompt, params, 0)
        assert info.value.param == param
    small_pool = RequestLimits(1024, 256, 2, 16, 10, 1.0)
    with pytest.raises(RequestError, match="KV blocks"):
        admit(small_pool, [1] * 20, SamplingParams(max_tokens=20), 0)
    admit(small_pool, [1] * 16, SamplingParams(max_tokens=16), 9)
    with pytest.raises(QueueFullError):
        admit(small_pool, [1] * 16, SamplingParams(max_tokens=16), 10)


def test_front_end_stop_drops_later_tokens_and_counts_the_finish_once() -> None:
    async def scenario() -> None:
        core = FakeCore()
        ae = AsyncEngine(core)
        ae.start()
        stream = ae.generate([1, 2], SamplingParams(max_tokens=40, stop=["STOP"]), "r")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        add = core.sent[0]
        assert add.params.stop == [] and add.params.detokenize is False  # the core's copy
        ae._on_step(step([SeqOutput("r", list(b"abcST"))], num_added=1))
        ae._on_step(step([SeqOutput("r", list(b"OPdef"))], num_added=1))
        outs = [await first]
        # both steps were queued before the consumer ran: they come merged in one output
        assert len(outs) == 1 and outs[0].new_token_ids == list(b"abcSTOP")
        assert "".join(o.new_text for o in outs) == "abc"
        assert outs[-1].finished and outs[-1].finish_reason == "stop"
        assert outs[-1].num_output_tokens == len("abcSTOP")
        assert isinstance(core.sent[-1], FinishRequests) and core.sent[-1].request_ids == ["r"]
        # The core's own news about r after the stop: ignored for the client, counted once.
        ae._on_step(step([SeqOutput("r", list(b"g"), finish_reason="stop")], num_added=1))
        assert dict(ae.stats.finished) == {"stop": 1}
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    run(scenario)


def test_a_dead_core_fails_open_streams_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        core = FakeCore()
        ae = AsyncEngine(core)
        calls: list[str] = []
        ae.on_dead.append(lambda: calls.append("dead"))
        ae.start()
        assert ae.is_alive()
        first = asyncio.ensure_future(anext(ae.generate([1], SamplingParams(), "r")))
        await asyncio.sleep(0)
        ae._on_dead("killed")
        with pytest.raises(EngineDeadError):
            await first
        assert not ae.is_alive() and calls == ["dead"] and ae.dead_reason == "killed"
        with pytest.raises(EngineDeadError):
            await anext(ae.generate([1], SamplingParams(), "s"))

    run(scenario)


def test_prefix_cache_counters_cross_the_split(loaded, tmp_path) -> None:
    """The core's step messages carry the prefix-cache totals; the front end's stats mirror them."""
    engine = make_engine(loaded, tmp_path, "[kv_cache]\nblock_size = 4\n")
    core = EngineCore(engine)
    shared = [100 + i for i in range(12)]  # three full blocks
    first = AddRequest("a", shared + [7], greedy(2, detokenize=False), 0, time.monotonic())
    second = AddRequest("b", shared + [9], greedy(2, detokenize=False), 0, time.monotonic())
    pending = [[second], [first]]
    sent: list[StepOutputs] = []

    def receive(timeout_s: float) -> list:
        if pending and not core.has_work():
            return pending.pop()
        return [] if core.has_work() else [Shutdown()]

    run_core_loop(core, receive, sent.append)
    last = sent[-1]
    bm = engine.block_manager
    assert last.prefix_hits_total == bm.hit_tokens == 12  # the second found the first's blocks
    assert last.prefix_queries_total == bm.query_tokens > last.prefix_hits_total
    assert last.prefix_cached_blocks == bm.num_cached_blocks >= 3
    ae = AsyncEngine(FakeCore())  # the front end mirrors what the message carries
    ae._on_step(last)
    assert (ae.stats.prefix_cache_queries_total, ae.stats.prefix_cache_hits_total,
            ae.stats.prefix_cache_blocks) == (last.prefix_queries_total, 12,
                                              last.prefix_cached_blocks)


def test_errors_cross_the_split_and_text_failures_end_the_request_in_the_front_end() -> None:
    """A failed model step's error message reaches the client's output; a detokenizer failure
    (the front end's, injected) fails only that request, which the core is told to finish."""
    from bucketserve.engine.faults import FaultPlan
    from bucketserve.engine.output_processor import TextProcessor

    text = TextProcessor(ByteTokenizer(), FaultPlan.parse("detok:7"))
    text.add("a", [1, 2], SamplingParams(max_tokens=8), 0.0)
    text.add("b", [7, 2], SamplingParams(max_tokens=8), 0.0)
    out, ended_here = text.process(SeqOutput("a", [], finish_reason="error",
                                             error="the engine step failed: boom"))
    assert out.finished and out.finish_reason == "error" and not ended_here
    assert out.error == "the engine step failed: boom"
    out, ended_here = text.process(SeqOutput("b", list(b"hi")))
    assert ended_here and out.finished and out.finish_reason == "error"
    assert "into text failed" in out.error and "InjectedFault" in out.error
    assert text.process(SeqOutput("b", list(b"!")))[0] is None  # gone: later news is ignored

    async def scenario() -> None:
        core = FakeCore()
        ae = AsyncEngine(core, FaultPlan.parse("detok:7"))  # the seam: passed in
        ae.start()
        stream = ae.generate([7, 9], SamplingParams(max_tokens=8), "d")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        ae._on_step(step([SeqOutput("d", list(b"ok"))], num_added=1))
        out = await first
        assert out.finished and out.finish_reason == "error" and "into text failed" in out.error
        assert isinstance(core.sent[-1], FinishRequests) and core.sent[-1].request_ids == ["d"]
        ae._on_step(step([SeqOutput("d", [], finish_reason="stop")], num_added=1))
        assert dict(ae.stats.finished) == {"error": 1}  # counted once, as the client saw it

    run(scenario)


def test_engine_options_from_the_serve_command_line():
    from bucketserve.engine.options import EngineOptions
    from bucketserve.server.options import build_parser

    args = build_parser().parse_args([
        "serve", "--model", "m", "--device", "cuda", "--dtype", "bfloat16", "--buckets", "b.toml",
        "--log-level", "debug", "--nvtx", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert EngineOptions.from_args(args) == EngineOptions(
        model="m", device="cuda", dtype="bfloat16", buckets_path="b.toml", log_level="debug",
        nvtx=True, quantization="fp8", kv_cache_dtype="fp8")
    # the dataclass's defaults are the command line's
    assert EngineOptions.from_args(build_parser().parse_args(["serve"])) == EngineOptions(
        "smollm2-135m-instruct")


def test_switch_interval_experiment_sets_the_core_interval_or_refuses(monkeypatch) -> None:
    import sys

    from bucketserve.engine.core import SWITCH_INTERVAL_ENV, apply_switch_interval

    default = sys.getswitchinterval()
    try:
        monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
        assert apply_switch_interval() is None and sys.getswitchinterval() == default
        monkeypatch.setenv(SWITCH_INTERVAL_ENV, "250")
        assert apply_switch_interval() == pytest.approx(250e-6)
        assert sys.getswitchinterval() == pytest.approx(250e-6)
        for bad in ("0", "-5", "fast", "2e6"):
            with pytest.raises(ValueError, match=SWITCH_INTERVAL_ENV):
                apply_switch_interval(bad)
        assert sys.getswitchinterval() == pytest.approx(250e-6)  # a refused value changes nothing
    finally:
        sys.setswitchinterval(default)
