"""The Ray ingress (server/ray_deploy.py) without a Ray cluster: what a client gets when Ray
refuses a request (back-pressure), when a replica dies before or during its answer, and the
merged /metrics. The deployment handle is a stand-in; everything else is the real code."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray.exceptions import ActorDiedError  # noqa: E402
from ray.serve.exceptions import BackPressureError  # noqa: E402

from bucketserve.server.ray_deploy import (  # noqa: E402
    DRAIN_ENV,
    EngineReplica,
    Forwarded,
    Ingress,
    direct_ingress_env,
    merge_bodies,
    merge_metrics,
    serve_args,
)

START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}
CHUNK = {"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True}


class Handle:
    """A DeploymentHandle stand-in: each call plays the next script (a replica's items:
    lists of ASGI messages, then maybe an exception)."""

    def __init__(self, *scripts: list) -> None:
        self.scripts = list(scripts)
        self.calls = 0
        self.requests: list = []

    def options(self, **_) -> Handle:
        return self

    def remote(self, request) -> Stream:
        self.calls += 1
        self.requests.append(request)
        return Stream(self.scripts.pop(0))


class Stream:
    def __init__(self, script: list) -> None:
        self.script = script

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        pass


def call(handle: Handle, api_key: str | None = None, headers: list | None = None,
         sent: list | None = None, **args) -> tuple[int, dict, bytes]:
    ingress = Ingress(handle, None, {"api_key": api_key, **args})
    app = ingress.__serve_build_asgi_app__()
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"",
             "query_string": b"", "headers": headers or [], "http_version": "1.1"}
    sent = [] if sent is None else sent
    given = False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, out


def test_ray_back_pressure_is_our_503_with_retry_after() -> None:
    status, headers, body = call(Handle([BackPressureError(num_queued_requests=8,
                                                           max_queued_requests=8)]))
    assert status == 503 and headers["retry-after"]
    err = json.loads(body)["error"]
    assert err["type"] == "server_overloaded" and err["code"] == "queue_full"


def test_a_replica_dead_before_answering_is_retried_on_another() -> None:
    handle = Handle([ActorDiedError()], [[START, CHUNK], [{**CHUNK, "more_body": False}]])
    status, _, body = call(handle)
    assert status == 200 and handle.calls == 2 and body.count(b"data: ") == 2


def test_a_batch_of_events_is_one_send_with_the_same_bytes() -> None:
    """A replica's item (a list of messages) reaches Ray's proxy as the start and one body
    per run of bodies: the events joined in order, more_body of the run's last."""
    events = [{**CHUNK, "body": f"data: {i}\n\n".encode()} for i in range(5)]
    end = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
    sent: list[dict] = []
    status, _, body = call(Handle([[START, *events[:2]], events[2:], [end]]), sent=sent)
    assert status == 200
    assert body == b"".join(e["body"] for e in events) + b"data: [DONE]\n\n"
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert [m["more_body"] for m in bodies] == [True, True, False]
    assert bodies[1]["body"] == b"data: 2\n\ndata: 3\n\ndata: 4\n\n"


def test_merge_bodies_keeps_other_messages_and_their_order() -> None:
    body = {"type": "http.response.body", "body": b"a", "more_body": True}
    trailer = {"type": "http.response.trailers", "headers": [], "more_trailers": False}
    merged = merge_bodies([START, body, {**body, "body": b"b"}, trailer,
                           {**body, "body": b"c", "more_body": False}])
    assert merged == [START, {**body, "body": b"ab"}, trailer,
                      {**body, "body": b"c", "more_body": False}]
    assert merge_bodies([]) == []


def test_the_prompt_is_read_only_for_a_request_router() -> None:
    """Without --request-router the ingress never decodes the body; with one it hands the
    prompt along for a prefix-aware router."""
    done = [[START, {**CHUNK, "more_body": False}]]
    plain, routed = Handle(list(done)), Handle(list(done))
    call(plain)
    call(routed, request_router="some.module:Router")
    assert plain.requests[0].prompt == "" and routed.requests[0].prompt == "hi"


def test_every_try_dead_is_a_503_error_body() -> None:
    handle = Handle([ActorDiedError()], [ActorDiedError()], [ActorDiedError()])
    status, headers, body = call(handle)
    assert status == 503 and handle.calls == 3 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "replica_failed"


