"""Bucket arithmetic: which padded shape a length uses, compiled-backend profiles, padding waste.

A BucketSpec wraps strictly increasing boundaries b_0 < b_1 < ... < b_k. Length n uses bucket
i = the smallest boundary >= n, and is padded to b_i. Bucket i covers lengths b_{i-1}+1 .. b_i
(1 .. b_0 for the first), which is exactly the (min, opt, max) dynamic-shape profile a compiled
backend builds for it: opt = max = b_i because every input in the bucket is padded to b_i.
The same arithmetic rounds a decode batch up to the next CUDA Graph capture size.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence


class BucketSpec:
    """Strictly increasing positive boundaries; lookups are O(log k)."""

    __slots__ = ("boundaries",)

    def __init__(self, boundaries: Iterable[int]) -> None:
        bounds = tuple(boundaries)
        if not bounds:
            raise ValueError("BucketSpec needs at least one boundary")
        for i, b in enumerate(bounds):
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"boundaries must be positive integers, got {b!r} at {i}")
            if i and b <= bounds[i - 1]:
                raise ValueError(f"boundaries must be strictly increasing, got {bounds}")
        self.boundaries: tuple[int, ...] = bounds

    @property
    def max_len(self) -> int:
        """The last (largest) boundary."""
        return self.boundaries[-1]

    def index(self, n: int) -> int | None:
        """Index of the smallest boundary >= n, or None when n exceeds the last boundary."""
        if n < 0:
            raise ValueError(f"length must be >= 0, got {n}")
        i = bisect_left(self.boundaries, n)
        return i if i < len(self.boundaries) else None

    def lookup(self, n: int) -> int | None:
        """The smallest boundary >= n, or None when n exceeds the last boundary."""
        i = self.index(n)
        return None if i is None else self.boundaries[i]

    def padded_len(self, n: int) -> int:
        """Length n is computed at: its bucket, or n itself above the last boundary (there the
        input runs unpadded on the eager path)."""
        b = self.lookup(n)
        return n if b is None else b

    def profile(self, i: int) -> tuple[int, int, int]:
        """(min, opt, max) dynamic-shape profile of bucket i: (previous boundary + 1, or 1 for
        the first; boundary; boundary)."""
        if not 0 <= i < len(self.boundaries):
            raise IndexError(f"bucket index {i} out of range 0..{len(self.boundaries) - 1}")
        low = self.boundaries[i - 1] + 1 if i else 1
        b = self.boundaries[i]
        return (low, b, b)

    def profiles(self) -> list[tuple[int, int, int]]:
        """All profiles in order; they tile 1..max_len without gaps or overlap."""
        return [self.profile(i) for i in range(len(self.boundaries))]

    def __iter__(self) -> Iterator[int]:
        return iter(self.boundaries)

    def __len__(self) -> int:
        return len(self.boundaries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketSpec) and other.boundaries == self.boundaries

    def __hash__(self) -> int:
        return hash(self.boundaries)

    def __repr__(self) -> str:
        return f"BucketSpec({list(self.boundaries)})"


def round_up_batch_size(n: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size >= n, or None above the largest one (the batch then
    runs eagerly). batch_sizes must be strictly increasing. (The embedding encoder's CUDA
    graphs and its queue use it.)"""
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    i = bisect_left(batch_sizes, n)
    return batch_sizes[i] if i < len(batch_sizes) else None


class PaddingCounter:
    """Running totals of computed vs useful tokens; waste = 1 - useful / computed."""

    __slots__ = ("computed", "useful")

    def __init__(self) -> None:
        self.computed = 0
        self.useful = 0

    def add(self, computed: int, useful: int) -> None:
        """Record one batch: `computed` token slots run (padded), `useful` of them real."""
        if useful < 0 or computed < useful:
            raise ValueError(f"need 0 <= useful <= computed, got useful={useful}, "
                             f"computed={computed}")
        self.computed += computed
        self.useful += useful

    @property
    def waste(self) -> float:
        """Fraction of computed tokens that were padding; 0.0 before anything was computed."""
        return 1.0 - self.useful / self.computed if self.computed else 0.0

    def reset(self) -> None:
        self.computed = 0
        self.useful = 0

    def __repr__(self) -> str:
        return (f"PaddingCounter(computed={self.computed}, useful={self.useful}, "
                f"waste={self.waste:.4f})")
