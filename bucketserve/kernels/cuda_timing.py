"""Timing a short GPU call the way it runs inside a step: replayed from a CUDA graph."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_us(fn: Callable[[int], object], calls: int = 8, trials: int = 11) -> float:
    """Median microseconds of one fn(i) call: fn(0) .. fn(calls - 1) are captured into one
    CUDA graph (after a warm-up of each on a side stream) and the graph is replayed `trials`
    times. Let fn(i) touch different memory per i (e.g. another layer's weights) so that L2
    does not hold what a real step would read from memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)
