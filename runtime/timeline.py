"""``timeline.png``: throughput over wall time, each fault and each recovery marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402


def plot_timeline(
    ends_s: list[float], samples_per_s: list[float], faults_s: list[float], recoveries_s: list[float], path: Path, title: str
) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(ends_s, samples_per_s, marker=".", linewidth=1, label="samples/s per step")
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
