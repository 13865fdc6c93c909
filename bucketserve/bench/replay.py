"""How faithfully a replay reproduces a recorded arrival pattern: inter-arrival gap statistics."""

from __future__ import annotations

import numpy as np


def ks_statistic(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    if not a or not b:
        raise ValueError("both samples need values")
    xa, xb = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    grid = np.concatenate([xa, xb])
    fa = np.searchsorted(xa, grid, side="right") / len(xa)
    fb = np.searchsorted(xb, grid, side="right") / len(xb)
    return float(np.max(np.abs(fa - fb)))


def ks_critical(n: int, m: int, alpha: float = 0.01) -> float:
    """The asymptotic critical value of the two-sample KS statistic at level alpha."""
    c = np.sqrt(-0.5 * np.log(alpha / 2.0))
    return float(c * np.sqrt((n + m) / (n * m)))


def compare_gaps(recorded: list[float], replayed: list[float]) -> dict:
    """Summary of two inter-arrival gap samples (seconds)."""
    def q(xs: list[float]) -> dict:
        arr = np.asarray(xs)
        return {"n": len(xs), "mean_s": float(arr.mean()), "p50_s": float(np.median(arr)),
                "p90_s": float(np.percentile(arr, 90)), "total_s": float(arr.sum())}

    return {"recorded": q(recorded), "replayed": q(replayed),
            "ks": ks_statistic(recorded, replayed),
            "ks_critical_1pct": ks_critical(len(recorded), len(replayed)),
            "mean_abs_gap_diff_s": float(np.mean(np.abs(np.asarray(recorded[:len(replayed)])
                                                        - np.asarray(replayed[:len(recorded)]))))}


def plot_gaps(a: list[float], b: list[float], path: str, label_a: str, label_b: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    hi = max(max(a), max(b))
    lo = max(min(min(a), min(b)), 1e-4)
    bins = np.geomspace(lo, hi, 30)
    axes[0].hist([np.clip(a, lo, None), np.clip(b, lo, None)], bins=bins,
                 label=[f"{label_a} ({len(a)})", f"{label_b} ({len(b)})"])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("inter-arrival gap (s)")
    axes[0].set_ylabel("gaps")
    axes[0].set_title("Inter-arrival histogram")
    axes[0].legend(fontsize=8)
    for xs, label in ((a, label_a), (b, label_b)):
        s = np.sort(xs)
        axes[1].plot(s, np.arange(1, len(s) + 1) / len(s), label=label)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("inter-arrival gap (s)")
    axes[1].set_ylabel("fraction of gaps <= x")
    axes[1].set_title(f"CDF; KS statistic {ks_statistic(a, b):.3f}")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
