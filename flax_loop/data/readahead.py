r"""The feed's second stage: how checked batches are read, inline or on a thread.

A slow source is read by a background thread (`flax_loop.data.prefetch`), a few
batches ahead, while the devices compute: from the start with `prefetch=N`,
or, by default, once its first reads took `PREFETCH_AFTER_SECONDS` or more
each (a source in memory stays inline, where a thread would only cost).
While a thread reads ahead (or before the policy has decided), each batch
comes with the data state recorded right after it, so a checkpoint still
saves the state after its last trained batch however far the thread has
read. A source that fails on its first read from the thread is read inline
from then on, if it reads there.

>>> import numpy as np
>>> from flax_loop.data.source import CheckedBatches
>>> from flax_loop.parallel import Placement
>>> from flax_loop.data.readahead import ReadAhead
>>> batches = CheckedBatches([(np.zeros((8, 3)), np.zeros(8))] * 3, Placement())
>>> reading = ReadAhead(batches, prefetch=0, depth=3)
>>> first, state_before = reading.first()
>>> reading.read(for_step=2)[1], reading.threaded   # inline: no state recorded
(None, False)
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

from flax_loop.data.batch import Batch
from flax_loop.data.prefetch import ENDED, GAVE_UP, Failed, Prefetcher
from flax_loop.data.source import CheckedBatches
from flax_loop.errors import FlaxLoopError
from flax_loop.log import log

PREFETCH_AFTER_SECONDS = 2e-4
r"""With the default `prefetch=None`, a source whose first reads took this
long or longer (the median of `PROBE_READS`) is read by a background thread."""

PROBE_READS = 8
r"""How many reads the default `prefetch=None` times before it decides."""

Item = tuple[Batch, Any]
r"""A batch and the data state after it (`None` when states are not recorded)."""


class ReadAhead:
    r"""Reads `batches` for the feed: inline, or on a thread, by the `prefetch` policy.

    Args:
        batches: the checked batches.
        prefetch: `None` decides after the first reads (a thread if they
            are slow), `0` reads inline, `N >= 1` reads on a thread `N` ahead.
        depth: how far the thread reads ahead with `prefetch=None`.
    """

    def __init__(
        self,
        batches: CheckedBatches,
        prefetch: int | None,
        depth: int,
        give_up: Callable[[], bool] | None = None,
    ) -> None:
        self._batches = batches
        self._source = batches.source
        self._depth = prefetch if prefetch else depth
        self._prefetcher: Prefetcher | None = None
        self.threaded = bool(prefetch)
        r"""whether a thread reads (now, or from its next start): the data
        states recorded per batch are then the checkpoints' states."""
        self._probe: list[float] | None = [] if prefetch is None else None
        self._records = prefetch != 0
        self.last_step: int | None = None
        r"""the last step the loop will train: the thread reads no batch past it."""
        self.give_up = give_up
        r"""asked while waiting for the thread: true once the read in
        progress will not be used (a stop was requested)."""
        self.read: Callable[[int], Item | None | object] = (
            batches.item if prefetch == 0 else self._by_policy
        )
        r"""`read(for_step)`: the batch for `for_step` with its data state;
        `None` at the stream's end; `GAVE_UP` if the wait for the thread was
        given up. Once the policy reads inline without states it is the
        checked batches' own `item`: a steady inline read calls the source
        directly."""

    def first(self) -> tuple[Item | None, Any]:
        r"""The first batch, read inline (its time counts for the policy), and
        the data state before it (`None` when states are not recorded)."""
        before = self._source.snapshot() if self._records else None
        started = time.perf_counter()
        batch = self._batches.read(for_step=1)
        if self._probe is not None:
            self._probe.append(time.perf_counter() - started)
        if batch is None:
            return None, before
        return (batch, self._source.snapshot() if self._records else None), before

    def _by_policy(self, for_step: int) -> Item | None | object:
        r"""`read` while the policy probes, or reads on a thread."""
        if self.threaded:
            return self._pull(for_step)
        if self._probe is not None:
            started = time.perf_counter()
            item = self._read_recorded(for_step)
            self._probe.append(time.perf_counter() - started)
            if len(self._probe) >= PROBE_READS:
                # decided: a thread for a slow source, else inline without states
                self.threaded = statistics.median(self._probe) >= PREFETCH_AFTER_SECONDS
                self._probe = None
                if not self.threaded:
                    self.read = self._batches.item
            return item
        return self._batches.item(for_step)

    def start(self, for_step: int) -> None:
        r"""Starts the thread at `for_step`, if batches are read on one, so that
        it reads while the first steps compute."""
        if self.threaded and (self.last_step is None or for_step <= self.last_step):
            self._reader(for_step)

    def pause(self) -> None:
        r"""Stops the thread, if any, after its read in progress, without
        waiting for that read: what it read, that read included, is kept,
        and a later read starts the thread again."""
        if self._prefetcher is not None:
            self._prefetcher.stop()

    def drop(self) -> None:
        r"""Stops the thread and drops what it read ahead (the source is repositioned)."""
        if self._prefetcher is not None:
            self._prefetcher.stop(wait=True)
            self._prefetcher = None

    def _read_recorded(self, for_step: int) -> Item | None:
        r"""The batch for `for_step` and the data state after it (a deep copy)."""
        batch = self._batches.read(for_step)
        return None if batch is None else (batch, self._source.snapshot())

    def _pull(self, for_step: int) -> Any:
        r"""The next item of the thread (started, or started again after it
        stopped), or `GAVE_UP`; its exception re-raised here."""
        item = self._reader(for_step).get(self.give_up)
        while item is ENDED:  # it stopped, or read to its last step: read on
            self._prefetcher = None
            item = self._reader(for_step).get(self.give_up)
        if not isinstance(item, Failed):
            return item
        self._prefetcher = None
        if item.first and not isinstance(item.error, FlaxLoopError):
            return self._read_inline_instead(item.error, for_step)
        raise item.error

    def _read_inline_instead(self, error: BaseException, for_step: int) -> Any:
        r"""A source that failed on its first read from the thread is read
        inline from now on, if it reads there (else the thread's error)."""
        try:
            item = self._read_recorded(for_step)
        except Exception:
            raise error from None
        if item is None:
            raise error
        log(
            f"task.data raised {type(error).__name__} when read from a background "
            f"thread ({error}): it is read inline (pass prefetch=0 to say so)."
        )
        self.threaded = False  # inline: the source's own state is exact
        self.read = self._batches.item
        return item

    def _reader(self, for_step: int) -> Prefetcher:
        r"""The reading thread: the running one (or the stopped one while it
        holds results), else one started at `for_step`."""
        prefetcher = self._prefetcher
        if prefetcher is None or not prefetcher.has_next:
            last = None if self.last_step is None else max(self.last_step, for_step)
            prefetcher = Prefetcher(self._read_recorded, for_step, self._depth, last)
            self._prefetcher = prefetcher
        return prefetcher


__all__ = ["GAVE_UP", "PREFETCH_AFTER_SECONDS", "PROBE_READS", "ReadAhead"]
