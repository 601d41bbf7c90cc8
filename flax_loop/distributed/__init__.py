r"""Several processes, one loop: agreement and failure across processes.

flax_loop adds no launcher or transport of its own: processes are started by
the user or a launcher (`mpirun`, `srun`) and joined with
`jax.distributed.initialize` (`initialize_processes` finds the coordinator
under Open MPI 5 as well); this module makes them agree on values and fail
together.

If one process raises a flax_loop error, the others would wait for it in
their next collective forever. So the failing process posts its error to
`jax.distributed`'s key-value store, and a watcher thread in every other
process ends that process with the same message within about a second.
A process that dies without a word (SIGKILL, the out-of-memory killer)
stops beating: the watchers beat in the store every 0.25 s, and a peer
silent for `SILENT_SECONDS` ends the others, named, within a few seconds
(`jax.distributed` alone would abort them after ~100 s, saying nothing).
A process that ends normally, or is ended because another failed, says so
first, and is not waited for. A process that failed keeps watching while it
ends: if a peer goes silent then (an Orbax write or JAX's shutdown would
wait for it ~100 s, then abort), it exits at once, naming the peer. An
error of JAX's runtime (a collective cut off: "connection closed by peer")
is often a peer's death seen first: the process waits `SILENT_SECONDS` for
the watcher to name a silent peer, or for another process's error, before
it reports its own. (One killed in the middle of a collective makes gloo
abort its peers at once, with gloo's own message: nothing in Python runs
then.)

A process that fails exits with status 1 as Python's uncaught exception
does, not killed by `jax.distributed`'s shutdown (which aborts a process
whose peers have gone).
"""

import atexit
import os
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from flax_loop.errors import FlaxLoopError

_ERROR_KEY = "flax_loop/error"
_ALIVE = "flax_loop/alive/"
_DONE = "flax_loop/done/"
EXIT_CODE = 70
r"""The exit status of a process ended because another process failed."""

SILENT_SECONDS = 5.0
r"""How long a peer may go without beating before it is taken for dead."""

_failed = False  # this process raised an exception that ends it
_reported = False  # this process reported an error: the others are stopping


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
    global _reported
    client = _client() if is_multiprocess() else None
    if client is None:
        return
    if isinstance(error, jax.errors.JaxRuntimeError) and _watcher is not None:
        _wait_for_a_cause(client)
    _follow_earlier_failure(client)
    _reported = True
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
    _note_uncaught()


def others_are_stopping() -> bool:
    r"""Whether this process reported an error to the others (they stop, so
    nothing that needs all processes, such as a pending Orbax write, can
    finish)."""
    return _reported


def _wait_for_a_cause(client: Any) -> None:
    r"""Gives the watcher the time it takes to find a peer gone silent (it then
    ends this process naming that peer), or another process's error (then
    followed), before this process's runtime error is reported as the cause:
    a collective cut off by a peer's death fails here at once."""
    deadline = time.monotonic() + SILENT_SECONDS + 1
    while time.monotonic() < deadline:
        _follow_earlier_failure(client)
        time.sleep(0.25)


def _follow_earlier_failure(client: Any) -> None:
    r"""Ends this process as its watcher would if another process failed
    first: this process's error (a collective cut off as the failed process
    left) is then a consequence, and the first failure is the one named."""
    try:
        first = client.key_value_try_get(_ERROR_KEY)
    except Exception:  # none posted
        return
    process, _, text = str(first).partition(":")
    me = str(jax.process_index())
    if process == me:
        return
    if me == "0" and _watcher is not None:  # it holds the coordination service
        _watcher.wait_for_end(client, me, process)
    _stop_this_process(f"process {process} failed, so process {me} stops too: {text}")


