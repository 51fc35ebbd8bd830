"""``docs/results.md``, written by the benchmarks themselves (``--write-docs``), so its figures are regenerated,
never pasted.

Each bench owns named sections of the file, each between two marker comments::

    <!-- bench_planner -->
    ## Planner timings against the published ones
    ...its tables...
    Regenerate: `python -m ftlab.experiments.bench_planner --write-docs` (commit 1a2b3c4, a host of 2 CPUs)
    <!-- /bench_planner -->

``write_section`` replaces a section's text between its markers and leaves every other section as it is (or
appends the section where the file has none yet), so benches run at different times, on different hosts, fill one
file. Each section says the command that produced it and the commit it ran at: a figure is as good as the command
that regenerates it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results.md"
HEADER = """# Results

Every section below is written by the benchmark it names (`--write-docs`), with the command that regenerates it and
the commit it ran at; nothing here is pasted by hand. A section that says only how to regenerate it has not been run
yet. What each benchmark compares, and how, is in its module docstring under `experiments/`; how the simulator is
validated is in [simulator.md](simulator.md).
"""


def write_section(
    name: str, title: str, tables: Mapping[str, Any] | str, argv: Sequence[str] | None = None, *,
    module: str | None = None, note: str = "", path: Path = RESULTS,
) -> None:  # fmt: skip
    """Replace section ``name`` of ``path`` (``docs/results.md``), or append it, with ``title``, ``tables`` and the
    command that produced them: ``python -m ftlab.experiments.<module or name>`` with ``argv`` (default: this
    process's arguments).

    ``tables`` is markdown text, or a mapping of a caption ("" for none) to a table: markdown text, a sequence of
    rows (dicts: their scalar values are the columns), a mapping of a label to a row (the label is the first
    column), or a mapping of a figure's name to its value (a two-column table)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "-m", f"ftlab.experiments.{module or name}", *arguments])
    parts = [f"## {title}", ""]
    for caption, table in ({"": tables} if isinstance(tables, str) else tables).items():
        if caption:
            parts += [caption, ""]
        parts += [(table if isinstance(table, str) else markdown_table(table)).strip(), ""]
    if note:
        parts += [note, ""]
    changed = " with uncommitted changes" if uncommitted() else ""
    parts.append(f"Regenerate: `{command}` (commit {commit()}{changed}, a host of {os.cpu_count()} CPUs)")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else HEADER
    path.write_text(replace_section(text, name, "\n".join(parts)))
    print(f"wrote section {name} of {path}", flush=True)


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name``'s body (between its markers) replaced by ``body``, or the section appended."""
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    section = f"{begin}\n{body.strip()}\n{end}"
    found = re.search(re.escape(begin) + r".*?" + re.escape(end), text, flags=re.S)
    if found:
        return text[: found.start()] + section + text[found.end() :]
    return text.rstrip("\n") + "\n\n" + section + "\n"


def markdown_table(table: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> str:
    """A markdown table of rows (see ``write_section``); nested values (dicts, lists of dicts) are left out."""
    if isinstance(table, Mapping):
        if all(isinstance(v, Mapping) for v in table.values()):
            rows = [{"": label, **row} for label, row in table.items()]
        else:
            rows = [{"figure": key, "value": value} for key, value in table.items() if _scalar(value)]
    else:
        rows = [dict(row) for row in table]
    columns = list(dict.fromkeys(k for row in rows for k, v in row.items() if _scalar(v)))
    if not columns:
        return "(no figures)"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def commit() -> str:
    """The short hash of the checkout's HEAD; ``FTLAB_COMMIT`` where the tree is a copy without git (a GPU machine
    lent for one run); "unknown" otherwise."""
    if os.environ.get("FTLAB_COMMIT"):
        return os.environ["FTLAB_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def uncommitted() -> bool:
    """Whether tracked files of the checkout other than the results files (``docs/results*.md``, which the benches
    write as they go) differ from its HEAD (the figures ran on code no commit holds)."""
    results = RESULTS.relative_to(REPO).with_name("results*.md")
    try:
        out = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", ".",
                              f":(exclude,glob){results}"], capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def _scalar(value: Any) -> bool:  # noqa: ANN401
    if isinstance(value, (list, tuple)):
        return all(v is None or isinstance(v, (str, int, float)) for v in value)
    return value is None or isinstance(value, (str, int, float))


def _cell(value: Any) -> str:  # noqa: ANN401
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return " / ".join(_cell(v) for v in value)
    return str(value).splitlines()[0].replace("|", "\\|") if str(value) else ""
