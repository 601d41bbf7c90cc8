r"""Preemption: SIGTERM or SIGINT asks the loop to stop with a last checkpoint.

While a loop iterates (its body included), the signals set a flag instead
of killing the process; the loop then finishes the step in flight, yields a
last checkpoint marked `preempted` (which the caller's usual processing
writes to disk) and stops. A request that arrives while the caller's body
runs is kept: the next iteration yields that checkpoint at once, without
training further. A second SIGINT raises `KeyboardInterrupt` at once (a
second SIGTERM, its previous handling). The original handlers come back as
soon as the loop stops iterating.

While the loop runs its steps (`defer`), the second SIGINT's
`KeyboardInterrupt` is raised by the loop itself, at the next point where
its state is whole (between steps, or while it waits for a compilation),
so that no batch is lost and the loop stays usable; if the loop does not
get there within `DEFER_SECONDS`, it is raised wherever the program is.
"""

import _thread
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)

DEFER_SECONDS = 1.0
r"""How long a deferred `KeyboardInterrupt` waits for the loop to raise it."""


class PreemptionGuard:
    r"""Turns the given signals into a stop request while installed.

    >>> guard = PreemptionGuard([signal.SIGUSR1])
    >>> with guard:
    ...     signal.raise_signal(signal.SIGUSR1)
    ...     guard.requested
    True
    """

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self.signal: int | None = None
        self.defer = False
        r"""set by the loop while a `KeyboardInterrupt` would cut a step in two."""
        self.interrupted = False
        r"""whether a second SIGINT came while deferred: the loop raises it."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "PreemptionGuard":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def install(self) -> None:
        r"""Installs the handlers (only the main thread can; elsewhere a no-op).

        A request made while installed before is kept until `clear`.
        """
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)

    def uninstall(self) -> None:
        r"""Restores the handlers that were there before `install`."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def clear(self) -> None:
        r"""Forgets a stop request (once the loop has stopped for it, or an
        interrupt has ended the call)."""
        self.requested, self.signal, self.interrupted = False, None, False

    def _interrupt_if_pending(self) -> None:
        r"""The loop did not raise a deferred interrupt in time (a read or a
        wait that does not end): raised where the program is."""
        if self.interrupted:
            _thread.interrupt_main(signal.SIGINT)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.requested:
            # A second signal: the user insists; behave as without the guard.
            self.uninstall()
            if number == signal.SIGINT:
                if self.defer:
                    self.interrupted = True
                    threading.Timer(DEFER_SECONDS, self._interrupt_if_pending).start()
                    return
                raise KeyboardInterrupt
            signal.raise_signal(number)
            return
        self.requested, self.signal = True, number
        # os.write, not print: a signal handler may interrupt a print.
        what = (
            "press Ctrl-C again to stop at once"
            if number == signal.SIGINT
            else f"{signal.Signals(number).name} received"
        )
        os.write(2, f"flax_loop: stopping after this step ({what}).\n".encode())
