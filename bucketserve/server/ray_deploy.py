"""Scale-out on Ray Serve: engine replicas behind one OpenAI endpoint (docs/ray.md).

Three deployments make one Serve application:

- `EngineReplica` (N replicas, autoscaled between --min-replicas and --max-replicas): each
  loads its own engine core process, KV pool, buckets TOML and (unless 'none') embedding
  model, and builds the very FastAPI app of the single server (server/app.py) without
  binding a port. Its `asgi` method runs that app on one forwarded request and streams the
  app's ASGI messages back in batches (--stream-batch-ms). `check_health` raises once the
  engine core is gone, so Ray replaces the replica.
- `Ingress` (the HTTP entry; Ray Serve's proxy sends it every request): checks the API key
  and the body size, then forwards the request through a streaming DeploymentHandle to an
  engine replica chosen by Ray Serve's request router. It owns what only a hop in front of
  the replicas can do: a replica that dies mid-request gives its client an OpenAI error
  body (503) or, mid-stream, an SSE error event and [DONE]; Ray's back-pressure
  (max_queued_requests) becomes the server's own 503 + Retry-After body; /metrics merges
  every replica's series under a `replica` label.
- `MetricsHub` (one replica, no CPU): the replicas push their rendered /metrics to it
  twice a second; the ingress reads them from it.

With `--ray-ingress haproxy` there is no `Ingress`: `DirectReplica` (an `EngineReplica` that
is the application's ingress) serves HTTP itself through Ray Serve's direct ingress, and
Ray's HAProxy (leastconn over the replicas, retry on connect failures) sends it requests;
the replica checks the API key and body size and merges /metrics from the hub. No Python
process relays a stream, but a replica that dies mid-stream cuts its clients' connections
(HAProxy cannot add an SSE error event); a request not yet sent to it goes to another.

`build_app(args)` makes the application from `bucketserve serve` option names (dest form:
"replicas", "min_replicas", "api_key", ...); `serve_ray(args)` is `bucketserve serve
--replicas N`. Importing this module needs ray; nothing else in bucketserve imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.types import Message, Receive, Scope, Send

from bucketserve.server.app import ApiKeyMiddleware
from bucketserve.server.errors import APIError, BodySizeLimitMiddleware, overloaded

log = logging.getLogger("bucketserve.ray")

PUSH_S = 0.5  # how often a replica pushes its metrics to the hub
STALE_S = 5.0  # a replica whose metrics are older than this is gone (left out of /metrics)
HEALTH_PERIOD_S = 1.0
HEALTH_TIMEOUT_S = 30.0
REPLICA_FAILED = "the replica serving this request failed; retry"
# A request whose replica died before it answered anything goes to another replica, up to
# this many tries in all (nothing reached the client, so nothing is sent twice).
RETRIES = 3
REPLICA_GONE = (RayActorError, ActorUnavailableError)
APP_NAME = "bucketserve"
ROUTER_NEEDS_PROXY = "--request-router needs --ray-ingress proxy: with haproxy, HAProxy routes"
DIRECT_MARGIN = 64  # --ray-ingress haproxy: requests a replica takes beyond its engine's limits
# --ray-ingress haproxy: how long a stopping replica stays reachable before it closes its
# listener (Ray's RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, 30 s by default). Ray's
# HAProxy manager reloads within a second of a replica leaving, and HAProxy retries a refused
# connection on another replica, so a few seconds do; Ray's 30 s outlasted the default
# --shutdown-timeout (30 s), after which the controller kills the replica before its engine
# drains, and made every stop take 30 s with nothing in flight.
DEREGISTER_S = 5.0
DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def serve_args(overrides: dict[str, Any]) -> argparse.Namespace:
    """`bucketserve serve`'s defaults, with `overrides` (option dest names) on top."""
    from bucketserve.server.options import build_parser

    args = build_parser().parse_args(["serve"])
    unknown = set(overrides) - set(vars(args))
    if unknown:
        raise ValueError(f"unknown bucketserve serve option(s): {', '.join(sorted(unknown))}")
    vars(args).update(overrides)
    return args


