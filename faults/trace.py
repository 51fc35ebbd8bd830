"""Node-availability traces: finding a bundled or user trace and reading it.

A trace is a CSV file without a header, one event a line: ``delta_ms,add|remove,name``, where ``delta_ms`` counts
milliseconds from the trace's start and lines with the same time happen together. The bundled traces (``traces/``,
see its README for their source and licence) come from the Oobleck artifact. How a trace becomes fault events for a
cluster of a given size is the schedule's business (``faults.schedules``); this module only checks that the file
describes a possible history: times never go backwards, a node is added only while absent and removed only while
present.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Literal, cast

TraceAction = Literal["add", "remove"]

# Short names for the bundled files, as experiments and sweeps spell them (faults.trace=p3).
BUNDLED_TRACES: dict[str, str] = {
    "p3": "p3-trace.csv",
    "g4dn": "g4dn-trace.csv",
    "scale_p3": "scale_p3-trace.csv",
    "scale_gcp": "scale_gcp-trace.csv",
    **{name: f"{name}.csv" for name in ("5m", "10m", "30m", "1h", "3h", "6h")},
}


class TraceError(ValueError):
    """A trace that cannot be found or read; the message names the file and, for bad content, the line."""


@dataclass(frozen=True)
class TraceRecord:
    time_ms: int
    action: TraceAction
    node: str


def read_trace(trace: str) -> list[TraceRecord]:
    """Read a bundled trace by short name, or any trace file by path (a bundled name wins over a same-named path)."""
    if trace in BUNDLED_TRACES:
        # importlib.resources rather than __file__, so the bundled traces are found in an installed wheel too.
        return parse_trace(files(__package__).joinpath("traces", BUNDLED_TRACES[trace]).read_text(), source=trace)
    path = Path(trace).expanduser()
    if not path.is_file():
        raise TraceError(
            f"trace file {str(path.resolve())!r} does not exist; give an existing CSV path or one of the bundled "
            f"traces: {', '.join(BUNDLED_TRACES)}"
        )
    return parse_trace(path.read_text(), source=str(path))


def parse_trace(text: str, source: str) -> list[TraceRecord]:
    """Parse trace text; ``source`` names it in error messages."""
    records: list[TraceRecord] = []
    present: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"trace {source}, line {lineno} ({line.strip()!r})"
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit() or fields[1] not in ("add", "remove") or not fields[2]:
            raise TraceError(f"{where}: expected 'delta_ms,add|remove,nodeN' with delta_ms a whole number of ms")
        record = TraceRecord(int(fields[0]), cast(TraceAction, fields[1]), fields[2])
        if records and record.time_ms < records[-1].time_ms:
            raise TraceError(f"{where}: time goes back from {records[-1].time_ms} ms; sort the lines by time")
        if record.action == "add" and record.node in present:
            raise TraceError(f"{where}: {record.node} is added while already present; remove it first")
        if record.action == "remove" and record.node not in present:
            raise TraceError(f"{where}: {record.node} is removed while absent; add it first")
        if record.action == "add":
            present.add(record.node)
        else:
            present.remove(record.node)
        records.append(record)
    if not records:
        raise TraceError(f"trace {source} has no events; it must start with the 'add' lines of its initial nodes")
    return records
