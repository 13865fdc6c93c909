"""The embedding encoder's cost table: predicted seconds of one batch per (bucket length, rows).

Pure logic, no clock and no device: the batcher feeds it (`observe`) the measured time of its
warm-up batches at start-up and of every live batch (launch to vectors on the host), and the
queue asks it (`predict`) how long a batch it is holding back would take.

- A cell is one shape: (bucket length L, rows computed B; on CUDA B is the graph size the batch
  ran at). Its value is an exponentially weighted moving average of the measured seconds
  (weight `alpha` on the newest batch; the first batch sets it), so the table follows a device
  whose speed drifts (other load on the CPU, clocks, an LLM sharing the GPU).
- A shape never measured is predicted by a non-negative least-squares fit over the measured
  cells of  cost = a + b * B * L + c * B * L^2  (a fixed cost per batch, the per-token work of
  the dense layers, the attention), weighted by 1 / value^2 so that small and large batches
  are fitted to the same relative error. With fewer than three cells, the nearest measured
  shape (in tokens) scaled up by the token ratio (never down: a conservative guess).
- Nothing measured: 0.0 (the queue then waits until the deadline itself).

`recent_max()` is the longest of the last few batches: a batch that has just started cannot
be interrupted, so a bucket whose start comes meanwhile waits for it (embedding_queue.py
point 7 plans with it).
"""

from __future__ import annotations

import itertools
import math
from collections import deque

# Coefficient subsets tried for the fit, all three first; the best fit whose coefficients are
# all >= 0 wins (a negative fixed cost or attention term predicts nonsense off the grid).
_TERMS = [s for k in (3, 2, 1) for s in itertools.combinations(range(3), k)]


def _features(length: int, rows: int) -> tuple[float, float, float]:
    tokens = float(rows * length)
    return 1.0, tokens, tokens * length


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (n <= 3); None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


class CostTable:
    def __init__(self, alpha: float = 0.2, recent: int = 8) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha {alpha} is not in (0, 1]")
        self.alpha = alpha
        self._recent: deque[float] = deque(maxlen=recent)  # the last batches' seconds
        self.cells: dict[tuple[int, int], float] = {}  # (L, B) -> seconds (EWMA)
        self.samples: dict[tuple[int, int], int] = {}  # (L, B) -> batches observed
        self._coef: tuple[float, float, float] | None = None
        self._dirty = False

    def observe(self, length: int, rows: int, seconds: float) -> None:
        """One measured batch of `rows` x `length` took `seconds`."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        key = (length, rows)
        old = self.cells.get(key)
        self._recent.append(seconds)
        self.cells[key] = seconds if old is None else old + self.alpha * (seconds - old)
        self.samples[key] = self.samples.get(key, 0) + 1
        self._dirty = True

    def recent_max(self) -> float:
        """The longest of the last batches observed (seconds; 0.0 before any)."""
        return max(self._recent, default=0.0)

    def predict(self, length: int, rows: int) -> float:
        """Predicted seconds of a batch of `rows` x `length` (see the module docstring)."""
        exact = self.cells.get((length, rows))
        if exact is not None:
            return exact
        if not self.cells:
            return 0.0
        if len(self.cells) < 3:
            return self._scaled_nearest(length, rows)
        if self._dirty:
            self._coef = self._fit()
            self._dirty = False
        if self._coef is None:
            return self._scaled_nearest(length, rows)
        return sum(c * x for c, x in zip(self._coef, _features(length, rows), strict=True))

    def _scaled_nearest(self, length: int, rows: int) -> float:
        tokens = rows * length
        (cl, cr), value = min(self.cells.items(),
                              key=lambda kv: (abs(kv[0][0] * kv[0][1] - tokens), kv[0]))
        return value * max(1.0, tokens / (cl * cr))

    def _fit(self) -> tuple[float, float, float] | None:
        """Weighted least squares of the cells on the chosen terms, non-negative (_TERMS)."""
        points = [(_features(*key), value) for key, value in self.cells.items() if value > 0]
        # columns scaled to at most 1: token counts squared would swamp the constant term
        scale = [max(x[i] for x, _ in points) or 1.0 for i in range(3)] if points else []
        points = [(tuple(xi / si for xi, si in zip(x, scale, strict=True)), y) for x, y in points]
        best: tuple[float, tuple[float, float, float]] | None = None
        for terms in _TERMS:
            if len(points) < len(terms):
                continue
            m = [[0.0] * len(terms) for _ in terms]
            v = [0.0] * len(terms)
            for x, y in points:
                w = 1.0 / (y * y)
                for i, ti in enumerate(terms):
                    v[i] += w * x[ti] * y
                    for j, tj in enumerate(terms):
                        m[i][j] += w * x[ti] * x[tj]
            sol = _solve(m, v)
            if sol is None or min(sol) < 0:
                continue
            coef = [0.0, 0.0, 0.0]
            for t, c in zip(terms, sol, strict=True):
                coef[t] = c
            err = sum((sum(c * xi for c, xi in zip(coef, x, strict=True)) / y - 1.0) ** 2
                      for x, y in points)
            if best is None or err < best[0] - 1e-12:
                best = (err, (coef[0] / scale[0], coef[1] / scale[1], coef[2] / scale[2]))
        return None if best is None else best[1]