@dataclass
class Forwarded:
    """One HTTP request on its way to an engine replica. `prompt` is the request's prompt
    (or chat messages) for a prefix-aware router; "" for other routes."""

    scope: dict[str, Any]
    body: bytes
    prompt: str = field(default="")


def forwarded_scope(scope: Scope) -> dict[str, Any]:
    """The picklable part of an ASGI HTTP scope that the app reads."""
    keys = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
            "query_string", "headers", "server", "client")
    out = {k: scope[k] for k in keys if k in scope}
    out["root_path"] = ""
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    return out


def prompt_text(body: bytes) -> str:
    """The prompt or the chat messages' text of a generation request ("" otherwise)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("prompt"), str):
        return data["prompt"]
    messages = data.get("messages")
    if isinstance(messages, list):
        return "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return ""


# ----------------------------------------------------------------------- engine replica
class EngineReplica:
    """One engine (core process, KV pool, buckets) and the single server's FastAPI app."""

    async def __init__(self, args: dict[str, Any], hub: DeploymentHandle) -> None:
        from bucketserve.server.app import create_app
        from bucketserve.server.context import ServerContext
        from bucketserve.server.startup import load_add_ons, load_engine

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        ns = serve_args(args)
        self.batch_wait_s = ns.stream_batch_ms / 1e3
        logging.getLogger("bucketserve").setLevel(ns.log_level.upper())
        # Loading blocks for a while: off the replica's event loop, which answers Ray.
        engine, buckets = await asyncio.to_thread(load_engine, ns)
        add_ons = await asyncio.to_thread(load_add_ons, ns, buckets)
        self.ctx = ServerContext(engine, shutdown_timeout_s=ns.shutdown_timeout)
        # No API key behind the ingress, which checked it; a direct replica checks it itself.
        api_key = ns.api_key if ns.ray_ingress == "haproxy" else None
        self.api = create_app(self.ctx, api_key=api_key, max_body_bytes=ns.max_body_bytes,
                              add_ons=add_ons, body_timeout_s=ns.body_timeout)
        self._add_ons = add_ons
        self._stack = AsyncExitStack()
        await self._stack.enter_async_context(self.api.router.lifespan_context(self.api))
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._hub = hub
        self._pusher = asyncio.create_task(self._push_metrics())
        log.info("replica %s serves %s (engine core pid %s)", self.replica,
                 engine.model_name, getattr(engine.core, "pid", None))

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self._hub.put.remote(self.replica, self.ctx.metrics.render().decode())
            except Exception as exc:  # noqa: BLE001 - the hub restarts; try again
                log.debug("metrics push failed: %s", exc)
            await asyncio.sleep(PUSH_S)

    async def asgi(self, request: Forwarded) -> AsyncIterator[list[Message]]:
        """Runs the app on one request; yields the ASGI messages it sends, in lists (one Ray
        streaming item per list, not per SSE event): after the first body message, a list
        holds what the app sent within `batch_wait_s` (--stream-batch-ms) of its first
        message; the start and the first body (the first token) go at once. The caller
        going away (Ray cancels this generator) is a client disconnect for the app."""
        queue: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive() -> Message:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            queue.put_nowait(message)

        task = asyncio.create_task(self.api(request.scope, receive, send))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            done = body_sent = False
            while not done:
                batch = [await queue.get()]
                if body_sent and self.batch_wait_s > 0 and batch[0] is not None:
                    await asyncio.sleep(self.batch_wait_s)
                while not queue.empty():
                    batch.append(queue.get_nowait())
                done = batch[-1] is None  # None comes last: the app has returned
                messages = [m for m in batch if m is not None]
                if messages:
                    body_sent = body_sent or messages[-1]["type"] == "http.response.body"
                    yield messages
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 10.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    task.cancel()

    def check_health(self) -> None:
        """Ray Serve's health check: raises once the engine core (or an add-on) is gone."""
        from bucketserve.server.app import parts_alive

        if not parts_alive(self.ctx, self._add_ons):
            raise RuntimeError(f"engine stopped: {self.ctx.engine.dead_reason or 'not running'}")

    async def __del__(self) -> None:
        """Ray Serve waited for the replica's requests (graceful_shutdown_timeout_s); stop
        the engine core and the add-ons as the single server's lifespan does."""
        if not hasattr(self, "_pusher"):  # __init__ failed: nothing was started
            return
        self._pusher.cancel()
        from bucketserve.server.app import begin_drain

        begin_drain(self.ctx)
        await self._stack.aclose()