def test_a_replica_dead_mid_stream_ends_it_with_an_error_event_and_done() -> None:
    handle = Handle([[START, CHUNK], ActorDiedError()])
    status, _, body = call(handle)
    assert status == 200 and handle.calls == 1  # never sent twice
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_failed"


def test_the_api_key_is_checked_before_forwarding() -> None:
    handle = Handle()
    status, _, body = call(handle, api_key="k", headers=[(b"authorization", b"Bearer no")])
    assert status == 401 and handle.calls == 0
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_merged_metrics_label_every_replica_and_keep_every_sample() -> None:
    def replica_text(running: float, done: float) -> str:
        registry = CollectorRegistry()
        Gauge("bucketserve_requests_running", "running", registry=registry).set(running)
        Counter("bucketserve_request_success", "finished", ["finish_reason"],
                registry=registry).labels("stop").inc(done)
        return generate_latest(registry).decode()

    text = merge_metrics({"a": replica_text(1, 5), "b": replica_text(2, 7)}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("bucketserve_requests_running", (("replica", "a"),))] == 1
    assert samples[("bucketserve_requests_running", (("replica", "b"),))] == 2
    assert samples[("bucketserve_request_success_total",
                    (("finish_reason", "stop"), ("replica", "b")))] == 7
    assert text.count("# TYPE bucketserve_requests_running gauge") == 1


def test_a_negative_stream_batch_wait_is_refused(capsys) -> None:
    from bucketserve.server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--replicas", "1", "--stream-batch-ms", "-1"])
    assert "--stream-batch-ms: expected 0 or more, got '-1'" in capsys.readouterr().err


def test_serve_args_refuses_an_unknown_option() -> None:
    assert serve_args({"replicas": 3}).replicas == 3
    with pytest.raises(ValueError, match="replicaz"):
        serve_args({"replicaz": 3})


