r"""The batch feed: reads ahead, validates, stacks and places training batches.

The loop asks the feed for the next dispatch; the feed answers with a batch
ready for the compiled step, how many steps it holds, and whether it is the
last of the interval (the last step also returns its gradients). To know
that, it reads one batch ahead, except at an interval's planned end, so
that a checkpoint's data state is the state after its last trained batch.

The raw batches, epoch after epoch for a re-iterable source, and their
position come from a `DataSource` (`flax_loop.source`).

A slow source is read by a background thread (`flax_loop.prefetch`), a few
batches ahead, while the devices compute: from the start with `prefetch=N`,
or, by default, once its first reads took `PREFETCH_AFTER_SECONDS` or more
each (a source in memory stays inline, where a thread would only cost). The
data state of each batch is then recorded as it is read, so a checkpoint
still saves the state after its last trained batch, however far the thread
has read.

>>> import numpy as np
>>> from flax_loop.feed import BatchFeed
>>> from flax_loop.parallel import Placement
>>> feed = BatchFeed([(np.zeros((8, 3)), np.zeros(8))] * 2, Placement(), steps_per_dispatch=1)
>>> batch, n_steps, variant, last = feed.take(1, remaining=10, stopping=False, next_step=1)
>>> n_steps, variant, last
(1, 'one', False)
"""

import copy
import inspect
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flax_loop import distributed
from flax_loop.batch import Batch, BatchSpec, normalize_batch
from flax_loop.errors import BatchError, DataExhaustedError, FlaxLoopError
from flax_loop.log import log
from flax_loop.parallel import Placement
from flax_loop.plan import LAST, MANY, MANY_LAST, ONE, SHORTER
from flax_loop.prefetch import ENDED, GAVE_UP, Failed, Prefetcher
from flax_loop.source import DataSource

PER_PROCESS = "flax_loop/per_process"
r"""The key of a data state saved by several processes, one per process."""

PREFETCH_AFTER_SECONDS = 2e-4
r"""With the default `prefetch=None`, a source whose first reads took this
long or longer (the median of `PROBE_READS`) is read by a background thread."""

PROBE_READS = 8
r"""How many reads the default `prefetch=None` times before it decides."""


Dispatch = tuple[Any, int, str, bool]
r"""What the loop dispatches next, a plain tuple (the cheapest to make, per
step): the batch (one, or `n_steps` stacked, placed as the compiled step
takes them); `n_steps`; the variant that runs it (`flax_loop.plan`: a
stream's shorter last batch needs a step compiled for its size); whether it
ends the interval (its step returns the gradients)."""