class DirectReplica(EngineReplica):
    """--ray-ingress haproxy: an engine replica that is the application's ingress. Ray Serve
    runs the ASGI app that `__serve_build_asgi_app__` returns on the replica's own HTTP port
    (direct ingress) and HAProxy balances clients over the replicas; the single server's app
    answers everything but GET /metrics, which merges every replica's series."""

    def __serve_build_asgi_app__(self) -> Any:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await self.endpoint(scope, receive, send)  # (a plain function: uvicorn's ASGI 3)

        return app

    async def endpoint(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the app's own lifespan ran in __init__
            await lifespan(receive, send)
            return
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET":
            texts = await self._hub.collect.remote()
            texts[self.replica] = self.ctx.metrics.render().decode()  # this one, fresh
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": merge_metrics(texts)})
            return
        await self.api(scope, receive, send)


# -------------------------------------------------------------------------- metrics hub
class MetricsHub:
    """The latest /metrics text of every engine replica."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.latest[replica] = (time.monotonic(), text)

    def collect(self) -> dict[str, str]:
        now = time.monotonic()
        self.latest = {r: v for r, v in self.latest.items() if now - v[0] < STALE_S}
        return {r: text for r, (_, text) in self.latest.items()}


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus text of every replica's series, each sample with a `replica` label."""
    families: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(s._replace(labels={**s.labels, "replica": replica})
                                      for s in family.samples)
            else:
                family.samples = [s._replace(labels={**s.labels, "replica": replica})
                                  for s in family.samples]

    class Merged:
        def collect(self):
            return families.values()

    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry)


