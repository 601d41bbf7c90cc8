r"""Several processes, one loop: agreement and failure across processes.

flax_loop adds no launcher or transport of its own: processes are started by
the user (or a cluster manager) and joined with `jax.distributed.initialize`;
this module only makes them agree on values and fail together.

If one process raises a flax_loop error, the others would wait for it in
their next collective forever. So the failing process posts its error to
`jax.distributed`'s key-value store, and a watcher thread in every other
process ends that process with the same message within about a second.
"""

import atexit
import os
import sys
import threading
from typing import Any

import jax
import numpy as np

from flax_loop.errors import FlaxLoopError

_ERROR_KEY = "flax_loop/error"
EXIT_CODE = 70
r"""The exit status of a process ended because another process failed."""


def is_multiprocess() -> bool:
    r"""Whether this run spans several processes."""
    return jax.process_count() > 1


def _client() -> Any:
    try:
        from jax._src.distributed import global_state
    except ImportError:  # pragma: no cover - a JAX without the module
        return None
    return global_state.client


def agree(name: str, value: int) -> int:
    r"""Checks that every process holds the same integer `value`.

    Raises:
        FlaxLoopError: naming each process's value, on every process.
    """
    values = gather(value)
    if len(set(values)) != 1:
        raise FlaxLoopError(
            f"The processes disagree on {name}: {dict(enumerate(values))} "
            "(by process index). Give every process the same arguments and the same "
            "shared checkpoint directory."
        )
    return value


def gather(value: int) -> list[int]:
    r"""Every process's integer `value`, in process order."""
    if not is_multiprocess():
        return [value]
    from jax.experimental import multihost_utils

    values = multihost_utils.process_allgather(np.asarray(value, np.int64))
    return [int(v) for v in np.asarray(values).reshape(-1)]


def report_error(error: BaseException) -> None:
    r"""Posts this process's error for the other processes' watchers."""
    client = _client() if is_multiprocess() else None
    if client is None:
        return
    text = f"{type(error).__name__}: {error}"
    # Said here first: once the others stop, jax.distributed may abort this
    # process (its coordinator is gone) before the traceback is printed.
    sys.stderr.write(f"flax_loop: process {jax.process_index()} failed: {text}\n")
    sys.stderr.flush()
    message = f"{jax.process_index()}:{text}"
    try:
        client.key_value_set(_ERROR_KEY, message)
    except Exception:  # already set by another process: theirs is reported
        pass


class FailureWatcher:
    r"""Ends this process when another process reports an error.

    >>> with FailureWatcher():     # one process: nothing to watch
    ...     jax.process_count()        # with several, a failure elsewhere ends this one
    1
    """

    def __init__(self, poll_seconds: float = 0.25) -> None:
        self._poll_ms = int(poll_seconds * 1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "FailureWatcher":
        client = _client() if is_multiprocess() else None
        if client is not None:
            self._thread = threading.Thread(
                target=self._watch, args=(client,), name="flax_loop-watcher", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            # The thread must leave its blocking call before jax.distributed
            # shuts its client down, or the process aborts at exit.
            self._thread.join(timeout=10 * self._poll_ms / 1000)

    def _watch(self, client: Any) -> None:
        me = str(jax.process_index())
        while not self._stop.is_set():
            try:
                message = client.blocking_key_value_get(_ERROR_KEY, self._poll_ms)
            except Exception:
                # No error posted yet (a timeout), or the client is shutting down.
                self._stop.wait(0.05)
                continue
            process, _, text = str(message).partition(":")
            if process == me or self._stop.is_set():
                return
            sys.stderr.write(
                f"flax_loop: process {process} failed, so process {me} stops too: {text}\n"
            )
            sys.stderr.flush()
            # This process may be blocked in a collective that will never
            # complete; only leaving the process ends it.
            os._exit(EXIT_CODE)


_watcher: FailureWatcher | None = None
_watcher_lock = threading.Lock()


class failing_together:
    r"""Reports an exception raised inside to the other processes, then re-raises.

    Entering also starts this process's `FailureWatcher` (once), so that a
    failure elsewhere ends this process instead of leaving it in a collective.
    """

    def __enter__(self) -> "failing_together":
        global _watcher
        if is_multiprocess():
            with _watcher_lock:
                if _watcher is None:
                    _watcher = FailureWatcher().__enter__()
                    # Registered now, after jax.distributed.initialize registered
                    # its shutdown, so that it runs first at exit.
                    atexit.register(_stop_watching)
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if isinstance(error, Exception):
            report_error(error)


def _stop_watching() -> None:
    if _watcher is not None:
        _watcher.__exit__()


def gather_objects(name: str, value: Any) -> list[Any]:
    r"""Every process's msgpack-able `value`, in process order.

    Sent through `jax.distributed`'s key-value store under `name`, which must
    be new for each call (e.g. carry the step number).
    """
    if not is_multiprocess():
        return [value]
    import base64

    import msgpack

    client = _client()
    key = f"flax_loop/{name}"
    client.key_value_set(
        f"{key}/{jax.process_index()}",
        base64.b64encode(msgpack.packb(value, use_bin_type=True)).decode(),
    )
    return [
        msgpack.unpackb(base64.b64decode(client.blocking_key_value_get(f"{key}/{index}", 600_000)))
        for index in range(jax.process_count())
    ]
