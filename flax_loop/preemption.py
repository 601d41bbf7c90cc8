r"""Preemption: SIGTERM or SIGINT asks the loop to stop after the current step.

While a loop trains, the signals set a flag instead of killing the process;
the loop then finishes the step in flight, yields a last checkpoint marked
`preempted` (which the caller's usual processing writes to disk) and stops.
A second signal acts as if flax_loop had not intervened. The original
handlers come back as soon as the loop stops iterating.
"""

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    r"""Turns the given signals into a stop request while installed.

    >>> guard = PreemptionGuard([signal.SIGTERM])
    >>> with guard:
    ...     while not guard.requested:
    ...         train_one_step()
    """

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "PreemptionGuard":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def install(self) -> None:
        r"""Installs the handlers (only the main thread can; elsewhere a no-op)."""
        self.requested, self.signal = False, None
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)

    def uninstall(self) -> None:
        r"""Restores the handlers that were there before `install`."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.requested:
            # A second signal: the user insists; behave as without the guard.
            self.uninstall()
            signal.raise_signal(number)
            return
        self.requested, self.signal = True, number
