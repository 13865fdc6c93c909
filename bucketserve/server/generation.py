"""Runs the engine requests behind one HTTP request, and aborts them when nobody listens.

An OpenAI request with n choices (times k prompts) becomes n*k independent engine
requests. `run_choices` merges their output streams into one async stream of
(choice index, RequestOutput). Whatever ends the consumer (a finished response, a client
that went away, a cancelled task, a server shutdown) runs its `finally`, which aborts
every engine request that has not finished: their KV blocks are back in the pool after
the engine's next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from bucketserve.engine.admission import RequestError
from bucketserve.engine.async_engine import AsyncEngine, EngineDeadError, StalledStreamError
from bucketserve.engine.outputs import QueueFullError, RequestOutput
from bucketserve.engine.sequence import SamplingError, SamplingParams
from bucketserve.server.errors import APIError, invalid_request, overloaded
from bucketserve.server.metrics import ServerMetrics

T = TypeVar("T")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler checks that its client is there
# Outputs held for a consumer that does not take them (a client that stopped reading its
# stream blocks the sender): past this many per choice, the request is aborted and freed.
MAX_BUFFERED_PER_CHOICE = 1024


@dataclass
class Job:
    """One engine request: a choice of one prompt."""

    prompt_token_ids: list[int]
    params: SamplingParams


class ClientGone(Exception):
    """The HTTP client disconnected; nothing more can be sent to it."""


class StalledConsumer(Exception):
    """The client stopped taking its outputs; its engine requests were aborted."""


class InFlight:
    """Engine request ids of every live HTTP request, so a shutdown can abort them."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()
        self.draining = False

    def abort_all(self, engine: AsyncEngine) -> None:
        for rid in list(self.request_ids):
            engine.abort(rid)


