r"""Preemption: SIGTERM or SIGINT asks the loop to stop with a last checkpoint.

While a loop iterates (its body included), the signals set a flag instead
of killing the process; the loop then finishes the step in flight, yields a
last checkpoint marked `preempted` (which the caller's usual processing
writes to disk) and stops. A request that arrives while the caller's body
runs ends the iteration when the body is done: the checkpoint it had was
the last, and no step trains after it. A second SIGINT raises
`KeyboardInterrupt` at once (a second SIGTERM, its previous handling). The
original handlers come back as soon as the loop stops iterating.

A stop ends the process's training, not only the loop's: once a loop has
stopped for a signal, every loop of the process trains no further step
(`process_stop`), so that a script of several loops ends when its
scheduler asks, until `clear_stop()`. A Ctrl-C in a notebook or at the
interpreter's prompt ends only the call it came in.

While the loop runs its steps (`defer`), the second SIGINT's
`KeyboardInterrupt` is raised by the loop itself, at the next point where
its state is whole (between steps, or while it waits for a compilation),
so that no batch is lost and the loop stays usable; if the loop does not
get there within `DEFER_SECONDS`, it is raised wherever the program is.
"""

import _thread
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from flax_loop.checkpoint.format import WRITTEN
from flax_loop.log import log

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def resume_hint() -> str:
    r"""Where a run again resumes from: the newest checkpoint this process
    wrote, or, when it wrote none, that a run again starts afresh.

    >>> WRITTEN.clear()
    >>> resume_hint().startswith("No checkpoint was written")
    True
    """
    if WRITTEN:
        return f"Run again to resume from the last checkpoint written ({WRITTEN[0]})."
    return (
        "No checkpoint was written, so a run again starts afresh: write checkpoints "
        "(CheckpointFileWriter in the loop's body) to resume from them."
    )


def at_once() -> str:
    r"""The closing line of a second Ctrl-C outside the loop's steps."""
    return (
        "stopped at once by a second Ctrl-C: the steps since the last checkpoint written "
        f"are in no file. {resume_hint()}"
    )


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
        self.quiet = False
        r"""set while a progress bar shows the request (`notice`): the handler
        then writes nothing into the bar's line."""
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
        r"""Restores the handlers that were there before `install` (nothing
        at interpreter exit, when a loop's iterator held to the end is
        finalized: the process is ending, and the signal module may be gone)."""
        previous, self._previous = self._previous, {}
        if sys.is_finalizing() or not callable(getattr(signal, "signal", None)):
            return
        for number, handler in previous.items():
            signal.signal(number, handler)

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
                raise quiet_interrupt(KeyboardInterrupt(), at_once())
            signal.raise_signal(number)
            return
        self.requested, self.signal = True, number
        if not self.quiet:
            # os.write, not print: a signal handler may interrupt a print.
            os.write(2, f"flax_loop: {self.notice()}.\n".encode())

    def notice(self) -> str:
        r"""What a stop request does, for the console; `""` when none was made.

        >>> guard = PreemptionGuard()
        >>> guard.notice(), guard._handle(signal.SIGTERM, None), guard.notice()
        ('', None, 'stopping after this step (SIGTERM received)')
        """
        if not self.requested or self.signal is None:
            return ""
        what = (
            "press Ctrl-C again to stop at once"
            if self.signal == signal.SIGINT
            else f"{signal.Signals(self.signal).name} received"
        )
        return f"stopping after this step ({what})"

    def short_notice(self) -> str:
        r"""`notice` short enough for a progress bar's line; `""` when none.

        >>> guard = PreemptionGuard()
        >>> guard._handle(signal.SIGINT, None), guard.short_notice()
        (None, 'stopping (Ctrl-C: stop now)')
        """
        if not self.requested or self.signal is None:
            return ""
        if self.signal == signal.SIGINT:
            return "stopping (Ctrl-C: stop now)"
        return f"stopping: {signal.Signals(self.signal).name}"

    @property
    def name(self) -> str:
        r"""the signal that asked for the stop, as a user knows it (`Ctrl-C`)."""
        if self.signal is None:
            return ""
        return "Ctrl-C" if self.signal == signal.SIGINT else signal.Signals(self.signal).name


_PROCESS_STOP: list[str] = []
r"""The stop by signal a loop of this process honoured, as said on the console
("SIGTERM at step 1,000"); empty while none (or since `clear_stop`)."""


def note_process_stop(number: int | None, description: str) -> None:
    r"""A loop stopped for signal `number` (`None`: another process's):
    later loops of the process train no step. A Ctrl-C at an interactive
    prompt (a notebook, the interpreter's) ends only its call."""
    if number == signal.SIGINT and _interactive():
        return
    _PROCESS_STOP[:] = [description]


def process_stop() -> str | None:
    r"""The stop this process was asked for, once a loop honoured it, else `None`."""
    return _PROCESS_STOP[0] if _PROCESS_STOP else None


def refused_after_stop(stdout: bool) -> bool:
    r"""Whether a stop by signal ended the process's training (then said)."""
    stopped = process_stop()
    if stopped is not None:
        log(
            f"not training: this process was asked to stop ({stopped}), and a loop "
            "stopped for it. Call flax_loop.clear_stop() before this loop to train anyway.",
            stdout,
            lead="Stopped:",
            style="bold yellow",
        )
    return stopped is not None


def clear_stop() -> None:
    r"""Lets the process's loops train again after a stop by signal.

    After a loop stopped for SIGTERM (a scheduler's request) or a Ctrl-C in
    a script, every later loop of the process trains no step, says why, and
    the script ends. Call this to train on anyway (say, to run a short
    evaluation loop before exiting).

    >>> clear_stop()
    """
    _PROCESS_STOP.clear()


def _interactive() -> bool:
    r"""Whether Python runs at an interactive prompt or in a notebook's kernel."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None


def quiet_interrupt(error: KeyboardInterrupt, message: str) -> KeyboardInterrupt:
    r"""Makes `error` end the program with `message` instead of a traceback.

    A `KeyboardInterrupt` the user asked for (a second Ctrl-C, Ctrl-C during
    set-up) is not a bug: uncaught, it prints `flax_loop: <message>` and
    `KeyboardInterrupt`, and the process exits as Python's would (status
    130 on POSIX shells). Caught, it is an ordinary `KeyboardInterrupt`.
    """
    error.flax_loop_message = message  # type: ignore[attr-defined]
    previous = sys.excepthook
    if not getattr(previous, "_flax_loop_interrupts", False):

        def hook(kind: Any, value: Any, traceback: Any) -> None:
            message = getattr(value, "flax_loop_message", None)
            if kind is KeyboardInterrupt and message is not None:
                sys.stderr.write(f"flax_loop: {message}\nKeyboardInterrupt\n")
                sys.stderr.flush()
                return
            previous(kind, value, traceback)

        hook._flax_loop_interrupts = True  # type: ignore[attr-defined]
        sys.excepthook = hook
    return error
