"""A stub OpenAI server that streams at once: measures what the bench client itself sustains.

    python -m bucketserve.bench.stub_server --port 8100      (or: bucketserve bench --stub-server 8100)

It mimics an engine's framing: one step loop writes one SSE event (one HTTP chunk) to every
open stream per step, then yields to the event loop, so a client sees many streams advancing
together, one token each per socket write, as from a real continuous-batching server. A
completion ends after `max_tokens` events with finish_reason "length", a usage chunk and
[DONE]. /v1/embeddings answers at once with one small vector per input. /metrics is 404.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

_MODEL = "stub"
_TOKEN = (b'data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub",'
          b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
_LAST = (b'data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub",'
         b'"choices":[{"index":0,"text":" end","logprobs":null,"finish_reason":"length"}]}\n\n')
_CHAT_TOKEN = (b'data: {"id":"chatcmpl-stub","object":"chat.completion.chunk","created":0,'
               b'"model":"stub","choices":[{"index":0,"delta":{"content":" tok"},'
               b'"finish_reason":null}]}\n\n')
_CHAT_LAST = (b'data: {"id":"chatcmpl-stub","object":"chat.completion.chunk","created":0,'
              b'"model":"stub","choices":[{"index":0,"delta":{"content":" end"},'
              b'"finish_reason":"length"}]}\n\n')


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
         b"transfer-encoding: chunked\r\n\r\n")
_TOKEN_C, _LAST_C = _chunk(_TOKEN), _chunk(_LAST)
_CHAT_TOKEN_C, _CHAT_LAST_C = _chunk(_CHAT_TOKEN), _chunk(_CHAT_LAST)


def _json_response(status: str, body: dict) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


class Stream:
    __slots__ = ("transport", "left", "prompt_tokens", "total", "chat", "conn")

    def __init__(self, conn: StubConnection, n: int, prompt_tokens: int, chat: bool) -> None:
        self.conn, self.transport = conn, conn.transport
        self.left = self.total = n
        self.prompt_tokens, self.chat = prompt_tokens, chat


class StubServer:
    def __init__(self, step_s: float = 0.0) -> None:
        self.streams: list[Stream] = []
        self.wake = asyncio.Event()
        self.step_s = step_s

    async def step_loop(self) -> None:
        while True:
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
            keep = []
            for s in self.streams:
                if s.transport.is_closing():
                    continue
                s.left -= 1
                if s.left > 0:
                    s.transport.write(_CHAT_TOKEN_C if s.chat else _TOKEN_C)
                    keep.append(s)
                    continue
                usage = json.dumps({"id": "cmpl-stub", "choices": [], "usage": {
                    "prompt_tokens": s.prompt_tokens, "completion_tokens": s.total,
                    "total_tokens": s.prompt_tokens + s.total}}, separators=(",", ":")).encode()
                s.transport.write((_CHAT_LAST_C if s.chat else _LAST_C)
                                  + _chunk(b"data: " + usage + b"\n\n")
                                  + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                s.conn.busy = False
                s.conn.process()
            self.streams = keep
            await asyncio.sleep(self.step_s)


class StubConnection(asyncio.Protocol):
    def __init__(self, server: StubServer) -> None:
        self.server = server
        self.buf = b""
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.process()

    def process(self) -> None:
        while not self.busy:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = self.buf[:i].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < i + 4 + length:
                return
            body = self.buf[i + 4:i + 4 + length]
            self.buf = self.buf[i + 4 + length:]
            parts = head.split(" ", 2)
            method, path = parts[0], parts[1] if len(parts) > 1 else "/"
            self.handle(method, path, body)

    def handle(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "GET" and path == "/v1/models":
            self.transport.write(_json_response("200 OK", {"object": "list", "data": [
                {"id": _MODEL, "object": "model", "owned_by": "stub"}]}))
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions",
                                            "/v1/embeddings"):
            self.transport.write(_json_response("404 Not Found", {"error": {
                "message": f"no route {path}", "type": "invalid_request_error"}}))
            return
        try:
            req = json.loads(body)
        except json.JSONDecodeError:
            self.transport.write(_json_response("400 Bad Request", {"error": {
                "message": "body is not JSON", "type": "invalid_request_error"}}))
            return
        if path == "/v1/embeddings":
            inputs = req.get("input")
            n = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(
                inputs[0], int) else 1
            self.transport.write(_json_response("200 OK", {"object": "list", "model": _MODEL,
                "data": [{"object": "embedding", "index": k, "embedding": [0.0, 1.0]}
                         for k in range(n)], "usage": {"prompt_tokens": n, "total_tokens": n}}))
            return
        n = max(1, int(req.get("max_tokens") or 16))
        prompt = req.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt or "").split())
        if not req.get("stream"):
            self.transport.write(_json_response("200 OK", {"id": "cmpl-stub", "choices": [
                {"index": 0, "text": " tok" * n, "finish_reason": "length"}], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": n,
                "total_tokens": prompt_tokens + n}}))
            return
        self.transport.write(_HEAD)
        self.busy = True
        self.server.streams.append(Stream(self, n, prompt_tokens, path.endswith("chat/completions")))
        self.server.wake.set()


async def serve(host: str, port: int, step_ms: float = 0.0, ready=None) -> None:
    server = StubServer(step_ms / 1000.0)
    loop = asyncio.get_running_loop()
    # reuse_port: several stub processes can share one port (the kernel spreads connections)
    srv = await loop.create_server(lambda: StubConnection(server), host, port, backlog=4096,
                                   reuse_port=True)
    stepper = asyncio.create_task(server.step_loop())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if ready is not None:
        ready()
    print(f"stub server on http://{host}:{port}", flush=True)
    await stop.wait()
    stepper.cancel()
    srv.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bucketserve.bench.stub_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="pause between steps (0: stream as fast as the loop runs)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.step_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
