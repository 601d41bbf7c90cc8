r"""Training progress: a rich bar in terminals and Jupyter, plain lines in logs.

The bar counts dispatched steps, which the host knows without asking the
devices, so it never waits for them; the loss and metrics it shows are the
latest checkpoint's interval means. Only process 0 shows it.
"""

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

BAR_REFRESH_SECONDS = 0.25
LINE_REFRESH_SECONDS = 30.0


class ProgressReport:
    r"""Progress of a training loop, updated cheaply from the step loop.

    >>> import io
    >>> lines = Console(file=io.StringIO(), force_terminal=False, width=200)   # a log file
    >>> report = ProgressReport(lines)
    >>> report.start(step=0, total=1000)
    >>> report.advance(10)                        # every step; throttled
    >>> report.checkpoint(100, loss=0.12, metrics={"accuracy": 0.9})  # at every checkpoint
    >>> report.stop()
    >>> lines.file.getvalue().split(" · ")[0], lines.file.getvalue().split(" · ")[-1]
    ('step 100/1000', 'loss 0.12 accuracy 0.9\n')
    """

    def __init__(self, console: Console, notice: Callable[[], str] | None = None) -> None:
        self._console = console
        self._notice = notice or (lambda: "")
        self._live = console.is_terminal or console.is_jupyter
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._total: int | None = None
        self._loss: float | None = None
        self._metrics: dict[str, float] = {}
        self._started_at = 0.0
        self._started_step = 0
        self._next_refresh = 0.0

    @property
    def live(self) -> bool:
        r"""whether the report draws a bar (a terminal, Jupyter), not lines."""
        return self._live

    @property
    def active(self) -> bool:
        r"""whether the report is showing."""
        return self._task is not None or (not self._live and self._started_at > 0)

    def start(self, step: int, total: int | None) -> None:
        r"""Starts showing progress from `step` towards `total` (None: unknown)."""
        self._total = total if total and total > step else None
        self._started_at = time.perf_counter()
        self._started_step = step
        self._next_refresh = self._started_at + self._interval()
        if self._live:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                _Remaining(self._notice),
                TextColumn("{task.fields[loss]}"),
                _Notice(self._notice),
                console=self._console,
                refresh_per_second=4,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                "train", total=self._total, completed=step, rate="", loss=self._loss_text()
            )

    def _interval(self) -> float:
        return BAR_REFRESH_SECONDS if self._live else LINE_REFRESH_SECONDS

    def _loss_text(self) -> str:
        if self._loss is None:
            return ""
        shown = {"loss": self._loss, **self._metrics}
        return " ".join(f"{name} {value:.4g}" for name, value in shown.items())

    def _rate(self, step: int, now: float) -> float:
        elapsed = now - self._started_at
        return (step - self._started_step) / elapsed if elapsed > 0 else 0.0

    def advance(self, step: int) -> None:
        r"""Notes that `step` was dispatched; refreshes at most every interval."""
        now = time.perf_counter()
        if now >= self._next_refresh:
            self._next_refresh = now + self._interval()
            self._show(step, now)

    def checkpoint(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        r"""Shows the latest checkpoint's step, loss and metrics (the loss
        function's, such as accuracy)."""
        self._loss, self._metrics = loss, dict(metrics or {})
        self._show(step, time.perf_counter(), line=True)

    def _show(self, step: int, now: float, line: bool = False) -> None:
        rate = self._rate(step, now)
        if self._bar is not None and self._task is not None:
            self._bar.update(
                self._task, completed=step, rate=f"{rate:,.1f} steps/s", loss=self._loss_text()
            )
            return
        if self._live:
            return
        parts = [f"step {step}" + (f"/{self._total}" if self._total else "")]
        parts.append(f"{rate:,.1f} steps/s")
        parts.append(f"{timedelta(seconds=round(now - self._started_at))} elapsed")
        if self._total and rate > 0:
            parts.append(f"ETA {timedelta(seconds=round((self._total - step) / rate))}")
        if self._loss is not None:
            parts.append(self._loss_text())
        self._console.print(" · ".join(parts), highlight=False)

    def rendered(self) -> dict[str, str]:
        r"""The bar's columns as it renders them now, by the column's kind
        (`"notice"`, `"remaining"`, ...); `{}` while no bar shows."""
        if self._bar is None or self._task is None:
            return {}
        task = self._bar.tasks[0]
        names = {_Notice: "notice", _Remaining: "remaining"}
        return {
            names.get(type(column), type(column).__name__): _plain(column.render(task))
            for column in self._bar.columns
            if not isinstance(column, str)
        }

    def stop(self) -> None:
        r"""Stops showing progress (the bar stays on screen)."""
        if self._bar is not None:
            self._bar.stop()
        self._bar, self._task, self._started_at = None, None, 0.0


class _Notice(ProgressColumn):
    r"""The stop request, shown in the bar's line as soon as it is made
    (the bar redraws on its own thread)."""

    def __init__(self, notice: Callable[[], str]) -> None:
        super().__init__()
        self._notice = notice

    def render(self, task: Task) -> Text:
        return Text(self._notice(), style="bold yellow")


class _Remaining(TimeRemainingColumn):
    r"""The time remaining, blank once a stop was requested (the run will not
    reach its total)."""

    def __init__(self, notice: Callable[[], str]) -> None:
        super().__init__()
        self._notice = notice

    def render(self, task: Task) -> Text:
        if self._notice():
            return Text("")
        return super().render(task)


def _plain(rendered: Any) -> str:
    return rendered.plain if isinstance(rendered, Text) else str(rendered)
