"""Test seams: fault injection, and the stand-ins a test or benchmark passes to the server.

A FaultPlan makes one engine step, one detokenization or one encoder batch fail. It is off
unless the caller passes one in (`LLMEngine(faults=)`, `AsyncEngine(faults=)`, the embedding
service's `faults`, or a `Seams` given to `bucketserve.server.cli.main`); nothing in the HTTP
API can turn it on, and no production module reads it from the environment (the test
launcher `bucketserve/bench/hooks.py` does). A plan is parsed from a comma-separated list of
`point:marker[:times]` rules:

    FaultPlan.parse("step:9001,oom:9002,detok:9003,encode:9004,step:9005:*")

A rule fires on work that holds a sequence (or an embedding input) whose first token id is
`marker`, so a test picks exactly which request meets the fault by sending token ids. `times`
is how often it fires (default 1; `*` for always: a part that stays broken).

Points: `step` raises RuntimeError inside LLMEngine.step before the model runs; `oom` raises
torch.OutOfMemoryError there (the error a CUDA allocation failure raises); `detok` raises
while the new token of that one sequence is turned into text; `encode` raises in the
embedding encoder call for the batch holding that input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

POINTS = ("step", "oom", "detok", "encode")


class InjectedFault(RuntimeError):
    """Raised by a `step`, `detok` or `encode` rule."""


@dataclass
class _Rule:
    point: str
    marker: int
    times: int | None  # None: always

    def take(self) -> bool:
        if self.times is None:
            return True
        if self.times <= 0:
            return False
        self.times -= 1
        return True


class FaultPlan:
    def __init__(self, rules: list[_Rule]) -> None:
        self.rules = rules

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        rules = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            fields = part.split(":")
            if len(fields) not in (2, 3) or fields[0] not in POINTS:
                raise ValueError(f"faults: bad rule {part!r}; expected point:marker[:times] "
                                 f"with point one of {', '.join(POINTS)}")
            times = None if len(fields) == 3 and fields[2] == "*" else int(fields[2] if len(fields) == 3 else 1)
            rules.append(_Rule(fields[0], int(fields[1]), times))
        return cls(rules)

    def fire(self, point: str, first_tokens: Iterable[int]) -> None:
        """Raises if a rule of `point` matches one of the given first token ids."""
        firsts = set(first_tokens)
        for rule in self.rules:
            if rule.point == point and rule.marker in firsts and rule.take():
                message = f"injected fault at {point} (marker {rule.marker})"
                if point == "oom":
                    import torch  # this module stays light: the CLI imports it

                    raise torch.OutOfMemoryError(message)
                raise InjectedFault(message)


@dataclass(frozen=True)
class Seams:
    """What a test or benchmark passes to `bucketserve serve` (server/cli.main): picklable, as
    it crosses into the engine core process. None everywhere is the production server.

    faults: the injected failures (the core's "step" / "oom", the front end's "detok", the
        embedding service's "encode" rules).
    prepare_engine: called with the built, warmed-up engine before it serves (e.g.
        engine/fake_runner.install: a runner without a model).
    make_core: builds the core loop's EngineCore from the engine (e.g. engine/fake_core.FakeCore:
        a core without a model).
    profile_path: cProfile the core loop and write the stats there.
    """

    faults: FaultPlan | None = None
    prepare_engine: Callable[[Any], Any] | None = None
    make_core: Callable[[Any], Any] | None = None
    profile_path: str | None = None
