r"""Programs compiled once a process: a re-run (a notebook cell run again, a
second `TrainLoop` of the same task) reuses what the first compiled.

A program is keyed by what determines it: the task's functions and
objects by identity (the model's `apply`, the loss, the optimizer, the
transforms, as `jax.jit` keys a function), an NNX model by its graph
definition, the options that shape the step, and the shapes, dtypes and
layouts of everything the program takes. A changed model, loss, optimizer,
shape or device set is another key, and compiles anew. The cache keeps the
newest `MAX_PROGRAMS` programs, and the objects of their keys alive.

>>> import jax.numpy as jnp
>>> built = []
>>> def compile_it():
...     built.append(1)
...     return "program"
>>> key = ("example", signature(jnp.ones(3)))
>>> compiled(key, compile_it), compiled(key, compile_it), len(built)
('program', 'program', 1)
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from flax_loop.step.keys import Identity, identity, signature

__all__ = [
    "Identity",
    "MAX_PROGRAMS",
    "NotCompiled",
    "compiled",
    "found",
    "identity",
    "if_compiled",
    "keep",
    "signature",
]

MAX_PROGRAMS = 64
r"""The compiled programs a process keeps (the newest)."""

_programs: "OrderedDict[Hashable, Any]" = OrderedDict()
_lock = threading.Lock()  # the background compilation thread uses it too

_T = TypeVar("_T")
_refusing = threading.local()  # `if_compiled` on this thread


class NotCompiled(Exception):
    r"""Raised by `compiled` under `if_compiled`, for a program it would compile."""


def compiled(key: Hashable | None, compile: Callable[[], _T]) -> _T:
    r"""The program of `key`, compiled (by `compile()`) once a process;
    `key=None` compiles it every time."""
    if key is not None:
        with _lock:
            found = _programs.get(key)
            if found is not None:
                _programs.move_to_end(key)
                return found
    if getattr(_refusing, "on", False):
        raise NotCompiled(key)
    program = compile()
    if key is None:
        return program
    with _lock:
        _programs[key] = program
        while len(_programs) > MAX_PROGRAMS:
            _programs.popitem(last=False)
    return program


def if_compiled(make: Callable[[], _T]) -> _T | None:
    r"""`make()` where every program it asks `compiled` for is in the cache
    (a re-run's: no thread needed to compile it), else `None`."""
    _refusing.on = True
    try:
        return make()
    except NotCompiled:
        return None
    finally:
        _refusing.on = False


def found(key: Hashable | None) -> Any:
    r"""What `keep(key, ...)` kept (what a program's first trace found out:
    the metrics a step reports, the lowering it needs), or `None`."""
    if key is None:
        return None
    with _lock:
        return _programs.get(("found", key))


def keep(key: Hashable | None, value: Any) -> None:
    r"""Keeps `value` for `found(key)`."""
    if key is not None:
        compiled(("found", key), lambda: value)


def clear() -> None:
    r"""Forgets every program (the next loop compiles its own)."""
    with _lock:
        _programs.clear()
