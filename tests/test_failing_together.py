"""How a process of several ends, tested on its parts with a stand-in for
`jax.distributed`'s key-value store (tests/test_multiprocess.py runs real
processes)."""

import threading
import time

import pytest

import flax_loop.checkpoint._orbax as orbax_writer
import flax_loop.distributed as distributed


class Store:
    """A key-value store as `jax.distributed`'s client offers it."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]


class Stopped(Exception):
    pass


@pytest.fixture
def stops(monkeypatch):
    """What would have ended the process: (why, status)."""
    seen = []

    def stop(why, status=distributed.EXIT_CODE):
        seen.append((why, status))
        raise Stopped

    monkeypatch.setattr(distributed, "_stop_this_process", stop)
    monkeypatch.setattr(distributed, "SILENT_SECONDS", 0.3)
    return seen


def test_a_failed_process_that_outlives_a_silent_peer_exits_naming_it(stops):
    # Process 0 failed and is ending (its pending Orbax write, JAX's
    # shutdown), process 1 beats no more: it once beat on, waiting with them.
    store = Store({"flax_loop/alive/1": "7"})
    watcher = distributed.FailureWatcher(poll_seconds=0.02)
    ender = threading.Timer(5, watcher._stop.set)  # before: it never returned
    ender.start()
    try:
        with pytest.raises(Stopped):
            watcher._beat_until_stopped(store, "0", 0, {})
    finally:
        ender.cancel()
    ((why, status),) = stops
    assert status == 1
    assert "process 1 stopped answering" in why and "process 0 exits now" in why
    assert int(store.values["flax_loop/alive/0"]) > 1  # it beat meanwhile


def test_a_failed_process_does_not_take_a_peer_that_ended_for_dead(stops):
    # A peer stopped by this process's error says so as it leaves.
    store = Store({"flax_loop/alive/1": "7", "flax_loop/done/1": "1"})
    watcher = distributed.FailureWatcher(poll_seconds=0.02)
    threading.Timer(0.8, watcher._stop.set).start()
    watcher._beat_until_stopped(store, "0", 0, {})
    assert stops == []


def test_a_stopped_process_says_it_ends(monkeypatch):
    store = Store()
    monkeypatch.setattr(distributed, "_client", lambda: store)
    exits = []
    monkeypatch.setattr(distributed.os, "_exit", exits.append)
    distributed._stop_this_process("process 1 failed, so process 0 stops too: ...")
    assert exits == [distributed.EXIT_CODE]
    assert store.values == {"flax_loop/done/0": "1"}


class PendingWriter:
    output_dir = "/checkpoints"
    manager = "a manager with a write pending"

    def close(self):
        raise AssertionError("waited for a write the other processes cannot finish")

    def __hash__(self):
        return id(self)


def test_after_reporting_an_error_pending_orbax_writes_are_left_named(monkeypatch, capsys):
    writer = PendingWriter()
    orbax_writer._open_writers.add(writer)
    monkeypatch.setattr(distributed, "_reported", True)
    started = time.monotonic()
    try:
        orbax_writer._finish_pending_writes()
    finally:
        orbax_writer._open_writers.discard(writer)
    assert time.monotonic() - started < 1
    said = " ".join(capsys.readouterr().out.split())
    assert "pending writes to '/checkpoints' are left unfinished" in said
    assert "the steps already there are intact" in said


class Waiting:
    """A watcher as process 0 holds one; it has waited for the failed process."""

    def wait_for_end(self, client, me, process):
        pass


def test_a_runtime_error_waits_for_the_peer_that_caused_it(monkeypatch, stops):
    # A collective cut off by a peer's failure fails here at once; the peer's
    # own error, posted a moment later, is the one named.
    import jax

    store = Store()

    def get(key):
        if key not in store.values:
            raise KeyError(key)
        return store.values[key]

    store.key_value_try_get = get
    monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
    monkeypatch.setattr(distributed, "_client", lambda: store)
    monkeypatch.setattr(distributed, "_watcher", Waiting())
    monkeypatch.setattr(distributed, "_reported", False)
    later = threading.Timer(
        0.2, store.key_value_set, ("flax_loop/error", "1:DataExhaustedError: the data ended")
    )
    later.start()
    with pytest.raises(Stopped):
        distributed.report_error(jax.errors.JaxRuntimeError("Gloo all-reduce failed"))
    ((why, status),) = stops
    assert why == "process 1 failed, so process 0 stops too: DataExhaustedError: the data ended"
    assert status == distributed.EXIT_CODE
    assert store.values["flax_loop/error"].startswith("1:")  # its own error never posted