class BatchFeed:
    r"""Batches of a data source, ready for the compiled steps.

    Args:
        data: the task's data: an iterator, or an iterable read epoch after epoch.
        placement: the devices the batches go to.
        steps_per_dispatch: the most batches one dispatch stacks (how far
            the reading thread reads ahead).
        prefetch: batches a background thread reads ahead: `None` decides
            after the first reads (a thread if they are slow), `0` reads
            inline, `N >= 1` starts the thread at once.
        normalize: `normalize(raw) -> Batch`: the batch form the steps take
            (`normalize_batch`, or a `BatchTree` for batches of any structure).

    Raises:
        ConfigError: if `data` cannot be iterated.
        DataExhaustedError: if it yields no batch.
        BatchError: if the first batch has the wrong form or size.
    """

    def __init__(
        self,
        data: Any,
        placement: Placement,
        steps_per_dispatch: int,
        prefetch: int | None = None,
        normalize: Callable[[Any], Batch] = normalize_batch,
    ) -> None:
        self._normalize = normalize
        self._source = DataSource(data)
        self._placement = placement
        # On one process a batch goes to the step as it is (numpy is copied to
        # the devices by the call itself); several processes assemble theirs.
        self._place = placement.shard_batch if placement.multiprocess else _as_is
        # (batch, the data state after it): the state only while states are
        # recorded per batch (`_threaded`, or deciding whether to prefetch).
        self._ahead: deque[tuple[Batch, Any]] = deque()
        self._noted_drop = False
        self._spec: BatchSpec | None = None
        self.exhausted = False
        self._depth = prefetch if prefetch else steps_per_dispatch + 2
        self._prefetcher: Prefetcher | None = None
        # the last dispatch's batches, and the data state before them (`untake`)
        self._taken: tuple[list[Any] | tuple[Any, ...], Any] | None = None
        self.last_step: int | None = None
        r"""the last step the loop will train (set by `resume`): the reading
        thread reads no batch past it."""
        self.give_up: Callable[[], bool] | None = None
        r"""asked while the loop waits for the reading thread: true once the
        loop will not use the read in progress (a stop was requested)."""
        # Reading on a thread (now or from now on): checkpoints then take the
        # data states recorded per batch.
        self._threaded = bool(prefetch)
        self._probe: list[float] | None = [] if prefetch is None else None
        self._taken_state: Any = self._source.snapshot() if prefetch != 0 else None
        started = time.perf_counter()
        first = self._read(for_step=1)
        if self._probe is not None:
            self._probe.append(time.perf_counter() - started)
        if first is None:
            if inspect.isgenerator(data) and data.gi_frame is None:
                raise DataExhaustedError(
                    "task.data is a generator that has already run to its end (was it "
                    "read before, say by a first TrainLoop or a look at its batches?). "
                    "Make a new generator for this loop, or give a re-iterable source "
                    "(a list, a DataLoader, a grain dataset)."
                )
            raise DataExhaustedError(
                "task.data yielded no batch: the data stream is empty. Give it "
                "at least one batch (check the data set's size and batch size)."
            )
        self.spec = self._spec = BatchSpec.of(first)
        self.spec.check_batch_axis(placement.n_local_shards)
        distributed.agree("the process-local batch size", self.spec.batch_size)
        self.sample = first
        self._size = self.spec.batch_size
        self._ahead.append((first, self._source.snapshot() if prefetch != 0 else None))

    @property
    def repeats(self) -> bool:
        r"""whether the source is read epoch after epoch."""
        return self._source.repeats

    def sample_batch(self, n_steps: int = 1) -> Any:
        r"""The first batch as the steps take it, or `n_steps` copies of it
        stacked as a group is (`n_steps > 1`), to compile the steps with."""
        if n_steps == 1:
            # On one process, numpy as the steps will take it: an executable
            # compiled for numpy inputs takes them faster per small step than one
            # compiled for placed arrays (benchmarks/loop_overhead.py).
            return self._place(self.sample)
        stacked = _stack([self.sample] * n_steps)
        if self._placement.multiprocess:
            stacked = self._placement.shard_batch(stacked, stacked=True)
        return stacked

    def take(self, group: int, remaining: int, stopping: bool, next_step: int) -> Dispatch | None:
        r"""The next dispatch of an interval with `remaining` steps to go.

        Args:
            group: the steps the plan stacks in this dispatch
                (`DispatchPlan.group`); 1 for a single step. A group that
                the data cuts short (the stream ends, a shorter batch) is
                read as single steps instead.
            remaining: steps until the interval's planned end (>= 1).
            stopping: whether a stop was requested: the batch already read
                ahead, if any, is trained on as the interval's last; no more
                is read.
            next_step: the number of the next step, to name in messages.

        Returns:
            the dispatch, or `None` if there is no batch (the stream ended,
            or a stop was requested with nothing read ahead).
        """
        ahead = self._ahead
        if not stopping:
            if group > 1:
                # A group that ends the interval reads nothing past it (the
                # data state saved with the checkpoint); another reads one
                # batch more, so that a stream's end is a single last step.
                closing = group == remaining
                self._fill(group + (not closing), next_step)
                size = self._size
                if len(ahead) >= group + (not closing) and all(
                    ahead[index][0][0][0].shape[0] == size for index in range(group)
                ):
                    popleft = ahead.popleft
                    items = [popleft() for _ in range(group)]
                    self._taken = items, self._taken_state
                    self._taken_state = items[-1][1]
                    stacked = _stack([item[0] for item in items])
                    if self._placement.multiprocess:  # else numpy, as the step was compiled
                        stacked = self._placement.shard_batch(stacked, stacked=True)
                    return stacked, group, MANY_LAST if closing else MANY, closing
            # At the planned end nothing is read ahead: the data state saved
            # with the checkpoint is then that after its last batch.
            want = 1 if remaining == 1 else 2
            while len(ahead) < want and not self.exhausted:
                if not self._read_ahead(next_step + len(ahead)):
                    stopping = True  # a stop came while the thread read: no wait for it
                    break
        if not ahead:
            return None
        item = ahead.popleft()
        self._taken = (item,), self._taken_state
        batch, self._taken_state = item
        last = remaining == 1 or stopping or not ahead
        short = batch[0][0].shape[0] != self._size
        return self._place(batch), 1, SHORTER if short else (LAST if last else ONE), last

    def untake(self) -> None:
        r"""Puts the batches of the last dispatch back, to be taken again: its
        step did not run (interrupted while it waited for its compilation)."""
        taken, self._taken = self._taken, None
        if taken is not None:
            items, self._taken_state = taken
            self._ahead.extendleft(reversed(items))

    def _fill(self, count: int, next_step: int) -> None:
        while len(self._ahead) < count and not self.exhausted:
            if not self._read_ahead(next_step + len(self._ahead)):
                return  # a stop came meanwhile: a group that falls short runs as single steps

    def _read_ahead(self, for_step: int) -> bool:
        r"""Reads the batch for `for_step` into the read-ahead queue (or marks
        the stream exhausted); `False` if the wait for it was given up."""
        if self._threaded:
            item = self._pull(for_step)
            if item is GAVE_UP:
                return False
        elif self._probe is not None:
            started = time.perf_counter()
            item = self._read_recorded(for_step)
            self._probe.append(time.perf_counter() - started)
            if len(self._probe) >= PROBE_READS:
                self._decide()
        else:
            batch = self._read(for_step)
            item = None if batch is None else (batch, None)
        if item is None:
            self.exhausted = True
        else:
            self._ahead.append(item)
        return True

    def _decide(self) -> None:
        r"""After the first reads: a thread for a slow source, else inline
        without recording states."""
        assert self._probe is not None
        slow = statistics.median(self._probe) >= PREFETCH_AFTER_SECONDS
        self._probe = None
        self._threaded = slow

    def _read_recorded(self, for_step: int) -> tuple[Batch, Any] | None:
        r"""The batch for `for_step` and the data state after it (a deep copy)."""
        batch = self._read(for_step)
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
        self._threaded = False  # inline: the source's own state is exact
        return item

    def resume(self, next_step: int, last_step: int) -> None:
        r"""Starts the reading thread, if the feed reads on one, so that it
        reads while the first steps compute; it reads no batch for a step
        after `last_step`."""
        self.last_step = last_step
        if self._threaded and not self.exhausted and next_step + len(self._ahead) <= last_step:
            self._reader(next_step + len(self._ahead))

    def _reader(self, for_step: int) -> Prefetcher:
        r"""The reading thread: the running one (or the stopped one while it
        holds results), else one started at `for_step`."""
        prefetcher = self._prefetcher
        if prefetcher is None or not prefetcher.has_next:
            last = None if self.last_step is None else max(self.last_step, for_step)
            prefetcher = Prefetcher(self._read_recorded, for_step, self._depth, last)
            self._prefetcher = prefetcher
        return prefetcher

    def pause(self) -> None:
        r"""Stops the reading thread, if any, after its read in progress,
        without waiting for that read: what it read, that read included, is
        kept, and a later read starts the thread again."""
        if self._prefetcher is not None:
            self._prefetcher.stop()

    def _read(self, for_step: int) -> Batch | None:
        r"""The batch for `for_step`, normalized and validated; `None` at the end."""
        try:
            raw = self._source.next()
        except StopIteration:
            if self._placement.multiprocess:
                raise DataExhaustedError(
                    f"The data stream of process {jax.process_index()} ended before step "
                    f"{for_step}. With several processes every stream must yield a batch "
                    "for every step, so that all take the same steps: give each process "
                    "an endless or re-iterable source and stop with n_steps."
                ) from None
            return None
        except Exception as error:
            error.add_note(
                f"flax_loop: raised by task.data while reading the batch for step {for_step}"
            )
            raise
        spec = self._spec
        if spec is not None:
            fast = spec.fast_path(raw)
            if fast is not None:
                return fast
        try:
            batch = self._normalize(raw)
        except BatchError as error:
            raise BatchError(f"The batch for step {for_step}: {error}") from None
        smaller = spec is not None and batch[0][0].shape[:1] < (self._size,)
        if smaller and spec.shorter(batch) and self._source.ends_after():  # type: ignore[union-attr]
            # A stream's shorter last batch (a DataLoader's, tf.data's): trained
            # on if it splits over the devices, else dropped, never an error.
            size = batch[0][0].shape[0]
            if size % self._placement.n_local_shards or self._placement.multiprocess:
                if not self._noted_drop:
                    log(
                        f"The stream's last batch holds {size} examples, which do not "
                        f"split over {self._placement.n_local_shards} devices: it is "
                        "dropped (each time the source ends with it)."
                    )
                    self._noted_drop = True
                return self._read(for_step) if self._source.repeats else None
            return batch
        if spec is not None:
            spec.validate(batch, step=for_step)
        if not self._placement.multiprocess:
            batch = self._placement.feed_batch(batch)  # JAX arrays on other devices
        return batch

    def state(self, step: int) -> Any:
        r"""The source's state after the last batch trained on, to save with a
        checkpoint at `step`: a deep copy, which later reads cannot change.

        `None` for a one-shot iterator without `get_state`; with several
        processes, every process's state.
        """
        # Inline, nothing is read past an interval's planned end, so the
        # source's own state is that after the last batch trained on; with a
        # thread reading ahead, the state recorded with that batch is.
        state = copy.deepcopy(self._taken_state) if self._threaded else self._source.snapshot()
        if state is None:
            return None
        if self._placement.multiprocess:
            return {PER_PROCESS: distributed.gather_objects(f"data_state/{step}", state)}
        return state

    def restore(self, state: Any, stdout: bool) -> None:
        r"""Repositions the source at a saved state (what was read ahead is dropped).

        A source that cannot be repositioned starts from its first batch, and
        says so: the run then does not match one that never stopped.
        """
        if isinstance(state, dict) and PER_PROCESS in state:
            states = state[PER_PROCESS]
            if len(states) == jax.process_count():
                state = states[jax.process_index()]
            elif all(each == states[0] for each in states):
                state = states[0]
            else:
                state = None  # written by another number of processes
        if self._prefetcher is not None:
            self._prefetcher.stop(wait=True)  # what it read ahead is dropped with the rest
            self._prefetcher = None
        why = self._source.reposition(state)
        if why is None:
            self._ahead.clear()
            self.exhausted = False
            self._taken_state = self._source.snapshot()
            return
        log(
            f"({why}): it restarts from its first batch, so this run will not match one that "
            "never stopped. Give task.data get_state/set_state (grain's iterators "
            "have them) or a re-iterable source for exact resume.",
            stdout=stdout,
            lead="The data stream cannot be repositioned",
            style="yellow",
        )


def _as_is(batch: Batch) -> Batch:
    return batch


def _stack(batches: list[Batch]) -> Batch:
    r"""Stacks batches along a new leading axis, for several steps per dispatch."""
    first = batches[0]
    return tuple(  # type: ignore[return-value]
        tuple(
            _stack_leaves([batch[group][index] for batch in batches])
            for index in range(len(first[group]))
        )
        for group in range(len(first))
    )


def _stack_leaves(leaves: list[Any]) -> np.ndarray:
    first = leaves[0]
    if type(first) is not np.ndarray or first.dtype.hasobject:
        return np.stack(leaves)
    shape = (len(leaves), *first.shape)
    try:
        # One copy, by bytes.join: 32 batches of 32x64 float32 in 10 us, where
        # np.concatenate takes 16 and np.stack (a view per leaf) 29. The leaves
        # share the first batch's dtype (each batch was checked against it).
        joined = b"".join(leaves)
    except (BufferError, TypeError, ValueError):  # not C-contiguous
        return np.concatenate(leaves).reshape(shape)
    return np.frombuffer(joined, first.dtype).reshape(shape)
