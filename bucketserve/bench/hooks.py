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
- BUCKETSERVE_CORE_PROFILE=FILE: cProfile of the engine core loop, written to FILE.
"""

from __future__ import annotations

import os
import sys
from functools import partial

from bucketserve.engine.faults import FaultPlan, Seams

SWITCHES = ("BUCKETSERVE_FAULTS", "BUCKETSERVE_FAKE_CORE", "BUCKETSERVE_FAKE_RUNNER",
            "BUCKETSERVE_CORE_PROFILE")


def seams_from(env: dict[str, str]) -> Seams:
    """The Seams the variables of `env` ask for (none set: the production server's)."""
    from bucketserve.engine.fake_core import FakeCore
    from bucketserve.engine.fake_runner import install

    faults = env.get("BUCKETSERVE_FAULTS", "").strip()
    core_s = env.get("BUCKETSERVE_FAKE_CORE")
    runner_s = env.get("BUCKETSERVE_FAKE_RUNNER")
    return Seams(faults=FaultPlan.parse(faults) if faults else None,
                 prepare_engine=partial(install, step_s=float(runner_s)) if runner_s else None,
                 make_core=partial(FakeCore, step_s=float(core_s)) if core_s else None,
                 profile_path=env.get("BUCKETSERVE_CORE_PROFILE") or None)


def main(argv: list[str] | None = None) -> int:
    from bucketserve.server.cli import main as cli_main

    return cli_main(argv, seams_from(dict(os.environ)))


if __name__ == "__main__":
    sys.exit(main())
