"""SSEResponse (server/streaming.py) against a bare ASGI send/receive: events go out as they
come, a keep-alive comment fills idle time, and a client that leaves or stops reading ends the
stream and closes the event generator (whose cleanup aborts the engine requests)."""

from __future__ import annotations

import asyncio

from bucketserve.server.streaming import DONE, PING, SSEResponse


def _run(events, ping_s: float = 10.0, send_timeout_s: float = 10.0, block_send_after: int = -1,
         disconnect_after_s: float | None = None) -> tuple[list[bytes], list[str]]:
    bodies: list[bytes] = []
    log: list[str] = []

    async def gen():
        try:
            async for e in events():
                yield e
        finally:
            log.append("closed")

    async def scenario() -> None:
        gone = asyncio.Event()

        async def receive():
            if disconnect_after_s is None:
                await asyncio.Event().wait()
            await asyncio.sleep(disconnect_after_s)
            gone.set()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body":
                if len(bodies) == block_send_after:
                    await asyncio.Event().wait()  # the client stopped reading
                bodies.append(msg["body"])

        await asyncio.wait_for(SSEResponse(gen(), ping_s, send_timeout_s)({}, receive, send), 10)

    asyncio.run(scenario())
    return bodies, log


def test_events_then_end_of_body() -> None:
    async def events():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n" + DONE

    bodies, log = _run(events)
    assert bodies == [b"data: 1\n\n", b"data: 2\n\n" + DONE, b""]
    assert log == ["closed"]


def test_idle_stream_gets_keep_alive_comments() -> None:
    async def events():
        yield b"data: 1\n\n"
        await asyncio.sleep(0.5)
        yield DONE

    bodies, _ = _run(events, ping_s=0.1)
    assert bodies[0] == b"data: 1\n\n" and bodies[-2:] == [DONE, b""]
    assert 2 <= bodies.count(PING) <= 6


def test_client_that_leaves_ends_the_stream_and_closes_the_generator() -> None:
    async def events():
        while True:
            yield b"data: x\n\n"
            await asyncio.sleep(0.01)

    bodies, log = _run(events, disconnect_after_s=0.1)
    assert log == ["closed"] and bodies and b"" not in bodies  # no end-of-body to nobody


def test_client_that_stops_reading_is_cut_after_the_send_timeout() -> None:
    async def events():
        while True:
            yield b"data: x\n\n"

    bodies, log = _run(events, send_timeout_s=0.3, block_send_after=3)
    assert log == ["closed"] and len(bodies) == 3
