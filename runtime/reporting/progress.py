"""The live progress line: step, loss, samples/s, alive nodes, and the latest fault-tolerance event.

On a terminal it is a rich progress bar redrawn in place; elsewhere (CI logs, pipes) one plain line every few
steps, so logs stay readable. It follows the job's event stream.

A simulated step computes no loss, and its times are on the simulator's clock: after ``on_simulated_clock`` the line
shows the simulated time reached instead of a loss, and its samples/s are simulated ones.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ftlab.runtime.control import events as ev


class ProgressLine:
    def __init__(self, total_steps: int, enabled: bool = True, plain_every: int = 10) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.console = Console(file=sys.stderr)
        self.live = enabled and self.console.is_terminal
        self.plain_every = plain_every
        self.note = ""
        self.simulated = False
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, status="starting workers")
            self._progress.start()

    def on_simulated_clock(self) -> None:
        """The job is simulated: its steps carry no loss and its event times are simulated seconds from its start."""
        self.simulated = True

    def __call__(self, event: ev.Event) -> None:
        match event:
            case ev.StepCommitted():
                self.update(event.step, self.step_status(event))
            case ev.FailureDetected():
                self.announce(f"failure: nodes {list(event.nodes)} workers {list(event.workers)} at step {event.step}")
            case ev.HangDetected():
                self.announce(f"worker {event.worker} hung: fenced")
            case ev.CommErrorFenced():
                self.announce(f"worker {event.worker} failed with no death to explain it: fenced ({event.error})")
            case ev.NodesJoined():
                self.announce(f"nodes {list(event.nodes)} joined")
            case ev.Decided(outcome=outcome) if outcome != "keep":
                self.announce(f"{outcome}: {event.reason}")
            case ev.Reviewed(outcome=outcome) if outcome != "keep":
                self.announce(f"review, {outcome}: {event.reason}")
            case ev.SaveFailed():
                self.announce(f"warning: the checkpoint of step {event.step} was not saved: {event.reason}")
            case ev.Recovered(recover_s=seconds, lost_steps=lost) if seconds is not None:
                self.announce(f"recovered in {seconds:.2f} s, {lost} committed steps lost")

    def step_status(self, step: ev.StepCommitted) -> str:
        """What a committed step shows: its loss, or for a simulated one the simulated time it ended at."""
        first = f"{_clock(step.at)} simulated" if self.simulated else f"loss {step.loss:.4f}"
        return f"{first} | {step.samples / step.iter_s:6.1f} samples/s | {step.alive_nodes} nodes alive"

    def update(self, step: int, status: str) -> None:
        if self.note:
            status += f" | {self.note}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, status=status)
        elif self.enabled and ((step + 1) % self.plain_every == 0 or step + 1 == self.total):
            self.console.print(f"step {step + 1}/{self.total} | {status}", highlight=False)

    def announce(self, text: str) -> None:
        """A fault-tolerance event: shown on its own line and kept on the progress line until the next one."""
        self.note = text
        if self.enabled:
            self.console.print(f"[yellow]{text}[/yellow]" if self.live else text, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _clock(seconds: float) -> str:
    """A simulated time: in milliseconds' detail under a minute (a small model's steps on a GPU profile take a few
    each), else as hours:minutes:seconds, hours past a day kept as hours (a simulated job may run for weeks)."""
    if seconds < 60:
        return f"{seconds:.3f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