def engine_error(exc: BaseException) -> APIError | None:
    """The client-facing error for an exception the engine raised, or None if unexpected."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return overloaded(f"the server is overloaded: {exc}; retry later", "queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, RequestError):
        return invalid_request(str(exc), exc.param)
    if isinstance(exc, SamplingError):
        return invalid_request(str(exc), exc.param)
    if isinstance(exc, (StalledConsumer, StalledStreamError)):
        return APIError(408, str(exc), "invalid_request_error", code="client_too_slow")
    return None


def finish_error(out: RequestOutput, inflight: InFlight) -> APIError | None:
    """An error for a choice that ended without a normal finish (timeout, shutdown abort)."""
    if out.finish_reason == "timeout":
        return overloaded(out.error or "the request waited in the queue longer than the "
                          "queue timeout; retry later", "queue_timeout")
    if out.finish_reason == "abort":
        if inflight.draining:
            return overloaded("the server is shutting down; retry on another replica or later",
                              "shutting_down")
        return APIError(500, "the request was aborted", "server_error", code="aborted")
    if out.error:
        return APIError(500, out.error, "server_error")
    return None


async def run_choices(
    engine: AsyncEngine,
    jobs: list[Job],
    request_id: str,
    priority: int,
    inflight: InFlight,
    metrics: ServerMetrics,
    max_buffered_per_choice: int = MAX_BUFFERED_PER_CHOICE,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merged outputs of `jobs`, tagged with the job index. Raises APIError for engine
    refusals (queue full, bad request); aborts all unfinished jobs when closed early, and
    when the consumer leaves more than max_buffered_per_choice x len(jobs) outputs untaken."""
    rids = [f"{request_id}-{i}" for i in range(len(jobs))]
    if len(jobs) == 1:  # the common case, without a merging task between engine and consumer
        async for item in _run_one(engine, jobs[0], rids[0], priority, inflight, metrics):
            yield item
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
    finished: set[int] = set()
    max_buffered = max_buffered_per_choice * len(jobs)

    async def pump(i: int) -> None:
        job = jobs[i]
        try:
            async for out in engine.generate(job.prompt_token_ids, job.params, rids[i], priority):
                queue.put_nowait((i, out))
                if queue.qsize() > max_buffered:  # nobody takes them: stop the work
                    for rid in rids:
                        engine.abort(rid)
                    queue.put_nowait((i, StalledConsumer(
                        f"the client did not read its stream ({queue.qsize()} outputs waiting)")))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which decides
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, None))

    inflight.request_ids.update(rids)
    tasks = [asyncio.create_task(pump(i)) for i in range(len(jobs))]
    try:
        remaining = len(jobs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                err = engine_error(item)
                if err is None:
                    raise item
                raise err
            if item.finished:
                finished.add(i)
                metrics.observe_finished(item)
            yield i, item
    finally:
        # Synchronous on purpose: this must run even inside a cancelled scope.
        for i, rid in enumerate(rids):
            if i not in finished:
                engine.abort(rid)
        for task in tasks:
            task.cancel()
        inflight.request_ids.difference_update(rids)


async def _run_one(engine: AsyncEngine, job: Job, rid: str, priority: int, inflight: InFlight,
                   metrics: ServerMetrics) -> AsyncIterator[tuple[int, RequestOutput]]:
    """run_choices for one job: the engine's stream itself (AsyncEngine.generate bounds
    what it holds for a consumer that stops taking outputs)."""
    inflight.request_ids.add(rid)
    done = False
    outputs = engine.generate(job.prompt_token_ids, job.params, rid, priority)
    try:
        async for out in outputs:
            if out.finished:
                done = True
                metrics.observe_finished(out)
            yield 0, out
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the client-facing error where there is one
        err = engine_error(exc)
        if err is None:
            raise
        raise err from None
    finally:
        if not done:
            engine.abort(rid)
        inflight.request_ids.discard(rid)
        await outputs.aclose()


@dataclass
class Collected:
    """The whole result of n choices, gathered from `run_choices`' stream."""

    texts: list[str]
    logprobs: list[list]
    finish_reasons: list[str | None]
    completion_tokens: int


async def collect_choices(outputs: AsyncIterator[tuple[int, RequestOutput]], n_jobs: int,
                          inflight: InFlight) -> Collected:
    """Drains a non-streaming request's outputs; a failed choice raises its APIError."""
    got = Collected([""] * n_jobs, [[] for _ in range(n_jobs)], [None] * n_jobs, 0)
    async with aclosing(outputs):
        async for i, out in outputs:
            got.texts[i] += out.new_text
            got.logprobs[i].extend(out.new_logprobs)
            if out.finished:
                err = finish_error(out, inflight)
                if err is not None:
                    raise err
                got.finish_reasons[i] = out.finish_reason
                got.completion_tokens += out.num_output_tokens
    return got


class _ClientWatcher:
    """One task per event loop, not one per request, that polls the clients of the requests
    awaiting in `until_disconnect` every DISCONNECT_POLL_S and cancels those whose client has
    gone."""

    def __init__(self) -> None:
        self.watching: dict[asyncio.Task, tuple[Request, float]] = {}  # (client, since)
        self.task: asyncio.Future | None = None

    async def run(self) -> None:
        me = asyncio.current_task()
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if not self.watching:
                break
            now = time.monotonic()
            for task, (client, since) in list(self.watching.items()):
                if now - since >= DISCONNECT_POLL_S and not task.done() \
                        and await client.is_disconnected():
                    self.watching.pop(task, None)
                    task.cancel()
        if self.task is me:
            self.task = None


_watcher = _ClientWatcher()


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Awaits `awaitable` in this task while the watcher polls the client; if it goes away,
    the task is cancelled (the awaitable's cleanup aborts the engine requests or drops the
    queued inputs) and ClientGone raised."""
    task = asyncio.current_task()
    assert task is not None
    _watcher.watching[task] = (request, time.monotonic())
    running = _watcher.task
    if running is None or running.done() or running.get_loop() is not task.get_loop():
        _watcher.task = asyncio.ensure_future(_watcher.run())
    try:
        return await awaitable
    except asyncio.CancelledError:
        if task not in _watcher.watching:  # the watcher found its client gone
            task.uncancel()
            raise ClientGone() from None
        raise
    finally:
        _watcher.watching.pop(task, None)
