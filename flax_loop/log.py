r"""Messages to the user: one rich console, printed by process 0 only.

Every module that prints goes through `log`, so output can be redirected in
one place (a notebook, a test, a log file):

>>> import io
>>> from rich.console import Console
>>> previous = set_console(Console(file=io.StringIO(), width=80))
>>> log("Resumed from step 40.")
>>> _ = set_console(previous)
"""

import math
import os
import sys
import threading
from typing import Any

from rich.console import Console
from rich.text import Text

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_console: Console | None = None
_lock = threading.Lock()


def console() -> Console:
    r"""The console flax_loop prints to (a rich `Console` on stdout by default)."""
    global _console
    with _lock:
        if _console is None:
            _console = Console(highlight=False, file=_Stdout())  # type: ignore[arg-type]
        return _console


class _Stdout:
    r"""`sys.stdout` as the default console writes to it: a reader that went
    away (`python train.py | head -1`) ends the output, never the training.
    At the first broken pipe stdout is pointed at the null device, so later
    writes (the interpreter's last flush included) succeed unseen."""

    def write(self, text: str) -> int:
        try:
            return sys.stdout.write(text)
        except BrokenPipeError:
            _silence_stdout()
            return len(text)

    def flush(self) -> None:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(sys.stdout, name)


def _silence_stdout() -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no file descriptor: nothing to point
        pass


def set_console(new: Console | None) -> Console | None:
    r"""Makes flax_loop print to `new` (`None`: a fresh console on stdout).

    Returns:
        the console used before, to put back later.
    """
    global _console
    with _lock:
        previous, _console = _console, new
    return previous


def is_main_process() -> bool:
    r"""Whether this process prints, logs and writes files (process 0)."""
    import jax  # here, so that the command line's listing starts without JAX

    return jax.process_index() == 0


def log(message: str, stdout: bool = True, *, lead: str = "", style: str = "") -> None:
    r"""Prints a message on process 0 when `stdout` is set.

    The message is plain text, printed as it is: a path or a metric name
    holding brackets (`runs/[/lr]`) is never read as rich markup. `lead`, in
    `style` (a rich style such as "yellow"), opens the line.
    """
    if stdout and is_main_process():
        text = Text.assemble((lead, style), " " if lead else "", message)
        console().print(text, soft_wrap=True)  # a path stays on one line


def format_bytes(size: int) -> str:
    r"""A byte count for people.

    >>> format_bytes(1536)
    '1.5 KiB'
    """
    if size < 1024:
        return f"{size} B"
    power = min(int(math.log(size, 1024)), len(_BYTE_UNITS) - 1)
    return f"{size / 1024**power:.1f} {_BYTE_UNITS[power]}"
