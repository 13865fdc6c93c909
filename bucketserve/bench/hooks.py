"""`bucketserve serve` with a test's or benchmark's stand-ins, chosen by environment variables.

    BUCKETSERVE_FAULTS=step:9001 python -m bucketserve.bench.hooks serve --port 8000 ...

The production server reads none of these: this launcher builds the `Seams`
(engine/faults.py) and passes them to `bucketserve.server.cli.main`, which hands them to the
engine core process and the front ends. The variables:

- BUCKETSERVE_FAULTS=SPEC: injected failures (engine/faults.py FaultPlan.parse);
- BUCKETSERVE_FAKE_CORE=STEP_S: the engine core is engine/fake_core.FakeCore (no model, one
  token per running sequence every STEP_S seconds): the front end measured alone;
- BUCKETSERVE_FAKE_RUNNER=STEP_S: the real core with engine/fake_runner's runner (no model
  forward; a step's ids are ready STEP_S after its launch): the engine's host cost alone;
- BUCKETSERVE_CORE_PROFILE=FILE: cProfile of the engine core loop, written to FILE;
- BUCKETSERVE_CORE_TRACE=FILE[:GUIDED[:STEPS[:SKIP]]]: a torch.profiler trace (host and
  CUDA) of STEPS engine steps (default 30), from the SKIP+1-th step (default 0: the first) that
  finds at least GUIDED running sequences under a grammar (default 0), written to FILE (a Chrome trace,
  gzipped where FILE ends in .gz; the engine's parts are named ranges in it) and FILE.txt
  (the ops' host and device times).
"""

from __future__ import annotations

import os
import sys
from functools import partial

from bucketserve.engine.faults import FaultPlan, Seams

SWITCHES = ("BUCKETSERVE_FAULTS", "BUCKETSERVE_FAKE_CORE", "BUCKETSERVE_FAKE_RUNNER",
            "BUCKETSERVE_CORE_PROFILE", "BUCKETSERVE_CORE_TRACE")


def seams_from(env: dict[str, str]) -> Seams:
    """The Seams the variables of `env` ask for (none set: the production server's)."""
    from bucketserve.engine.fake_core import FakeCore
    from bucketserve.engine.fake_runner import install

    faults = env.get("BUCKETSERVE_FAULTS", "").strip()
    core_s = env.get("BUCKETSERVE_FAKE_CORE")
    runner_s = env.get("BUCKETSERVE_FAKE_RUNNER")
    trace = env.get("BUCKETSERVE_CORE_TRACE", "").strip()
    prepare = [partial(install, step_s=float(runner_s))] if runner_s else []
    if trace:
        prepare.append(partial(trace_steps, **_trace_spec(trace)))
    return Seams(faults=FaultPlan.parse(faults) if faults else None,
                 prepare_engine=(prepare[0] if len(prepare) == 1
                                 else partial(_in_turn, prepare) if prepare else None),
                 make_core=partial(FakeCore, step_s=float(core_s)) if core_s else None,
                 profile_path=env.get("BUCKETSERVE_CORE_PROFILE") or None)


def _in_turn(calls: list, engine) -> None:
    for call in calls:
        call(engine)


def _trace_spec(spec: str) -> dict:
    """FILE[:GUIDED[:STEPS[:SKIP]]] -> trace_steps' keywords (ValueError on a malformed one)."""
    bad = ValueError(f"BUCKETSERVE_CORE_TRACE={spec!r}: "
                     "expected FILE[:GUIDED>=0[:STEPS>=1[:SKIP>=0]]]")
    path, *rest = spec.split(":")
    if not path or len(rest) > 3:
        raise bad
    guided, steps, skip = (rest + ["", "", ""])[:3]
    try:
        out = {"path": path, "guided": int(guided or 0), "steps": int(steps or 30),
               "skip": int(skip or 0)}
    except ValueError:
        raise bad from None
    if out["guided"] < 0 or out["steps"] < 1 or out["skip"] < 0:
        raise bad
    return out


def _in_range(fn, label: str):
    from torch.profiler import record_function

    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def trace_steps(engine, path: str, guided: int = 0, steps: int = 30, skip: int = 0) -> None:
    """Wraps `engine.step_news` so that `steps` steps run under torch.profiler, from the
    `skip`+1-th one that finds `guided` or more running sequences under a grammar (a skip
    passes a server's ramp-up); then writes the trace and its table (see the module's
    docstring). Once per server."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    inner = engine.step_news
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    state: dict = {"left": steps, "prof": None, "skip": skip}
    # the engine's parts, each a named range in the trace while it records (the Python
    # between the ops is otherwise unnamed)
    runner = engine.runner
    parts = [(engine, "_resolve"), (engine, "_schedule_ahead"), (engine, "_start_masks"),
             (engine.scheduler, "schedule"), (engine.outputs, "add_news"),
             (runner, "launch"), (runner, "launch_forward"), (runner, "prepare_forward"),
             (runner, "enqueue_forward"), (runner, "sample_queued"),
             (getattr(runner, "sampler", None), "sample")]
    parts = [(obj, name, vars(obj).get(name)) for obj, name in parts
             if callable(getattr(obj, name, None))]

    def step_news():
        prof = state["prof"]
        if prof is None and state["left"] and sum(
                s.grammar is not None for s in engine.scheduler.running) >= guided:
            state["skip"] -= 1
        if prof is None and state["left"] and state["skip"] < 0:
            prof = state["prof"] = profile(activities=acts)
            prof.__enter__()
            for obj, name, _ in parts:
                setattr(obj, name, _in_range(getattr(obj, name), name.lstrip("_")))
        try:
            return inner()
        finally:
            if prof is not None:
                state["left"] -= 1
                if not state["left"]:
                    state["prof"] = None
                    engine.step_news = inner
                    for obj, name, own in parts:  # as they were
                        if own is None:
                            vars(obj).pop(name, None)
                        else:
                            setattr(obj, name, own)
                    prof.__exit__(None, None, None)
                    prof.export_chrome_trace(path)
                    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                    with open(path + ".txt", "w") as f:
                        f.write(f"{steps} steps (divide the totals by it)\n{table}\n")

    engine.step_news = step_news


def main(argv: list[str] | None = None) -> int:
    from bucketserve.server.cli import main as cli_main

    return cli_main(argv, seams_from(dict(os.environ)))


if __name__ == "__main__":
    sys.exit(main())
