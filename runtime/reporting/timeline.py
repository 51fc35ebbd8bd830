"""``timeline.png``: throughput over wall time, each fault and each recovery marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402


def throughput_curve(steps: list[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """(start, end, samples/s) of each step -> a curve that holds each step's rate over its own interval and drops
    to zero wherever no step ran (detection, recovery, restarts), so an outage shows as the gap it was."""
    times: list[float] = []
    rates: list[float] = []
    for start, end, rate in sorted(steps):
        if times and start > times[-1]:
            times += [times[-1], start]
            rates += [0.0, 0.0]
        times += [start, end]
        rates += [rate, rate]
    return times, rates


def merge_steps(steps: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Adjacent steps at the same rate as one interval: the same curve, fewer points (a simulated day)."""
    merged: list[tuple[float, float, float]] = []
    for start, end, rate in sorted(steps):
        if merged and merged[-1][1] == start and merged[-1][2] == rate:
            merged[-1] = (merged[-1][0], end, rate)
        else:
            merged.append((start, end, rate))
    return merged


def plot_timeline(
    steps: list[tuple[float, float, float]], faults_s: list[float], recoveries_s: list[float], path: Path, title: str
) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(*throughput_curve(steps), linewidth=1, label="samples/s")
    for i, t in enumerate(faults_s):
        ax.axvline(t, color="tab:red", linestyle="--", linewidth=1, label="fault" if i == 0 else None)
    for i, t in enumerate(recoveries_s):
        ax.axvline(t, color="tab:green", linestyle=":", linewidth=1.5, label="recovered" if i == 0 else None)
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
