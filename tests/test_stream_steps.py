"""One SSE event per engine step per choice, and the /metrics counts of events and tokens.

The real app and AsyncEngine over a core that the test plays (test_engine_core.FakeCore), so
the test decides when each step's output arrives: one step at a time, and several steps at
once (a front end that fell behind: up to CATCH_UP_STEPS still one event per step, beyond
that one merged event). Detokenization is on (one token per UTF-8 byte): a partial
character makes no event and its token goes out with the next one.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from test_engine_core import FakeCore, step
from test_server_app import ByteTokenizer

from bucketserve.bench.scrape import parse_prometheus
from bucketserve.engine.async_engine import CATCH_UP_STEPS, AsyncEngine
from bucketserve.engine.messages import SeqOutput
from bucketserve.server.app import create_app
from bucketserve.server.context import ServerContext

# one token per step; "é" is two bytes (two steps, one event)
STEPS = [[ord("h")], [0xC3], [0xA9], [ord("l")], [ord("l")], [ord("o")], [ord("!")]]
TEXTS = ["h", "é", "l", "l", "o", "!"]


class Core(FakeCore):
    tokenizer = ByteTokenizer()


def _token_events(body: str) -> tuple[list[str], list[dict]]:
    """(the text of each event that carried text, every data event's JSON)."""
    datas = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    texts = []
    for c in chunks:
        for choice in c["choices"]:
            text = choice.get("text", choice.get("delta", {}).get("content"))
            if text:
                texts.append(text)
    return texts, chunks


def _stream(path: str, body: dict, burst: int) -> tuple[list[str], list[dict], dict]:
    """Streams one request; the core client delivers its steps one per loop turn except for
    `burst` steps (after the first) delivered back to back before the loop runs anything."""

    async def scenario() -> tuple[str, dict]:
        core = Core()
        engine = AsyncEngine(core)
        ctx = ServerContext(engine)
        app = create_app(ctx)
        engine.start()

        async def play() -> None:
            while not engine._streams:
                await asyncio.sleep(0.001)
            (rid,) = engine._streams
            for i, toks in enumerate(STEPS):
                last = i == len(STEPS) - 1
                core.deliver(step([SeqOutput(rid, toks, "length" if last else None)],
                                  num_added=1))
                if not 1 <= i < burst:
                    await asyncio.sleep(0.01)  # the consumer takes it before the next step

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            player = asyncio.create_task(play())
            r = await client.post(path, json=body, timeout=30)
            await player
        assert r.status_code == 200, r.text
        return r.text, parse_prometheus(ctx.metrics.render().decode())

    text, metrics = asyncio.run(scenario())
    texts, chunks = _token_events(text)
    return texts, chunks, metrics


def test_completions_stream_sends_one_event_per_step_and_counts_them() -> None:
    body = {"prompt": "ab", "max_tokens": len(STEPS), "stream": True}
    texts, chunks, m = _stream("/v1/completions", body, burst=3)
    assert texts == TEXTS  # the burst of three steps: three events, not one
    assert len(chunks) == len(TEXTS)  # no other data events (the last carries the finish)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert m['bucketserve_sse_token_events_total{endpoint="completions"}'] == len(TEXTS)
    assert m['bucketserve_sse_tokens_total{endpoint="completions"}'] == len(STEPS)


def test_chat_stream_sends_one_event_per_step_and_counts_them() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(STEPS),
            "stream": True}
    texts, chunks, m = _stream("/v1/chat/completions", body, burst=CATCH_UP_STEPS)
    assert texts == TEXTS
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert m['bucketserve_sse_token_events_total{endpoint="chat"}'] == len(TEXTS)
    assert m['bucketserve_sse_tokens_total{endpoint="chat"}'] == len(STEPS)
    assert not any(k.startswith("bucketserve_sse_tokens_total") and "completions" in k for k in m)


def test_a_backlog_beyond_catch_up_steps_is_sent_merged_and_counted_so() -> None:
    body = {"prompt": "ab", "max_tokens": len(STEPS), "stream": True}
    texts, _, m = _stream("/v1/completions", body, burst=CATCH_UP_STEPS + 2)
    assert texts == ["h", "éllo!"]  # the 6 steps behind the first: one event
    assert m['bucketserve_sse_token_events_total{endpoint="completions"}'] == 2
    assert m['bucketserve_sse_tokens_total{endpoint="completions"}'] == len(STEPS)


def test_steps_that_arrive_together_reach_each_stream_before_the_next_is_handled() -> None:
    """Three steps delivered by the core client at once (a loop that fell behind): each
    stream takes step n's output before step n+1 is handled, so its events leave one step
    apart rather than in one burst."""
    from bucketserve.engine.sequence import SamplingParams

    async def scenario() -> list[str]:
        core = Core()
        engine = AsyncEngine(core)
        engine.start()
        log: list[str] = []
        handle = engine._on_step

        def on_step(msg) -> None:
            log.append(f"step {msg.outputs[0].new_token_ids[0]}")
            handle(msg)

        engine._on_step = on_step

        async def consume(rid: str) -> None:
            async for out in engine.generate([1, 2], SamplingParams(max_tokens=3), rid):
                log.append(f"{rid} {out.new_token_ids}")

        tasks = [asyncio.create_task(consume(rid)) for rid in ("a", "b")]
        await asyncio.sleep(0.01)
        for t in (65, 66, 67):  # back to back, before the loop runs anything
            outs = [SeqOutput(rid, [t], "length" if t == 67 else None) for rid in ("a", "b")]
            core.deliver(step(outs, num_added=2))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return log

    log = asyncio.run(scenario())
    assert log == ["step 65", "a [65]", "b [65]", "step 66", "a [66]", "b [66]",
                   "step 67", "a [67]", "b [67]"], log
