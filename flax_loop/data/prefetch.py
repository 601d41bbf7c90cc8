r"""A background thread that reads training batches ahead of the loop.

`BatchFeed` hands it its read function; the thread calls it for the next
steps and keeps up to `depth` results in a buffer, so that a slow source
(files, a network, decoding) reads while the devices compute. Results come
out in order; an exception is one too, re-raised in the caller when its
turn comes; the thread stops after it, after the source ends, or after the
read for `last_step`: it never reads a batch the loop will not train.

Nobody waits for a read that will not be used: `stop` lets a read in
progress finish on its own (its result is kept for a later `get`), and
`get` gives up waiting as soon as its `give_up` says so.

>>> reader = Prefetcher(lambda step: (step, None) if step <= 3 else None, first_step=1, depth=2)
>>> reader.get(), reader.get(), reader.get(), reader.get()
((1, None), (2, None), (3, None), None)
>>> reader.stop()
"""

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

Read = Callable[[int], Any]
r"""`read(step) -> item`; the batch for `step` (with its data state), `None` at the end."""

GAVE_UP = object()
r"""What `get` returns when its `give_up` said to stop waiting."""

ENDED = object()
r"""What `get` returns when the thread ended (stopped, or past `last_step`)
with no result left to give: a new `Prefetcher` reads on."""

_POLL_SECONDS = 0.05


class Failed:
    r"""An exception the read function raised, in its place in the order."""

    def __init__(self, error: BaseException, first: bool) -> None:
        self.error = error
        self.first = first
        r"""whether it was this thread's first read (the source may not be
        readable from another thread)."""


class Prefetcher:
    r"""Calls `read(first_step)`, `read(first_step + 1)`, ... on a daemon thread.

    Args:
        read: the read function; its result `None` ends the stream.
        first_step: the step of the first read (for messages).
        depth: how many results to hold ahead of `get`.
        last_step: the step of the last read (`None`: no bound).
    """

    def __init__(
        self, read: Read, first_step: int, depth: int, last_step: int | None = None
    ) -> None:
        self._read, self._depth, self.last_step = read, depth, last_step
        self._items: deque[Any] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._done = False
        self._reading = False
        self._thread = threading.Thread(
            target=self._run, args=(first_step,), name="flax_loop-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, step: int) -> None:
        try:
            self._read_on(step)
        finally:
            with self._changed:
                self._done = True
                self._changed.notify_all()

    def _read_on(self, step: int) -> None:
        first = True
        while self.last_step is None or step <= self.last_step:
            with self._changed:
                if self._stopping:  # asked to stop before this read began
                    return
                self._reading = True
            try:
                item = self._read(step)
            except BaseException as error:  # delivered in order, raised by get()
                item = Failed(error, first)
            first = False
            with self._changed:
                self._reading = False
                self._items.append(item)  # even when stopping: nothing read is lost
                self._changed.notify_all()
                if item is None or isinstance(item, Failed):
                    return
                while len(self._items) >= self._depth and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
            step += 1

    def get(self, give_up: Callable[[], bool] | None = None) -> Any:
        r"""The next result, waiting for it: an item, `None` at the stream's
        end, a `Failed` exception, or `ENDED` once the thread ended with
        nothing left to give. While it waits, `give_up()` is asked every
        50 ms; once true, `get` returns `GAVE_UP` and the read in progress
        goes on (its result is kept)."""
        with self._changed:
            while not self._items:
                if self._done:
                    return ENDED
                if give_up is None:
                    self._changed.wait()
                    continue
                if give_up():
                    return GAVE_UP
                self._changed.wait(_POLL_SECONDS)
            item = self._items.popleft()
            self._changed.notify_all()
        return item

    @property
    def has_next(self) -> bool:
        r"""whether `get` has a result to give: one held, or a running thread."""
        with self._changed:
            return bool(self._items) or not self._done

    def stop(self, wait: bool = False) -> None:
        r"""Stops the thread after the read in progress (it is kept: `get`
        still gives every result already read, that one included). A thread
        between reads ends at once, and is waited for; one inside a read is
        waited for only with `wait`."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
            reading = self._reading
        if wait or not reading:
            self._thread.join()