def test_the_committed_serve_config_builds_the_application() -> None:
    """examples/ray_serve_config.yaml is a valid Serve config and its args make the app."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from bucketserve.deploy import build_app

    path = Path(__file__).resolve().parent.parent / "examples" / "ray_serve_config.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (app,) = config.applications
    assert app.import_path == "bucketserve.deploy:build_app"
    built = build_app(app.args)
    engine = built._bound_deployment.init_args[0]._bound_deployment  # the ingress binds it
    assert engine._deployment_config.autoscaling_config.max_replicas == 4
    assert engine.ray_actor_options["num_gpus"] == 1


def test_serve_run_strings_are_typed_as_the_cli_does() -> None:
    """`serve run bucketserve.deploy:build_app replicas=3 ...` passes strings."""
    from bucketserve.deploy import build_app

    built = build_app({"replicas": "3", "cpus_per_replica": "0.5", "embedding_model": "none"})
    engine = built._bound_deployment.init_args[0]._bound_deployment
    assert engine._deployment_config.num_replicas == 3
    assert engine.ray_actor_options["num_cpus"] == 0.5


def test_haproxy_ingress_makes_the_engine_replica_the_ingress(capsys) -> None:
    """--ray-ingress haproxy: one deployment, the engine replica itself serving HTTP (no
    Ingress), with room above the engine's limits so that its own 503 body comes first; a
    custom request router (which HAProxy would bypass) is refused before anything starts."""
    from bucketserve.deploy import build_app
    from bucketserve.server.cli import main
    from bucketserve.server.ray_deploy import DIRECT_MARGIN, replica_limits

    built = build_app({"replicas": "2", "ray_ingress": "haproxy", "embedding_model": "none"})
    engine = built._bound_deployment
    assert engine.name == "DirectReplica"
    assert engine.func_or_class.__serve_build_asgi_app__  # Serve's ingress wrapper
    running, waiting = replica_limits(serve_args({}))
    assert engine._deployment_config.max_ongoing_requests == running + waiting + DIRECT_MARGIN
    assert engine._deployment_config.num_replicas == 2
    plain = build_app({"replicas": "2", "embedding_model": "none"})._bound_deployment
    assert plain.name == "Ingress"

    with pytest.raises(ValueError, match="--request-router needs --ray-ingress proxy"):
        build_app({"ray_ingress": "haproxy", "request_router": "m:C"})
    assert main(["serve", "--replicas", "1", "--ray-ingress", "haproxy",
                 "--request-router", "m:C"]) == 2
    assert "--request-router needs --ray-ingress proxy" in capsys.readouterr().err


def test_autoscaling_bounds_alone_select_ray_and_are_checked(capsys) -> None:
    """--min/--max-replicas without --replicas still mean Ray (never a silent single server);
    bounds the wrong way round are refused before anything starts."""
    from bucketserve.server.cli import main

    assert main(["serve", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert "--min-replicas 3 is over --max-replicas 2" in capsys.readouterr().err


def replica_items(app, batch_wait_s: float = 0.0) -> list[list[dict]]:
    """The items EngineReplica.asgi yields for one request to `app` (no Ray: the method on
    a bare instance)."""
    replica = object.__new__(EngineReplica)
    replica.api, replica.batch_wait_s = app, batch_wait_s
    request = Forwarded({"type": "http", "method": "POST", "path": "/"}, b"{}")

    async def run():
        return [item async for item in replica.asgi(request)]

    return asyncio.run(run())


def test_the_replica_yields_every_message_queued_as_one_item() -> None:
    async def burst(scope, receive, send):  # sends without waiting in between
        await send(START)
        for _ in range(3):
            await send(CHUNK)
        await send({**CHUNK, "more_body": False})

    assert replica_items(burst) == [[START, CHUNK, CHUNK, CHUNK, {**CHUNK, "more_body": False}]]


def test_a_lone_stream_gets_each_event_as_it_comes() -> None:
    """Events apart in time are not held back for more: one item each."""
    async def paced(scope, receive, send):
        await send(START)
        for _ in range(3):
            await asyncio.sleep(0.01)
            await send(CHUNK)

    assert replica_items(paced) == [[START], [CHUNK], [CHUNK], [CHUNK]]


def test_after_the_first_token_a_batch_collects_what_comes_within_the_wait() -> None:
    """--stream-batch-ms: the start and the first event go at once (TTFT), later events
    are held up to the wait and go together."""
    last = {**CHUNK, "more_body": False}

    async def paced(scope, receive, send):
        await send(START)
        await asyncio.sleep(0.01)
        await send(CHUNK)
        for message in (CHUNK, CHUNK, last):
            await asyncio.sleep(0.01)
            await send(message)

    assert replica_items(paced, batch_wait_s=0.5) == [[START], [CHUNK], [CHUNK, CHUNK, last]]


def test_haproxy_drain_window_stays_inside_the_shutdown_budget() -> None:
    # Ray's own default (30 s) would hold every stopping replica for the whole default
    # --shutdown-timeout, and past a shorter one (the controller then kills it undrained)
    assert direct_ingress_env(30.0, {}) == {"RAY_SERVE_ENABLE_HA_PROXY": "1", DRAIN_ENV: "5"}
    assert direct_ingress_env(4.0, {})[DRAIN_ENV] == "2"
    assert direct_ingress_env(0.0, {})[DRAIN_ENV] == "0"
    # an operator's own setting wins
    assert DRAIN_ENV not in direct_ingress_env(30.0, {DRAIN_ENV: "60"})


def test_a_signal_while_the_replicas_deploy_stops_the_server_cleanly(monkeypatch) -> None:
    # serve.run can take the replicas' model loads; a SIGTERM then used to hit ray.init's own
    # handler (sys.exit in the middle of serve.run) and the process ended by SIGABRT
    import os
    import signal
    import sys
    from argparse import Namespace

    import ray

    from bucketserve.server import ray_deploy

    calls: list[str] = []

    def run(app, **_kw) -> None:
        calls.append("run")
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the application deploys

    def init(**_kw) -> None:  # as ray.init does on the main thread
        calls.append("init")
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(ray_deploy.serve, "start", lambda **_kw: calls.append("start"))
    monkeypatch.setattr(ray_deploy.serve, "run", run)
    monkeypatch.setattr(ray_deploy.serve, "delete", lambda name: calls.append("delete"))
    monkeypatch.setattr(ray_deploy.serve, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray_deploy, "build_app", lambda _args: object())
    args = Namespace(ray_ingress="proxy", ray_address=None, proxy_location=None,
                     host="127.0.0.1", port=0, replicas=1, shutdown_timeout=1.0)
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert ray_deploy.serve_ray(args) == 0
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
    assert calls == ["init", "start", "run", "delete", "shutdown", "ray.shutdown"]
