"""A lean HTTP/1.1 client for load generation: one asyncio Protocol per keep-alive connection.

Why not httpx or aiohttp: a streaming completion is one SSE event per token, and the GPU
server sends tens of thousands of them per second. Here `data_received` takes the clock once
per socket read, strips the chunked framing in a tight loop and hands the body bytes to a
`Handler`; no coroutine switch, no header object, no per-event allocation beyond slicing.

    conn = await Connection.open(host, port)
    handler = SomeHandler(...)
    await conn.request(request_bytes, handler)   # resolves when the response has ended

A Handler receives `head(status, ts)`, `body(data)` per body piece, `flush(ts)` after each
socket read, and `end(ts)` once; `fail(message)` replaces `end` when the connection breaks.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Protocol

_HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH, _CLOSE, _IDLE = range(8)


class Handler(Protocol):
    def head(self, status: int, ts: float) -> None: ...
    def body(self, data: bytes) -> None: ...
    def flush(self, ts: float) -> None: ...
    def end(self, ts: float) -> None: ...
    def fail(self, message: str) -> None: ...


def build_request(host: str, port: int, path: str, payload: dict, headers: dict | None = None,
                  ) -> bytes:
    """The bytes of one POST with a JSON body (keep-alive)."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Accept: */*"]
    for key, value in (headers or {}).items():
        lines.append(f"{key}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def build_get(host: str, port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: */*\r\n\r\n".encode()


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.state = _IDLE
        self.buf = b""
        self.remaining = 0
        self.keep_alive = True
        self.handler: Handler | None = None
        self.done: asyncio.Future | None = None
        self.got_bytes = False

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        return conn

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket

            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state == _CLOSE and self.handler is not None:
            self._finish(time.perf_counter())  # a body delimited by the close
        elif self.handler is not None:
            handler, self.handler = self.handler, None
            handler.fail(f"connection closed by the server ({exc or 'EOF'})"
                         if self.got_bytes else "connection closed before any response byte")
            self._resolve()

    def data_received(self, data: bytes) -> None:
        ts = time.perf_counter()
        self.got_bytes = True
        buf = self.buf + data if self.buf else data
        handler = self.handler
        if handler is None:
            return
        state = self.state
        pos, end = 0, len(buf)  # an index into buf: no copy of the rest per chunk
        while pos < end or state == _SIZE:
            if state == _SIZE:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                line = buf[pos:i]
                size = int(line.split(b";", 1)[0] if b";" in line else line, 16)
                pos = i + 2
                if size:
                    self.remaining = size
                    state = _DATA
                else:
                    state = _TRAILER
            elif state == _DATA:
                n = self.remaining
                if end - pos <= n:
                    handler.body(buf[pos:] if pos else buf)
                    self.remaining = n - (end - pos)
                    pos = end
                    if self.remaining:
                        break
                else:
                    handler.body(buf[pos:pos + n])
                    pos += n
                    self.remaining = 0
                state = _CRLF
            elif state == _CRLF:
                if end - pos < 2:
                    break
                pos += 2
                state = _SIZE
            elif state == _HEAD:
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                state = self._head(buf[pos:i], ts)
                pos = i + 4
                if state == _IDLE:  # an empty body: the response has ended
                    return
            elif state == _LENGTH:
                n = self.remaining
                piece = buf[pos:pos + n]
                handler.body(piece)
                pos += len(piece)
                self.remaining = n - len(piece)
                if self.remaining == 0:
                    self.state = state
                    handler.flush(ts)
                    self._finish(ts)
                    return
                break
            elif state == _TRAILER:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                empty = i == pos
                pos = i + 2
                if empty:
                    self.state = state
                    handler.flush(ts)
                    self._finish(ts)
                    return
            elif state == _CLOSE:
                handler.body(buf[pos:])
                pos = end
                break
            else:
                break
        self.state = state
        self.buf = buf[pos:] if pos < end else b""
        handler.flush(ts)

    def _head(self, head: bytes, ts: float) -> int:
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = 0
        chunked = False
        length = -1
        self.keep_alive = not lines[0].startswith(b"HTTP/1.0")
        for line in lines[1:]:
            key, _, value = line.partition(b":")
            key = key.strip().lower()
            if key == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif key == b"content-length":
                length = int(value)
            elif key == b"connection":
                v = value.strip().lower()
                self.keep_alive = v != b"close" if v in (b"close", b"keep-alive") else self.keep_alive
        assert self.handler is not None
        self.handler.head(status, ts)
        if chunked:
            return _SIZE
        if length >= 0:
            self.remaining = length
            if length == 0:
                self._finish(ts)
                return _IDLE
            return _LENGTH
        self.keep_alive = False
        return _CLOSE

    def _finish(self, ts: float) -> None:
        handler, self.handler = self.handler, None
        self.state = _IDLE
        self.buf = b""
        if handler is not None:
            handler.end(ts)
        if not self.keep_alive and self.transport is not None:
            self.transport.close()
            self.closed = True
        self._resolve()

    def _resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    # ---- use
    def request(self, data: bytes, handler: Handler) -> asyncio.Future:
        """Sends `data`; the returned future resolves once `handler` saw the end (or a failure)."""
        assert self.handler is None, "one request at a time per connection"
        self.done = asyncio.get_running_loop().create_future()
        self.handler = handler
        self.state = _HEAD
        self.buf = b""
        self.got_bytes = False
        if self.closed or self.transport is None or self.transport.is_closing():
            self.handler = None
            handler.fail("connection closed before any response byte")
            self._resolve()
        else:
            self.transport.write(data)
        return self.done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


class BodyCollector:
    """A Handler that keeps the whole body (for /metrics and other small GETs)."""

    def __init__(self) -> None:
        self.status = 0
        self.parts: list[bytes] = []
        self.error: str | None = None

    def head(self, status: int, ts: float) -> None:
        self.status = status

    def body(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self, ts: float) -> None:
        pass

    def end(self, ts: float) -> None:
        pass

    def fail(self, message: str) -> None:
        self.error = message

    @property
    def text(self) -> str:
        return b"".join(self.parts).decode("utf-8", "replace")


async def get(host: str, port: int, path: str, timeout_s: float = 5.0) -> BodyCollector:
    """One GET on a fresh connection."""
    conn = await asyncio.wait_for(Connection.open(host, port), timeout_s)
    try:
        collector = BodyCollector()
        await asyncio.wait_for(conn.request(build_get(host, port, path), collector), timeout_s)
        return collector
    finally:
        conn.close()
