r"""Where a run's time goes: compiling, waiting for data, the devices'
steps, and the caller's own code between checkpoints.

The loop's thread is always doing one of these, and the loop notes the
time at the edges between them (two clock reads a dispatch, no wait for
the devices added): from the checkpoint it hands out to the next one,

- `caller`: the caller's loop body (evaluation, writing, logging), until
  it asks for the next checkpoint;
- `data`: waiting for the next batch (reading, checking, stacking and
  placing it, when no read-ahead thread has it ready);
- `compile`: compiling a step, or waiting for one compiling in the
  background;
- `device`: dispatching the steps and waiting for the devices to finish
  them (their results, the checkpoint's copy).

They add up to `wall`, the interval's wall time; `device / wall` is the
*goodput*. The devices run ahead of the loop's thread, so a device kept busy
by queued steps while the thread waits for a slow batch shows that wait as
`data`: the figures say what held the loop up.

>>> times = TimeBreakdown(setup=2.0, compile=1.5, handed_out=10.0)
>>> times.close(started=10.5, ended=14.0, data=0.25, device=3.25, compiled=0.25)
{'compile': 0.25, 'data': 0.25, 'device': 3.0, 'caller': 0.5, 'wall': 4.0}
>>> times.totals()["wall"], goodput(times.totals())
(6.0, 0.5)
"""

import time
from typing import Any

PARTS = ("compile", "data", "device", "caller")
r"""The parts an interval's wall time is made of."""


class TimeBreakdown:
    r"""The run's time by part: set-up, then each interval's added.

    Args:
        setup: seconds the loop's set-up took (initialization, restoring,
            compiling the first step).
        compile: those of them spent compiling.
        handed_out: when the caller's code started running (the end of
            set-up; `time.perf_counter()`, now by default).
    """

    def __init__(
        self, setup: float = 0.0, compile: float = 0.0, handed_out: float | None = None
    ) -> None:
        self._handed_out = time.perf_counter() if handed_out is None else handed_out
        self._totals = {
            "setup": max(setup - compile, 0.0),
            "compile": compile,
            "data": 0.0,
            "device": 0.0,
            "caller": 0.0,
            "wall": setup,
        }

    def close(
        self, started: float, ended: float, data: float, device: float, compiled: float
    ) -> dict[str, float]:
        r"""Adds an interval and returns its seconds by part.

        Args:
            started: when the loop was asked for the interval (the caller's
                code ran from the previous checkpoint until then).
            ended: when its checkpoint was ready (handed out to the caller).
            data: seconds the loop waited for batches.
            device: seconds it dispatched steps and waited for the devices,
                `compiled` included.
            compiled: seconds it compiled, or waited for a compilation.
        """
        interval = {
            "compile": compiled,
            "data": data,
            "device": max(device - compiled, 0.0),
            "caller": started - self._handed_out,
            "wall": ended - self._handed_out,
        }
        self._handed_out = ended
        for part, value in interval.items():
            self._totals[part] += value
        return interval

    def totals(self) -> dict[str, float]:
        r"""The run's seconds so far: `setup` (without its compiling), the
        `PARTS` and `wall`."""
        return dict(self._totals)


def goodput(breakdown: dict[str, Any]) -> float:
    r"""The fraction of the wall time the devices' steps took (`device / wall`)."""
    wall = float(breakdown.get("wall", 0.0))
    return float(breakdown.get("device", 0.0)) / wall if wall > 0 else float("nan")


def done_line(step: int, totals: dict[str, Any]) -> str:
    r"""The closing line of a run trained to its last step: where the time went."""
    return f"{step:,} steps in {float(totals['wall']):.1f} s: {describe(totals)}."


def describe(breakdown: dict[str, Any]) -> str:
    r"""One line of where the time went, as shares of the wall time.

    >>> describe({"setup": 1, "compile": 1, "data": 0, "device": 7, "caller": 1, "wall": 10})
    'device 70%, setup 10%, compile 10%, your code 10%, data 0%'
    """
    wall = float(breakdown.get("wall", 0.0))
    if wall <= 0:
        return "no time measured"
    names = {"caller": "your code"}
    shares = sorted(
        ((part, float(value) / wall) for part, value in breakdown.items() if part != "wall"),
        key=lambda item: -item[1],
    )
    return ", ".join(f"{names.get(part, part)} {share:.0%}" for part, share in shares)
