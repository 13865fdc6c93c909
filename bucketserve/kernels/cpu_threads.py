"""CPU thread layout of `bucketserve serve` with the engine core in its own process.

Two processes share the machine's cores: the engine core (the model's GEMMs and C kernels on
PyTorch's OpenMP team) and the HTTP front end (event loop, tokenization, detokenization, SSE).
An OpenMP team waits for its slowest member at every barrier, so when the front end takes a
core that one of the team's threads runs on, the whole team waits. Layouts:

  BUCKETSERVE_CPU_AFFINITY=off   (default) no pinning; the engine's team has the CPU plan's
                                 threads ([cpu] threads; "auto": one per core)
  BUCKETSERVE_CPU_AFFINITY=auto  with at least 2 usable cores: the engine core process on all
                                 but the last core, one compute thread per core there, the
                                 front end on the last core (vLLM's CPU build does this)
  BUCKETSERVE_CPU_AFFINITY=E/F   explicit core lists, e.g. "0/1" or "0-2/3"

Only the split server applies a layout (`--engine-in-process` runs both in one process). With
a GPU engine (`--device cuda`) only an explicit E/F layout applies ("auto" is the CPU engine's
layout): the engine core process (its loop, the grammar compile and fill threads) on E, every
API worker on F. There it is an experiment: whether keeping the front ends off the engine
loop's cores steadies a guided step (docs/structured-output.md).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("bucketserve.cpu")

ENV = "BUCKETSERVE_CPU_AFFINITY"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first < 0 or last < first:
            raise ValueError(part)
        out.update(range(first, last + 1))
    return out


def plan(value: str | None = None, available: set[int] | None = None, device: str = "cpu"
         ) -> tuple[set[int], set[int]] | None:
    """(engine cores, front-end cores) for the layout named by `value` (default: $ENV) of an
    engine on `device`, or None when nothing is to be pinned. Raises ValueError on a
    malformed value."""
    value = (os.environ.get(ENV, "off") if value is None else value).strip().lower()
    if value in ("", "off", "0", "none"):
        return None
    avail = sorted(available if available is not None else os.sched_getaffinity(0))
    if value == "auto":
        if device != "cpu":
            return None
        if len(avail) < 2:
            return None
        return set(avail[:-1]), {avail[-1]}
    engine, sep, front = value.partition("/")
    try:
        e, f = _cpus(engine), _cpus(front)
    except ValueError:
        e = f = set()
    if not sep or not e or not f:
        raise ValueError(f"{ENV}={value!r}: expected off, auto or ENGINE/FRONTEND core lists "
                         "such as 0/1")
    return e, f


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def apply_engine_layout(device: str = "cpu") -> int | None:
    """In the engine core process, before the model runs: pin it; returns its number of
    cores (the compute threads of a CPU plan whose threads are "auto"), or None when nothing
    was pinned."""
    layout = plan(device=device)
    if layout is None:
        return None
    engine, _ = layout
    pin_process(engine)
    log.info("CPU layout: engine core on cores %s", sorted(engine))
    return len(engine)


def apply_frontend_layout(device: str = "cpu") -> None:
    """In a front-end process, once the engine core process runs: pin the front end."""
    layout = plan(device=device)
    if layout is None:
        return
    _, front = layout
    pin_process(front)
    log.info("CPU layout: front end on cores %s", sorted(front))
