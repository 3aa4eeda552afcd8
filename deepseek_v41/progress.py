"""Progress of long commands: a live bar on a terminal, a plain line every few seconds in a log.

A long step takes a *progress callback* ``progress(done, total, what="")``: called with the units done so far
(never decreasing), the units in all and what runs now. :class:`Progress` is such a callback that shows it: on a
terminal (the stream is a tty) a rich bar with the step, counts, elapsed and remaining time, cleared when done;
otherwise (a log file, a pipe, CI) one line at the start, one every ``interval`` seconds from a background thread
(also while a single unit runs long) and one at the end, so a log never goes silent. It writes to stderr: stdout
stays the command's output (``--json`` stays valid JSON).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

ProgressCallback = Callable[..., None]  # progress(done: int, total: int, what: str = "")


class Progress:
    """A progress callback shown on ``stream`` (default ``sys.stderr``) as a bar on a terminal and as plain lines
    every ``interval`` seconds (> 0) otherwise; ``terminal`` forces either (None: ``stream.isatty()``). Use as a
    context manager; ``enabled=False`` shows nothing. ``unit`` names what is counted ("tokens", "steps").
    Raises ValueError for a non-positive interval."""

    def __init__(self, description: str, total: int = 0, unit: str = "steps", stream: TextIO | None = None,
                 interval: float = 5.0, terminal: bool | None = None, enabled: bool = True):
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.description, self.unit, self.interval, self.enabled = description, unit, interval, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.done, self.total, self.what = 0, total, ""
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = self._task = None

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        if not self.enabled:
            return self
        if self.terminal:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn(self.unit), TimeElapsedColumn(),
                                     TimeRemainingColumn(), console=Console(file=self.stream), transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total or None)
        else:
            self._line("started")
            self._thread = threading.Thread(target=self._tick, name="dsv41-progress", daemon=True)
            self._thread.start()
        return self

    def __call__(self, done: int, total: int | None = None, what: str = "") -> None:
        """Record ``done`` units of ``total`` (unchanged when None), ``what`` running now."""
        self.done, self.what = done, what
        if total is not None:
            self.total = total
        if self._bar is not None:
            label = f"{self.description}: {what}" if what else self.description
            self._bar.update(self._task, completed=done, total=self.total or None, description=label)

    def __exit__(self, kind, value, traceback) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, value, traceback)
            self._bar = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._line("done" if kind is None else f"stopped ({kind.__name__})")

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._line()

    def _line(self, state: str = "") -> None:
        if state == "started":
            self.stream.write(f"{self.description}: started\n")
            self.stream.flush()
            return
        elapsed = time.monotonic() - self._start
        counts = f"{self.done:,}/{self.total:,} {self.unit}" if self.total else f"{self.done:,} {self.unit}"
        parts = [state, counts] if state else [counts]
        if self.total:
            parts[-1] += f" ({100 * self.done / self.total:.0f}%)"
        parts.append(f"{elapsed:.0f} s")
        if not state and self.total and 0 < self.done < self.total:
            parts.append(f"about {elapsed * (self.total - self.done) / self.done:.0f} s left")
        if self.what and state != "done":
            parts.append(f"now: {self.what}")
        self.stream.write(f"{self.description}: {', '.join(parts)}\n")
        self.stream.flush()