def _note_uncaught() -> None:
    r"""Notes when the error ends the program uncaught, so that the process
    exits with status 1 before `jax.distributed`'s shutdown can abort it."""
    previous = sys.excepthook
    if getattr(previous, "_flax_loop", False):
        return

    def hook(*args: Any) -> None:
        global _failed
        _failed = True
        previous(*args)

    hook._flax_loop = True  # type: ignore[attr-defined]
    sys.excepthook = hook


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
        beats: dict[str, tuple[str, float]] = {}  # each peer's last beat, and when it changed
        beat = 0
        while not self._stop.is_set():
            beat += 1
            silent = self._check_peers(client, me, str(beat), beats)
            if silent is not None:
                _stop_this_process(
                    f"process {silent} stopped answering (killed, or out of memory: "
                    f"no word from it for {SILENT_SECONDS:g} s), so process {me} stops too."
                )
            try:
                message = client.blocking_key_value_get(_ERROR_KEY, self._poll_ms)
            except Exception:
                # No error posted yet (a timeout), or the client is shutting down.
                self._stop.wait(0.05)
                continue
            process, _, text = str(message).partition(":")
            if self._stop.is_set():
                return
            if process == me:
                # This process failed: it goes on beating until it exits, so
                # that process 0 waits for it instead of taking it for dead
                # while its traceback is printed and its threads end.
                self._beat_until_stopped(client, me, beat, beats)
                return
            if me == "0":
                # This process holds the coordination service: leaving before the
                # failed one has ended would make jax.distributed abort it.
                self.wait_for_end(client, me, process, beats)
            _stop_this_process(f"process {process} failed, so process {me} stops too: {text}")

    def _beat_until_stopped(
        self, client: Any, me: str, beat: int, beats: dict[str, tuple[str, float]]
    ) -> None:
        while not self._stop.wait(self._poll_ms / 1000):
            beat += 1
            silent = self._check_peers(client, me, str(beat), beats)
            if silent is not None:
                # What this process still waits for as it ends (a pending
                # Orbax write, JAX's shutdown) waits for the silent peer too.
                _stop_this_process(
                    f"process {silent} stopped answering (no word from it for "
                    f"{SILENT_SECONDS:g} s) while process {me} was ending after its error; "
                    f"process {me} exits now rather than wait for it.",
                    status=1,
                )

    @staticmethod
    def _check_peers(
        client: Any, me: str, beat: str, beats: dict[str, tuple[str, float]]
    ) -> str | None:
        r"""Beats, and returns a peer that has been silent too long, if any."""
        try:
            client.key_value_set(_ALIVE + me, beat, allow_overwrite=True)
            alive = dict(client.key_value_dir_get(_ALIVE))
            done = {key.rpartition("/")[2] for key, _ in client.key_value_dir_get(_DONE)}
        except Exception:  # the client is shutting down
            return None
        now = time.monotonic()
        for key, value in alive.items():
            peer = key.rpartition("/")[2]
            if peer == me or peer in done:
                continue
            last = beats.get(peer)
            if last is None or last[0] != value:
                beats[peer] = (value, now)
            elif now - last[1] > SILENT_SECONDS:
                return peer
        return None

    def wait_for_end(
        self,
        client: Any,
        me: str,
        process: str,
        beats: dict[str, tuple[str, float]] | None = None,
    ) -> None:
        r"""Waits until `process` says it ends, goes silent, or a minute passes
        (its exit may first wait for its threads: a compilation, a write)."""
        beats = {} if beats is None else beats
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                client.blocking_key_value_get(_DONE + process, self._poll_ms)
                return
            except Exception:  # not yet
                pass
            if self._check_peers(client, me, str(time.monotonic()), beats) == process:
                return

    def say_done(self) -> None:
        r"""Tells the other processes that this one ends normally."""
        client = _client() if self._thread is not None else None
        if client is not None:
            try:
                client.key_value_set(_DONE + str(jax.process_index()), "1", allow_overwrite=True)
            except Exception:
                pass


def _stop_this_process(why: str, status: int = EXIT_CODE) -> None:
    sys.stderr.write(f"flax_loop: {why}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    client = _client()
    if client is not None:  # an end the others need not wait for, nor take for a death
        try:
            client.key_value_set(_DONE + str(jax.process_index()), "1", allow_overwrite=True)
        except Exception:  # the client is shutting down
            pass
    # This process may be blocked in a collective that will never complete;
    # only leaving the process ends it.
    os._exit(status)


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
    if _failed:  # an uncaught error: exit as Python would, before jax.distributed aborts
        sys.stdout.flush()
        sys.stderr.flush()
        # Said last, right before leaving: process 0 ends when it reads it,
        # and a process that outlives the coordination service is aborted.
        if _watcher is not None:
            _watcher.say_done()
        os._exit(1)
    if _watcher is not None:
        _watcher.say_done()
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


# what the package's other modules define, reachable here as before
from flax_loop.distributed.agreement import agree_on_structure  # noqa: E402
from flax_loop.distributed.launch import INITIALIZATION_TIMEOUT, initialize_processes  # noqa: E402

__all__ = [
    "EXIT_CODE",
    "INITIALIZATION_TIMEOUT",
    "SILENT_SECONDS",
    "FailureWatcher",
    "agree",
    "agree_on_structure",
    "failing_together",
    "gather",
    "gather_objects",
    "initialize_processes",
    "is_multiprocess",
    "others_are_stopping",
    "report_error",
]
