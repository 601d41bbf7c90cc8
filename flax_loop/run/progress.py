r"""Training progress: a rich bar in terminals, plain lines in logs.

The bar counts dispatched steps, which the host knows without asking the
devices, so it never waits for them. Its loss is live: the loss of the
newest dispatch the devices have finished (an array already computed, read
at most 4 times a second; never one still running). Plain lines show the
latest checkpoint's interval means. Only process 0 shows either.
"""

import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table
from rich.text import Text

BAR_REFRESH_SECONDS = 0.25
LINE_REFRESH_SECONDS = 30.0
RECENT = 16
r"""The newest dispatches' losses the bar keeps, to find a finished one."""


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
    ('step 100/1,000', 'loss 0.12 accuracy 0.9\n')
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
        self._recent: deque[tuple[int, Any]] = deque(maxlen=RECENT)
        self._live_loss: tuple[int, float] | None = None
        # the finished losses read this interval (one a refresh, at most)
        self._sampled_step, self._sampled_sum, self._sampled_count = -1, 0.0, 0

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
            self._recent.clear()
            self._bar = _Fitted(
                _Steps(),
                BarColumn(bar_width=8),
                _text("{task.fields[loss]}"),
                _text("{task.fields[rate]}"),
                _Elapsed(self._notice),
                _Remaining(self._notice),
                _Notice(self._notice),
                console=self._console,
                refresh_per_second=4,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                "train", total=self._total, completed=step, rate="", loss="", elapsed=""
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

    def advance(self, step: int, loss: Any = None) -> None:
        r"""Notes that the dispatch up to `step` was made (`loss`: its loss,
        an array the devices compute); refreshes at most every interval."""
        if loss is not None and self._live:
            self._recent.append((step, loss))
        now = time.perf_counter()
        if now >= self._next_refresh:
            self._next_refresh = now + self._interval()
            self._show(step, now)

    def checkpoint(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        r"""Shows the latest checkpoint's step, loss and metrics (the loss
        function's, such as accuracy)."""
        self._loss, self._metrics = loss, dict(metrics or {})
        self._sampled_sum, self._sampled_count = 0.0, 0  # the next interval's mean
        self._show(step, time.perf_counter(), line=True)

    def _finished_loss(self) -> tuple[int, float] | None:
        r"""The step and loss of the newest dispatch the devices have finished
        (the last one read when none has finished since); never waits."""
        for step, loss in reversed(self._recent):
            if _ready(loss):
                self._live_loss = (step, _last_value(loss))
                while self._recent and self._recent[0][0] <= step:  # read: not needed
                    self._recent.popleft()
                break
        return self._live_loss

    def _show(self, step: int, now: float, line: bool = False) -> None:
        rate = self._rate(step, now)
        if self._bar is not None and self._task is not None:
            live = self._finished_loss()
            if live is not None and live[0] != self._sampled_step:  # a newer step read
                self._sampled_step = live[0]
                self._sampled_sum, self._sampled_count = (
                    self._sampled_sum + live[1],
                    self._sampled_count + 1,
                )
            # the mean of the interval's losses read so far: steadier than one step's
            mean = self._sampled_sum / self._sampled_count if self._sampled_count else None
            loss = f"loss {mean:.4g}" if mean is not None else ""
            self._bar.update(
                self._task,
                completed=step,
                rate=f"{rate:,.0f} steps/s" if rate >= 100 else f"{rate:.3g} steps/s",
                loss=loss,
                elapsed=f"elapsed {timedelta(seconds=round(now - self._started_at))}",
            )
            return
        if self._live:
            return
        parts = [f"step {step:,}" + (f"/{self._total:,}" if self._total else "")]
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


class _Fitted(Progress):
    r"""The bar's line, its least important fields left out when the
    terminal is too narrow for all: a line that wraps leaves a stale copy of
    itself at each redraw. By importance: a stop's notice, the steps, the
    loss, the speed, the time remaining, the time elapsed, the bar."""

    _RANK = (1, 6, 2, 3, 5, 4, 0)  # of each column, in the order they show

    def make_tasks_table(self, tasks: Any) -> Table:
        if len(tasks) != 1:
            return super().make_tasks_table(tasks)
        (task,) = tasks
        console, options = self.console, self.console.options
        cells = [column(task) for column in self.columns]  # type: ignore[operator]
        widths = [Measurement.get(console, options, cell).maximum for cell in cells]
        # 3 columns spare: a Ctrl-C the terminal echoes (^C) must not wrap it
        room, chosen = console.width - 3, set[int]()
        for index in sorted(range(len(cells)), key=lambda i: self._RANK[i]):
            if widths[index] and sum(widths[i] + 1 for i in chosen) + widths[index] <= room:
                chosen.add(index)
        table = Table.grid(padding=(0, 1))
        shown = [cells[i] for i in sorted(chosen)]
        for _ in shown:
            table.add_column(no_wrap=True)
        table.add_row(*shown)
        return table


def _text(template: str) -> TextColumn:
    return TextColumn(template, table_column=Column(no_wrap=True))


def _ready(array: Any) -> bool:
    ready = getattr(array, "is_ready", None)
    return ready() if ready is not None else True


def _last_value(array: Any) -> float:
    r"""The last element of a finished loss array (one step's scalar, or the
    steps of one dispatch), as a float: a copy of a computed value."""
    if not getattr(array, "is_fully_addressable", True):  # several processes
        array = array.addressable_data(0)
    return float(np.asarray(array).reshape(-1)[-1])


class _Steps(ProgressColumn):
    r"""`2,000/10,000`: the steps dispatched of the total, thousands grouped."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        done = int(task.completed)
        total = f"/{int(task.total):,}" if task.total is not None else ""
        return Text(f"{done:,}{total}")


class _Noticing(ProgressColumn):
    r"""A column of one line that reads the stop notice as it renders."""

    def __init__(self, notice: Callable[[], str]) -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self._notice = notice


class _Elapsed(_Noticing):
    r"""`elapsed 0:01:02`, blank once a stop was requested (room for the notice)."""

    def render(self, task: Task) -> Text:
        return Text("" if self._notice() else task.fields.get("elapsed", ""))


class _Notice(_Noticing):
    r"""The stop request, shown in the bar's line as soon as it is made
    (the bar redraws on its own thread)."""

    def render(self, task: Task) -> Text:
        return Text(self._notice(), style="bold yellow")


class _Remaining(TimeRemainingColumn):
    r"""The time remaining, blank once a stop was requested (the run will not
    reach its total)."""

    def __init__(self, notice: Callable[[], str]) -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self._notice = notice

    def render(self, task: Task) -> Text:
        if self._notice() or task.total is None:
            return Text("")
        remaining = super().render(task)
        return Text(f"ETA {remaining.plain}", style=remaining.style)


def _plain(rendered: Any) -> str:
    return rendered.plain if isinstance(rendered, Text) else str(rendered)


class SetUpStatus:
    r"""What set-up is doing, said as it happens: in a terminal, one line
    that each phase replaces ("flax_loop: compiling the step") and that
    goes when set-up ends; nothing elsewhere (the set-up lines that follow
    say what it did).

    >>> import io
    >>> status = SetUpStatus(Console(file=io.StringIO()))   # no terminal: silent
    >>> status("compiling the step"); status.stop()
    """

    def __init__(self, console: Console, shown: bool = True) -> None:
        self._status = None
        if shown and console.is_terminal and not console.is_jupyter:
            self._status = console.status("flax_loop: setting up", spinner="line")
            self._status.start()

    def __call__(self, what: str) -> None:
        if self._status is not None:
            self._status.update(f"flax_loop: {what}")

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
