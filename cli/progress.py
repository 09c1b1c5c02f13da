"""Progress of a long command (`kdtr gen`, `kdtr distill`): progress(stage, done, total, info) calls, shown
as one rich bar per stage on a terminal, and as plain lines anywhere else (a log file, a pipe, CI), where
rich would draw nothing until the end: the log can be read while the run goes on."""
from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def stage_progress(console: Console):
    """A progress(stage, done, total, info) callback for the duration of the block; `info` is a loss."""
    if not console.is_terminal:
        yield _Lines(console)
        return
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"))
    with Progress(*cols, console=console, transient=False) as bar:
        tasks = {}

        def update(stage, done, total, info):
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total, info="")
            bar.update(tasks[stage], completed=done, info="" if info is None else f"loss {info:.3f}")
        yield update


class _Lines:
    """A line when a stage is first reported, at each further tenth of it or after LINE_EVERY seconds, and
    at its end: `  12.3 s  train: 4/20  loss 6.018`, the time since the command started."""
    LINE_EVERY = 10.0

    def __init__(self, console: Console):
        self.console, self.t0, self.last = console, time.monotonic(), {}   # stage -> (time, tenth) last shown

    def __call__(self, stage, done, total, info):
        now, tenth = time.monotonic(), (10 * done // total if total else 10)
        at, was = self.last.get(stage, (None, -1))
        if at is not None and done < total and tenth <= was and now - at < self.LINE_EVERY:
            return
        self.last[stage] = (now, tenth)
        state = "done" if done >= total else ("started" if at is None and done == 0 else "")
        line = f"{now - self.t0:8.1f} s  {stage}: {done}/{total}" + (f" {state}" if state else "")
        if info is not None:
            line += f"  loss {info:.3f}"
        self.console.print(line, soft_wrap=True, markup=False, highlight=False)
