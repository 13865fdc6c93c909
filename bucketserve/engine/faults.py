"""Fault injection for tests: make one engine step, one detokenization or one encoder batch fail.

Off unless the environment variable BUCKETSERVE_FAULTS is set when the engine (or the
embedding service) is built; nothing in the HTTP API can turn it on or change it. The value is
a comma-separated list of `point:marker[:times]` rules:

    BUCKETSERVE_FAULTS="step:9001,oom:9002,detok:9003,encode:9004,step:9005:*"

A rule fires on work that holds a sequence (or an embedding input) whose first token id is
`marker`, so a test picks exactly which request meets the fault by sending token ids. `times`
is how often it fires (default 1; `*` for always: a part that stays broken).

Points: `step` raises RuntimeError inside LLMEngine.step before the model runs; `oom` raises
torch.OutOfMemoryError there (the error a CUDA allocation failure raises); `detok` raises
while the new token of that one sequence is turned into text; `encode` raises in the
embedding encoder call for the batch holding that input.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

ENV_VAR = "BUCKETSERVE_FAULTS"
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
                raise ValueError(f"{ENV_VAR}: bad rule {part!r}; expected point:marker[:times] "
                                 f"with point one of {', '.join(POINTS)}")
            times = None if len(fields) == 3 and fields[2] == "*" else int(fields[2] if len(fields) == 3 else 1)
            rules.append(_Rule(fields[0], int(fields[1]), times))
        return cls(rules)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """The plan of BUCKETSERVE_FAULTS, or None (the normal case: no hook runs)."""
        spec = os.environ.get(ENV_VAR, "")
        return cls.parse(spec) if spec.strip() else None

    def fire(self, point: str, first_tokens: Iterable[int]) -> None:
        """Raises if a rule of `point` matches one of the given first token ids."""
        firsts = set(first_tokens)
        for rule in self.rules:
            if rule.point == point and rule.marker in firsts and rule.take():
                message = f"injected fault at {point} (marker {rule.marker})"
                if point == "oom":
                    raise torch.OutOfMemoryError(message)
                raise InjectedFault(message)
