"""Two ways to run the engine core (engine/core.py) behind one small interface.

- `ProcessCore`: the core in its own process (the default of `bucketserve serve`). Requests
  go over a ZeroMQ PUSH socket, StepOutputs come back over a PULL socket (msgpack, see
  engine/messages.py); a receiver thread decodes them and watches the process: if it ends
  without being asked to, `died` is called at once.
- `ThreadCore`: the same loop in a thread of this process (Python API, unit tests,
  `--engine-in-process`); messages are handed over as objects.

Both call `deliver(StepOutputs)` and `died(reason)` from their own thread; AsyncEngine moves
them onto its event loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Protocol

from bucketserve.engine.core import CoreConfig, EngineCore, run_core_loop, run_core_process
from bucketserve.engine.faults import Seams
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.messages import (
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreReady,
    RequestLimits,
    Shutdown,
    StepOutputs,
    input_codec,
    output_codec,
)
from bucketserve.engine.options import EngineOptions

log = logging.getLogger("bucketserve.core")

Deliver = Callable[[StepOutputs], None]
Died = Callable[[str], None]


class CoreStartError(RuntimeError):
    """The engine core process ended before it was ready (bad model, bad config, ...)."""


class CoreClient(Protocol):
    model_name: str
    limits: RequestLimits
    kv_blocks_total: int
    tokenizer: object
    info: dict[str, str]  # LLMEngine.info()

    def start(self, deliver: Deliver, died: Died) -> None: ...
    def send(self, msg: CoreInput) -> None: ...
    def is_alive(self) -> bool: ...
    def stop(self, timeout_s: float) -> None: ...


class ThreadCore:
    """The core loop in a daemon thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.core = EngineCore(engine)
        self.model_name = engine.model_name
        self.limits = engine.limits
        self.kv_blocks_total = engine.block_manager.num_usable_blocks
        self.tokenizer = engine.tokenizer
        self.info = engine.info()
        self._inbox: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed = False

    def _receive(self, timeout_s: float) -> list[CoreInput]:
        msgs: list[CoreInput] = []
        try:
            msgs.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0
                        else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            return msgs

    def start(self, deliver: Deliver, died: Died) -> None:
        def loop() -> None:
            try:
                run_core_loop(self.core, self._receive, deliver)
            except BaseException as exc:  # noqa: BLE001 - reported to every waiting client
                log.exception("engine loop died")
                self._failed = True
                died(f"{type(exc).__name__}: {exc}")

        self._thread = threading.Thread(target=loop, name="bucketserve-engine", daemon=True)
        self._thread.start()

    def send(self, msg: CoreInput) -> None:
        self._inbox.put(msg)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._failed

    def stop(self, timeout_s: float) -> None:
        self.send(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout_s)


