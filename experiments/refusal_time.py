"""How long ``ftlab`` takes to refuse a bad input: until its message is printed, and until it exits (the FAILED run
recorded after the message). Each input runs ``--rounds`` times in a fresh process on a fresh store; the medians are
printed, one line per input.

    .venv/bin/python -m ftlab.experiments.refusal_time --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INPUTS = (
    ("a batch that does not split", ["train.global_batch=15"]),
    ("an unknown model", ["model=no-such-model"]),
    ("a bad protection setting", ["protection=storage", "protection.every=0"]),
)


def refuse_once(overrides: list[str], folder: Path) -> tuple[float, float]:
    """Seconds from the start of ``ftlab`` to its first line on stderr, and to its exit."""
    command = [sys.executable, "-m", "ftlab.experiments.main", "experiment=plain", "progress=false",
               f"tracking.uri=sqlite:///{folder}/mlflow.db", f"hydra.run.dir={folder}/hydra", *overrides]  # fmt: skip
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=folder)
    assert process.stderr is not None
    first_line = process.stderr.readline()
    said = time.perf_counter() - began
    rest = process.stderr.read()
    if process.wait() != 1:
        raise SystemExit(f"ftlab {' '.join(overrides)} was not refused: {first_line}{rest}")
    return said, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name, overrides in INPUTS:
        times = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="ftlab-refusal-") as folder:
                times.append(refuse_once(overrides, Path(folder)))
        said = statistics.median(t[0] for t in times)
        ended = statistics.median(t[1] for t in times)
        print(f"{name} ({' '.join(overrides)}): message after {said:.2f} s, exit after {ended:.2f} s "
              f"(medians of {args.rounds})")  # fmt: skip


if __name__ == "__main__":
    main()