# ------------------------------------------------------------------------------ ingress
class Ingress:
    """The HTTP entry: auth, body limit, then forwards each request to an engine replica."""

    def __init__(self, engine: DeploymentHandle, hub: DeploymentHandle,
                 args: dict[str, Any]) -> None:
        self.args = serve_args(args)
        self.engine = engine.options(stream=True, method_name="asgi")
        self.hub = hub

    def __serve_build_asgi_app__(self):
        app: Any = self.forward
        app = BodySizeLimitMiddleware(app, max_bytes=self.args.max_body_bytes,
                                      body_timeout_s=self.args.body_timeout)
        if self.args.api_key:
            app = ApiKeyMiddleware(app, api_key=self.args.api_key)
        return app

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        message = await receive()  # BodySizeLimitMiddleware replays the whole body at once
        body = message.get("body", b"")
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            texts = await self.hub.collect.remote()
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": merge_metrics(texts)})
            return
        # the prompt is only for a prefix-aware router: no JSON decode without one
        prompt = prompt_text(body) if self.args.request_router else ""
        request = Forwarded(forwarded_scope(scope), body, prompt)
        for attempt in range(1, RETRIES + 1):
            started = await self.forward_once(request, scope, receive, send,
                                              last=attempt == RETRIES)
            if started:
                return
            log.warning("%s %s: its replica died before answering; retrying on another "
                        "(attempt %d of %d)", scope["method"], scope["path"], attempt + 1,
                        RETRIES)

    async def forward_once(self, request: Forwarded, scope: Scope, receive: Receive,
                           send: Send, last: bool) -> bool:
        """One try on one replica. False: the replica died before the response started
        (nothing was sent; the caller tries again); else it answered, or the client got an
        error body or SSE error event."""
        stream = self.engine.remote(request)
        started = sse = False
        try:
            async for batch in stream:
                for message in merge_bodies(batch):
                    if message["type"] == "http.response.start":
                        started = True
                        sse = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                  for k, v in message.get("headers", []))
                    await send(message)
        except BackPressureError:
            if started:
                raise
            err = overloaded("every replica is busy and Ray's queue is full; retry later",
                             "queue_full")
            await err.response()(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 - the replica died or failed mid-request
            if not started and not last and isinstance(exc, REPLICA_GONE):
                return False
            log.warning("request %s %s failed on its replica: %s", scope["method"],
                        scope["path"], exc)
            err = APIError(503, REPLICA_FAILED, "server_error", None, "replica_failed",
                           headers={"Retry-After": "1"})
            if not started:
                await err.response()(scope, receive, send)
            elif sse:
                event = b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            stream.cancel()
        return True


def merge_bodies(batch: list[Message]) -> list[Message]:
    """`batch` with each run of consecutive `http.response.body` messages made one (bodies
    joined, `more_body` of the run's last): one send to Ray's proxy per run, not per SSE
    event. The bytes the client gets are the same."""
    out: list[Message] = []
    run: list[Message] = []  # the bodies since the last other message
    for message in [*batch, None]:
        if message is not None and message["type"] == "http.response.body":
            run.append(message)
            continue
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append({"type": "http.response.body",
                        "body": b"".join(m.get("body", b"") for m in run),
                        "more_body": run[-1].get("more_body", False)})
        run = []
        if message is not None:
            out.append(message)
    return out


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# ------------------------------------------------------------------------- application
def replica_limits(args: argparse.Namespace) -> tuple[int, int]:
    """(running limit, waiting limit) of one engine from its buckets TOML: a replica takes
    at most running + waiting requests (Ray's max_ongoing_requests); past that they queue
    in Ray or get a 503."""
    from bucketserve.buckets import load_buckets

    buckets = load_buckets(args.buckets)
    return buckets.running_limit(args.device), buckets.max_waiting


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for `serve run bucketserve.deploy:build_app key=value ...` or a
    config file's `import_path`; `args` are `bucketserve serve` option names (dest form),
    values as strings (from `serve run`) or typed (from a config file or the CLI)."""
    ns = serve_args(typed(args))
    running, waiting = replica_limits(ns)
    direct = ns.ray_ingress == "haproxy"
    if direct and ns.request_router:
        raise ValueError(ROUTER_NEEDS_PROXY)
    options: dict[str, Any] = {
        # direct: room above the engine's own limits, so that its queue_full 503 (an OpenAI
        # error body) comes before Ray's plain-text back-pressure answer
        "max_ongoing_requests": running + waiting + (DIRECT_MARGIN if direct else 0),
        "max_queued_requests": (waiting if ns.max_queued_requests is None
                                else ns.max_queued_requests),
        "health_check_period_s": HEALTH_PERIOD_S,
        "health_check_timeout_s": HEALTH_TIMEOUT_S,
        "graceful_shutdown_timeout_s": ns.shutdown_timeout,
        "ray_actor_options": replica_resources(ns),
    }
    if ns.min_replicas is not None or ns.max_replicas is not None:
        low = ns.min_replicas if ns.min_replicas is not None else 1
        high = ns.max_replicas if ns.max_replicas is not None else max(low, ns.replicas)
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high,
            "initial_replicas": min(max(ns.replicas, low), high),
            # scale up once a replica holds as many requests as its engine runs at once
            "target_ongoing_requests": running}
    else:
        options["num_replicas"] = ns.replicas
    if ns.request_router:  # e.g. ray.serve.llm.request_router:PrefixCacheAffinityRouter
        options["request_router_config"] = {"request_router_class": ns.request_router}
    hub = serve.deployment(MetricsHub, ray_actor_options={"num_cpus": 0},
                           logging_config={"enable_access_log": False}).bind()
    if direct:
        return serve.deployment(serve.ingress()(DirectReplica)).options(**options).bind(
            vars(ns), hub)
    engine = serve.deployment(EngineReplica).options(**options).bind(vars(ns), hub)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        # the ingress only forwards: it must never be the bottleneck
        num_replicas=ns.ingress_replicas, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, hub, vars(ns))


def replica_resources(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.device == "cuda":
        return {"num_gpus": ns.gpus_per_replica, "num_cpus": ns.cpus_per_replica}
    return {"num_cpus": ns.cpus_per_replica}


def typed(args: dict[str, Any]) -> dict[str, Any]:
    """`serve run` passes every value as a string: convert them as the CLI would."""
    from bucketserve.server.options import build_parser

    parser = build_parser()
    serve_parser = next(a for a in parser._subparsers._group_actions[0].choices.values()
                        if a.prog.endswith(" serve"))
    actions = {a.dest: a for a in serve_parser._actions}
    out = {}
    for key, value in args.items():
        action = actions.get(key)
        if isinstance(value, str) and action is not None:
            if action.nargs == 0:  # a flag
                value = value.lower() in ("1", "true", "yes")
            elif action.type is not None:
                value = action.type(value)
        out[key] = value
    return out


def direct_ingress_env(shutdown_timeout: float, environ: dict[str, str]) -> dict[str, str]:
    """The environment a local Ray instance needs for --ray-ingress haproxy: the HAProxy
    switch, and a deregistration window inside the shutdown budget (at most DEREGISTER_S, at
    most half of --shutdown-timeout, so that the replica's own drain gets the rest) unless
    the operator set Ray's variable."""
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    if DRAIN_ENV not in environ:
        env[DRAIN_ENV] = f"{min(DEREGISTER_S, max(0.0, shutdown_timeout) / 2):g}"
    return env


def serve_ray(args: argparse.Namespace) -> int:
    """`bucketserve serve --replicas N`: starts (or joins) Ray, runs the application with
    the HTTP proxy on --host / --port until SIGTERM / SIGINT, then shuts Serve down
    (replicas drain for --shutdown-timeout seconds) and exits 0."""
    import ray

    if args.ray_ingress == "haproxy":
        # read by Serve's controller and replicas at their start (a local instance inherits
        # this process's environment; a cluster joined with --ray-address must have been
        # started with them)
        os.environ.update(direct_ingress_env(args.shutdown_timeout, dict(os.environ)))
    # "local": a new instance even when this machine already runs a `ray start` cluster
    init: dict[str, Any] = {"address": args.ray_address or "local", "log_to_driver": True}
    if args.ray_address is None:
        init["include_dashboard"] = False
    ray.init(**init)
    # ours from here on (ray.init's SIGTERM handler exits at once): a signal while the
    # replicas are still deploying stops the server once serve.run returns, through the same
    # drain as later; a second one interrupts whatever runs
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt(f"signal {signum} again")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    location = args.proxy_location or ("HeadOnly" if args.ray_address is None else "EveryNode")
    serve.start(proxy_location=location, http_options={"host": args.host, "port": args.port})
    try:
        serve.run(build_app(vars(args)), name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%d with %d replica(s) on Ray", args.host, args.port,
                 args.replicas)
        while not stop.wait(0.5):
            pass
        log.info("shutting down: replicas get %.1f s to finish their requests",
                 args.shutdown_timeout)
    finally:
        serve.delete(APP_NAME)  # the replicas drain (graceful_shutdown_timeout_s), then stop
        serve.shutdown()
        ray.shutdown()
    return 0
