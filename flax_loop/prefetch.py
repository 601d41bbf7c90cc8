r"""A background thread that reads training batches ahead of the loop.

`BatchFeed` hands it its read function; the thread calls it for the next
steps and keeps up to `depth` results in a buffer, so that a slow source
(files, a network, decoding) reads while the devices compute. Results come
out in order; an exception is one too, re-raised in the caller when its
turn comes; the thread stops after it, or after the source ends.

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
r"""`read(step) -> item`: the batch for `step` (with its data state), `None` at the end."""


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
    """

    def __init__(self, read: Read, first_step: int, depth: int) -> None:
        self._read, self._depth = read, depth
        self._items: deque[Any] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, args=(first_step,), name="flax_loop-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, step: int) -> None:
        first = True
        while True:
            try:
                item = self._read(step)
            except BaseException as error:  # delivered in order, raised by get()
                item = Failed(error, first)
            first = False
            with self._changed:
                self._items.append(item)  # even when stopping: nothing read is lost
                self._changed.notify_all()
                if item is None or isinstance(item, Failed):
                    return
                while len(self._items) >= self._depth and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
            step += 1

    def get(self) -> Any:
        r"""The next result, waiting for it: an item, `None` at the stream's
        end, or a `Failed` exception. Only called while `has_next`."""
        with self._changed:
            while not self._items:
                self._changed.wait()
            item = self._items.popleft()
            self._changed.notify_all()
        return item

    @property
    def has_next(self) -> bool:
        r"""whether `get` has a result to give: one held, or a running thread."""
        return bool(self._items) or self._thread.is_alive()

    def stop(self) -> None:
        r"""Stops the thread after the read in progress (it is kept: `get`
        still gives every result already read); waits for it to end."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join()
