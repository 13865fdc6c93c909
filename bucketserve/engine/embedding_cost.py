"""The embedding encoder's cost table: predicted seconds of one batch per (bucket length, rows).

Pure logic, no clock and no device: the batcher feeds it (`observe`) the measured time of its
warm-up batches at start-up and of every live batch (launch to vectors on the host), and the
queue asks it (`predict`) how long a batch it is holding back would take.

- A cell is one shape: (bucket length L, rows computed B; on CUDA B is the graph size the batch
  ran at). Its value is an exponentially weighted moving average of the measured seconds
  (weight `alpha` on the newest batch; the first batch sets it), so the table follows a device
  whose speed drifts (other load on the CPU, clocks, an LLM sharing the GPU).
- A shape never measured is predicted by a non-negative least-squares fit over the measured
  cells of  cost = a + b * T + c * T * L + d * T^2  with T = B * L tokens (a fixed cost per
  batch, the per-token work of the dense layers, the attention, and per-token work that grows
  with the batch: on a 2-core Xeon an L=184 MiniLM forward cost 89 us a token at 4 rows and
  105 at 32, its activations no longer in cache), weighted by 1 / value^2 so that small and
  large batches are fitted to the same relative error. With fewer than three cells, the nearest measured
  shape (in tokens) scaled up by the token ratio (never down: a conservative guess).
- Nothing measured: 0.0 (the queue then waits until the deadline itself).
- Live batches (`observe(..., inputs=n)`) also teach a per-input *excess*: an exponentially
  weighted average of (measured seconds - the start-up model's prediction for that shape) /
  inputs, at least 0. It is the host work per input that the start-up batches, timed alone on
  an idle process, did not pay: on a GPU the worker's own launch / collect / answer work per
  input and the GIL it shares with the HTTP front end, which at a few thousand inputs a second
  cost more than the device (H200, all-MiniLM-L6-v2: about 0.4 ms an input at 1,000 texts/s,
  0.8 at 2,000, against a 0.5 ms graph replay of a whole batch). A shape some live batch ran
  at is predicted by its own cell (which then holds that work); any other shape by the
  start-up model plus excess x inputs, so a full batch never measured live is not predicted
  at the idle process's cost. With no start-up cells the excess stays 0 (nothing to compare
  with) and every cell is used as above. The excess is kept per bucket length (used once
  EXCESS_MIN_BATCHES of its batches ran) and over all buckets (used before): on a CPU under
  other load it grows with the length; on a GPU's host path it is about the same for all.
- The fit over the start-up cells is redone whenever one changes (start-up only); the fit
  over all cells (used when there are no start-up cells) at most every REFIT_EVERY
  observations, since live cells change with every batch and the queue predicts on every pop.

`recent_max()` is the longest of the last few batches: a batch that has just started cannot
be interrupted, so a bucket whose start comes meanwhile waits for it (embedding_queue.py
point 7 plans with it).
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np

# Coefficient subsets tried for the fit, all four first; the best fit whose coefficients are
# all >= 0 wins (a negative fixed cost or attention term predicts nonsense off the grid).
NUM_TERMS = 4
_TERMS = [s for k in range(NUM_TERMS, 0, -1) for s in itertools.combinations(range(NUM_TERMS), k)]
# A bucket's own excess per input is used once this many of its live batches ran.
EXCESS_MIN_BATCHES = 3
# The fit over all cells (live ones included) is redone after this many observations.
REFIT_EVERY = 16


def _features(length: int, rows: int) -> tuple[float, ...]:
    tokens = float(rows * length)
    return 1.0, tokens, tokens * length, tokens * tokens


class CostTable:
    def __init__(self, alpha: float = 0.2, recent: int = 8) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha {alpha} is not in (0, 1]")
        self.alpha = alpha
        self._recent: deque[float] = deque(maxlen=recent)  # the last batches' seconds
        self.cells: dict[tuple[int, int], float] = {}  # (L, B) -> seconds (EWMA)
        self.live: set[tuple[int, int]] = set()  # shapes some live batch ran at
        self._start: dict[tuple[int, int], float] = {}  # start-up cells (observe without inputs)
        # L -> (seconds per input live batches of bucket L paid above the start-up model,
        # batches); L = 0: over every bucket
        self._excess: dict[int, tuple[float, int]] = {}
        # per set of cells (True: the start-up ones, False: all): its fit, and observations
        # of it since that fit
        self._coef: dict[bool, tuple[float, ...] | None] = {}
        self._since_fit = {True: 0, False: 0}
        self.version = 0  # observations so far (the queue recomputes what it derived from us)

    def observe(self, length: int, rows: int, seconds: float, inputs: int | None = None) -> None:
        """One measured batch of `rows` x `length` took `seconds`. inputs: the real inputs of
        a live batch (None: a start-up measurement)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        key = (length, rows)
        self.version += 1
        if inputs is not None and inputs > 0 and self._start:
            sample = max(0.0, seconds - self._predict_from(self._start, True, length, rows))
            for k in (0, length):  # the first batches average plainly, then the EWMA
                value, count = self._excess.get(k, (0.0, 0))
                step = max(self.alpha, 1.0 / (count + 1)) * (sample / inputs - value)
                self._excess[k] = (value + step, count + 1)
        if inputs is None:
            self._average(self._start, key, seconds)
            self._since_fit[True] += 1
        elif key not in self.live:  # a live cell starts from live batches alone
            self.live.add(key)
            self.cells.pop(key, None)
        self._average(self.cells, key, seconds)
        self._since_fit[False] += 1
        self._recent.append(seconds)

    def _average(self, cells: dict[tuple[int, int], float], key: tuple[int, int],
                 seconds: float) -> None:
        old = cells.get(key)
        cells[key] = seconds if old is None else old + self.alpha * (seconds - old)

    @property
    def excess_s(self) -> float:
        """Seconds per input live batches paid above the start-up model, over every bucket."""
        return self._excess.get(0, (0.0, 0))[0]

    def excess(self, length: int) -> float:
        """Seconds per input live batches of bucket `length` paid above the start-up model:
        this bucket's own average once EXCESS_MIN_BATCHES of its batches ran, else every
        bucket's (on a CPU under other load the excess grows with the length, on a GPU's
        host path it is about the same for every length)."""
        value, count = self._excess.get(length, (0.0, 0))
        return value if count >= EXCESS_MIN_BATCHES else self.excess_s

    def recent_max(self) -> float:
        """The longest of the last batches observed (seconds; 0.0 before any)."""
        return max(self._recent, default=0.0)

    def predict(self, length: int, rows: int, inputs: int | None = None) -> float:
        """Predicted seconds of a batch of `rows` x `length` holding `inputs` real inputs
        (None: rows) (see the module docstring)."""
        key = (length, rows)
        if key in self.live or not self._start:
            return self._predict_from(self.cells, False, length, rows)
        return (self._predict_from(self._start, True, length, rows)
                + self.excess(length) * (rows if inputs is None else inputs))

    def _predict_from(self, cells: dict[tuple[int, int], float], start: bool, length: int,
                      rows: int) -> float:
        exact = cells.get((length, rows))
        if exact is not None:
            return exact
        if not cells:
            return 0.0
        coef = None
        if len(cells) >= 3:
            # the start-up cells change at start-up only: refit after any change; the live
            # cells change with every batch: refit every REFIT_EVERY observations
            stale = self._since_fit[start]
            if stale and (start or self._coef.get(start) is None or stale >= REFIT_EVERY):
                self._coef[start] = self._fit(cells)
                self._since_fit[start] = 0
            coef = self._coef.get(start)
        if coef is None:
            return self._scaled_nearest(cells, length, rows)
        return sum(c * x for c, x in zip(coef, _features(length, rows), strict=True))

    @staticmethod
    def _scaled_nearest(cells: dict[tuple[int, int], float], length: int, rows: int) -> float:
        tokens = rows * length
        (cl, cr), value = min(cells.items(),
                              key=lambda kv: (abs(kv[0][0] * kv[0][1] - tokens), kv[0]))
        return value * max(1.0, tokens / (cl * cr))

    @staticmethod
    def _fit(cells: dict[tuple[int, int], float]) -> tuple[float, ...] | None:
        """Least squares of the cells, relative error weighted, over each subset of the terms
        (_TERMS); the best fit with every coefficient >= 0, or None."""
        keys = [k for k, v in cells.items() if v > 0]
        if not keys:
            return None
        x = np.array([_features(*k) for k in keys])
        y = np.array([cells[k] for k in keys])
        scale = x.max(axis=0)  # columns to at most 1: tokens squared would swamp the constant
        x = x / scale / y[:, None]  # each row divided by its value: relative errors
        best: tuple[float, tuple[float, ...]] | None = None
        for terms in _TERMS:
            if len(keys) < len(terms):
                continue
            cols = list(terms)
            sol, _, rank, _ = np.linalg.lstsq(x[:, cols], np.ones(len(keys)), rcond=None)
            if rank < len(cols) or sol.min() < 0:  # collinear terms, or a negative one
                continue
            coef = np.zeros(NUM_TERMS)
            coef[cols] = sol
            err = float(((x @ coef - 1.0) ** 2).sum())
            if best is None or err < best[0] - 1e-12:
                best = (err, tuple((coef / scale).tolist()))
        return None if best is None else best[1]