def core_addresses(directory: str, num_clients: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """ZeroMQ ipc addresses in `directory`: (inputs, outputs), one pair per front end."""
    return (tuple(f"ipc://{directory}/in{k}" for k in range(num_clients)),
            tuple(f"ipc://{directory}/out{k}" for k in range(num_clients)))


def spawn_core(options: EngineOptions, directory: str, num_clients: int,
               seams: Seams | None = None) -> multiprocessing.Process:
    """Starts the core process (spawn, not fork: a fresh interpreter, whatever threads this
    process already runs); it connects to every front end's addresses in `directory`."""
    inputs, outputs = core_addresses(directory, num_clients)
    cfg = CoreConfig(options=options, input_addresses=inputs, output_addresses=outputs,
                     parent_pid=os.getpid(), seams=seams)
    proc = multiprocessing.get_context("spawn").Process(
        target=run_core_process, args=(cfg,), name="bucketserve-core")
    proc.start()
    return proc


class ProcessCore:
    """The front end's side of a core process: waits for its READY (the model is loaded and
    warm), then sends requests and receives StepOutputs.

    Either it starts the core itself (the constructor: one front end, the default), or it
    attaches to a core that another process started (`attach`: front end k of
    --api-workers N, whose parent started the core); then `client` tags its requests so the
    core routes their outputs back here, and the core's death is seen through a pidfd."""

    def __init__(self, options: EngineOptions, seams: Seams | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="bucketserve-core-")
        self._own_dir = True
        self._bind(self._dir, 0)
        self.proc: multiprocessing.Process | None = spawn_core(options, self._dir, 1, seams)
        self._core_fd = self.proc.sentinel
        self._setup()

    @classmethod
    def attach(cls, directory: str, client: int, core_pid: int) -> ProcessCore:
        """Front end `client` of a core started elsewhere (whose addresses are in
        `directory`); returns once the core said READY (raises CoreStartError if it failed)."""
        self = cls.__new__(cls)
        self._dir, self._own_dir = directory, False
        self._bind(directory, client)
        self.proc = None
        self._core_pid = core_pid
        self._core_fd = None
        try:
            self._core_fd = os.pidfd_open(core_pid)
        except ProcessLookupError:
            self._close()
            raise CoreStartError("the engine core process exited during start-up") from None
        self._setup()
        return self

    def _bind(self, directory: str, client: int) -> None:
        import zmq

        self._zmq = zmq
        self.client = client
        self._ctx = zmq.Context()
        inputs, outputs = core_addresses(directory, client + 1)
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(inputs[client])
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(outputs[client])
        self._enc, _ = input_codec()
        _, self._dec = output_codec()
        self._send_lock = threading.Lock()
        self._closing = False
        self._dead = False
        self._thread: threading.Thread | None = None

    def _setup(self) -> None:
        try:
            ready = self._wait_ready()
        except BaseException:
            self._kill()
            self._close()
            raise
        self.model_name = ready.model_name
        self.limits = ready.limits
        self.kv_blocks_total = ready.kv_blocks_total
        self.pid = ready.pid
        self.info = ready.info
        from bucketserve.engine.core import tokenizer_from_spec

        self.tokenizer = tokenizer_from_spec(ready.tokenizer)

    def _exit_code(self) -> int | None:
        if self.proc is not None:
            self.proc.join(1.0)
            return self.proc.exitcode
        return None  # not our child: its parent collects the status

    def _wait_ready(self) -> CoreReady:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self._core_fd, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if self._from_core in events:
                msg = self._dec.decode(self._from_core.recv())
                if isinstance(msg, CoreReady):
                    return msg
                if isinstance(msg, CoreFailed):
                    raise CoreStartError(f"the engine core failed to start: {msg.message}")
            elif self._core_fd in events:
                raise CoreStartError(
                    f"the engine core process exited during start-up (code {self._exit_code()})")

    def start(self, deliver: Deliver, died: Died) -> None:
        self._thread = threading.Thread(target=self._receive_loop, args=(deliver, died),
                                        name="bucketserve-core-receiver", daemon=True)
        self._thread.start()

    def _receive_loop(self, deliver: Deliver, died: Died) -> None:
        zmq = self._zmq
        sock, dec = self._from_core, self._dec
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._core_fd, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll(100))
            if sock in events:
                while True:  # everything queued, so that the outputs before a death arrive
                    try:
                        msg = dec.decode(sock.recv(zmq.NOBLOCK, copy=False).buffer)
                    except zmq.Again:
                        break
                    if isinstance(msg, StepOutputs):
                        deliver(msg)
                    elif isinstance(msg, CoreFailed):
                        self._dead = True
                        died(msg.message)
                        return
            elif self._core_fd in events:
                if self._closing:
                    return
                self._dead = True
                died(f"the engine core process exited (code {self._exit_code()})")
                return

    def send(self, msg: CoreInput) -> None:
        if self.client and isinstance(msg, AddRequest):
            msg.client = self.client
        data = self._enc.encode(msg)
        with self._send_lock:
            try:
                self._to_core.send(data, self._zmq.NOBLOCK)
            except self._zmq.ZMQError:
                pass  # no core connected: it is gone, and the receiver reports that

    def is_alive(self) -> bool:
        if self._dead:
            return False
        if self.proc is not None:
            return self.proc.is_alive()
        try:
            os.kill(self._core_pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, timeout_s: float) -> None:
        """Tells the core this front end is done. The core we started exits on that (else it
        is killed after timeout_s); an attached core exits once every front end said so."""
        self._closing = True
        if self.proc is None:
            if not self._dead:
                self.send(Shutdown())  # _close lingers until it has left
        elif self.proc.is_alive():
            self.send(Shutdown())
            self.proc.join(timeout_s)
        self._kill()
        if self._thread is not None:
            self._thread.join(2.0)
        self._close()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()  # it ignores SIGTERM by design (the front end drains)
            self.proc.join(5.0)

    def _close(self) -> None:
        self._to_core.close(0 if self._own_dir else 1000)
        self._from_core.close(0)
        self._ctx.term()
        if self.proc is None and self._core_fd is not None:
            os.close(self._core_fd)
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
