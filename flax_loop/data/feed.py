r"""The dispatch plan, and the feed's last stage: batches grouped and placed
for the compiled steps.

An interval of `every` steps (`n_steps_per_checkpoint`) is dispatched as
compiled calls. With one step a dispatch, each step is a call of `ONE`,
and the interval's last step a call of `LAST`, which also returns its
gradients and closes the interval (its statistics come back with it). With
`steps_per_dispatch=K`, whole groups of K steps run as `MANY` (a scan), and
the steps that remain, if more than one, as one call of `MANY_LAST`, which
closes the interval as `LAST` does:

>>> DispatchPlan(every=3).dispatches()
[('one', 1), ('one', 1), ('last', 1)]
>>> DispatchPlan(every=100, steps_per_dispatch=32).dispatches()
[('many', 32), ('many', 32), ('many', 32), ('many_last', 4)]
>>> DispatchPlan(every=97, steps_per_dispatch=32).dispatches()
[('many', 32), ('many', 32), ('many', 32), ('last', 1)]

The plan is what the loop intends; the data may cut a dispatch short: a
stream that ends, a stop request, or a stream's shorter last batch (`SHORTER`,
compiled for its size) turn the rest of an interval into single steps, the
last of them closing it.

`BatchFeed` takes each dispatch's batches: a batch ready for the compiled
step, how many steps it holds, the variant that runs it and whether it ends
the interval. It reads one batch ahead, except at an interval's planned
end, so that a checkpoint's data state is that after its last trained
batch. Its batches come from `CheckedBatches` (`flax_loop.data.source`: read,
normalized, checked) through `ReadAhead` (`flax_loop.data.readahead`: inline, or
on a thread for a slow source).

>>> import numpy as np
>>> from flax_loop.parallel import Placement
>>> feed = BatchFeed([(np.zeros((8, 3)), np.zeros(8))] * 2, Placement(), steps_per_dispatch=1)
>>> batch, n_steps, variant, last = feed.take(1, remaining=10, stopping=False, next_step=1)
>>> n_steps, variant, last
(1, 'one', False)
"""

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from flax_loop import distributed
from flax_loop.data.batch import Batch, BatchSpec, normalize_batch
from flax_loop.data.readahead import GAVE_UP, ReadAhead
from flax_loop.data.source import CheckedBatches
from flax_loop.data.stack import stack
from flax_loop.log import log
from flax_loop.parallel import Placement

ONE = "one"
r"""One step."""

LAST = "last"
r"""One step that ends the interval; it also returns the gradients and the
interval's statistics, and resets them."""

MANY = "many"
r"""`steps_per_dispatch` steps in one call (a `jax.lax.scan` over stacked batches)."""

MANY_LAST = "many_last"
r"""The steps that end an interval in one call; a scan of all but the last,
then the last as `LAST` runs it."""

SHORTER = "shorter"
r"""One step on a stream's shorter last batch, compiled for its size."""

VARIANTS = (ONE, LAST, MANY, MANY_LAST)
r"""The variants compiled for the batch size (`SHORTER` is compiled per size)."""


@dataclass(frozen=True)
class DispatchPlan:
    r"""The dispatches of an interval of `every` steps at `steps_per_dispatch`.

    Args:
        every: the steps between checkpoints.
        steps_per_dispatch: the steps of a whole group.
    """

    every: int
    steps_per_dispatch: int = 1
    closing_steps: int = field(init=False)
    r"""the steps of the one call that ends a whole interval, if several;
    else 0 (the interval ends with a single `LAST` step)."""

    def __post_init__(self) -> None:
        every, many = self.every, self.steps_per_dispatch
        tail = every - many * ((every - 1) // many) if many > 1 else 0
        object.__setattr__(self, "closing_steps", tail if tail > 1 else 0)

    def group(self, remaining: int) -> int:
        r"""How many steps the next dispatch of an interval with `remaining`
        steps to go stacks (1: a single step).

        Whole groups while more than a group remains; the closing group when
        exactly its steps remain; single steps otherwise (an interval cut
        short by `n_steps`, or that a stop or a resume began elsewhere).

        >>> plan = DispatchPlan(every=100, steps_per_dispatch=32)
        >>> plan.group(100), plan.group(36), plan.group(4), plan.group(3)
        (32, 32, 4, 1)
        """
        many = self.steps_per_dispatch
        if many > 1 and (remaining > many or remaining == self.closing_steps):
            return min(remaining, many)
        return 1

    def dispatches(self, remaining: int | None = None) -> list[tuple[str, int]]:
        r"""`(variant, steps)` of every dispatch of an interval of `remaining`
        steps (a whole interval by default), when the data cuts none short:
        a list as long as the interval's dispatches (the loop asks `group`
        one dispatch at a time instead)."""
        remaining = self.every if remaining is None else remaining
        planned = []
        while remaining:
            n_steps = self.group(remaining)
            remaining -= n_steps
            planned.append((variant(n_steps, last=not remaining, short=False), n_steps))
        return planned

    def needed(self) -> list[str]:
        r"""The variants a whole interval calls, the first dispatch's first,
        then `LAST` (which ends an interval a stop cuts short too).

        >>> DispatchPlan(1).needed(), DispatchPlan(10).needed()
        (['last'], ['one', 'last'])
        >>> DispatchPlan(100, 32).needed(), DispatchPlan(32, 32).needed()
        (['many', 'many_last', 'last'], ['many_last', 'last'])
        """
        # in closed form: an interval may be 10**9 steps long
        if self.steps_per_dispatch == 1:
            return [LAST] if self.every == 1 else [ONE, LAST]
        needed = [MANY] if self.every > self.steps_per_dispatch else []
        return needed + ([MANY_LAST] if self.closing_steps else []) + [LAST]


def variant(n_steps: int, last: bool, short: bool) -> str:
    r"""The variant that runs a dispatch of `n_steps` read batches: `last`
    when it ends the interval, `short` for a stream's shorter last batch.

    >>> variant(1, last=False, short=False), variant(4, last=True, short=False)
    ('one', 'many_last')
    """
    if short:
        return SHORTER
    if n_steps > 1:
        return MANY_LAST if last else MANY
    return LAST if last else ONE


PER_PROCESS = "flax_loop/per_process"
r"""The key of a data state saved by several processes, one per process."""


Dispatch = tuple[Any, int, str, bool]
r"""What the loop dispatches next, a plain tuple (the cheapest to make, per
step): the batch (one, or `n_steps` stacked, placed as the compiled step
takes them); `n_steps`; the variant that runs it (`DispatchPlan`'s: a
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
        give_up: Callable[[], bool] | None = None,
    ) -> None:
        self._placement = placement
        # On one process a batch goes to the step as it is (numpy is copied to
        # the devices by the call itself); several processes assemble theirs.
        self._place = placement.shard_batch if placement.multiprocess else _as_is
        self._batches = CheckedBatches(data, placement, normalize)
        self._reading = ReadAhead(self._batches, prefetch, steps_per_dispatch + 2, give_up)
        first, self._taken_state = self._reading.first()
        self.sample = self._batches.accept_first(None if first is None else first[0])
        r"""the first batch, as the steps take it (their shapes come from it)."""
        self.spec: BatchSpec = self._batches.spec  # type: ignore[assignment]
        self._size = self.spec.shapes[0][0]  # the first leaf's: a shorter batch's is less
        self._shapes = self.spec.shapes
        # (batch, the data state after it, or None while states are not recorded)
        self._ahead: deque[tuple[Batch, Any]] = deque([first])  # type: ignore[list-item]
        self.exhausted = False
        # the last dispatch's batches, and the data state before them (`untake`)
        self._taken: tuple[list[Any] | tuple[Any, ...], Any] | None = None

    @property
    def repeats(self) -> bool:
        r"""whether the source is read epoch after epoch."""
        return self._batches.source.repeats

    def sample_batch(self, n_steps: int = 1) -> Any:
        r"""The first batch as the steps take it, or `n_steps` copies of it
        stacked as a group is (`n_steps > 1`), to compile the steps with."""
        if n_steps == 1:
            # On one process, numpy as the steps will take it: an executable
            # compiled for numpy inputs takes them faster per small step than one
            # compiled for placed arrays (benchmarks/loop_overhead.py).
            return self._place(self.sample)
        stacked = stack([self.sample] * n_steps)
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
                if len(ahead) >= group + (not closing) and all(
                    self._usual(ahead[index][0]) for index in range(group)
                ):
                    popleft = ahead.popleft
                    items = [popleft() for _ in range(group)]
                    self._taken = items, self._taken_state
                    self._taken_state = items[-1][1]
                    stacked = stack([item[0] for item in items])
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
        # a stream's shorter last batch, or a batch of another shape (a bucket)
        short = batch[0][0].shape[0] != self._size or (
            self._batches.other_shapes and not self._usual(batch)
        )
        return self._place(batch), 1, SHORTER if short else (LAST if last else ONE), last

    def _usual(self, batch: Batch) -> bool:
        r"""Whether `batch` has the first batch's shapes (steps of it stack)."""
        leaves = (*batch[0], *batch[1])
        return all(leaf.shape == shape for leaf, shape in zip(leaves, self._shapes))

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
        item = self._reading.read(for_step)
        if item is GAVE_UP:
            return False
        if item is None:
            self.exhausted = True
        else:
            self._ahead.append(item)  # type: ignore[arg-type]
        return True

    def resume(self, next_step: int, last_step: int) -> None:
        r"""Starts the reading thread, if the feed reads on one, so that it
        reads while the first steps compute; it reads no batch for a step
        after `last_step`."""
        self._reading.last_step = last_step
        if self._reading.threaded and not self.exhausted:
            self._reading.start(next_step + len(self._ahead))

    def pause(self) -> None:
        r"""Stops the reading thread, if any, after its read in progress
        (`ReadAhead.pause`): a later read starts it again."""
        if self._reading.threaded:  # inline, no thread ever runs
            self._reading.pause()

    def state(self, step: int) -> Any:
        r"""The source's state after the last batch trained on, to save with a
        checkpoint at `step`: a deep copy, which later reads cannot change.

        `None` for a one-shot iterator without `get_state`; with several
        processes, every process's state.
        """
        # Inline, nothing is read past an interval's planned end, so the
        # source's own state is that after the last batch trained on; with a
        # thread reading ahead, the state recorded with that batch is.
        if self._reading.threaded:
            state = copy.deepcopy(self._taken_state)
        else:
            state = self._batches.source.snapshot()
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
        self._reading.drop()  # what it read ahead is dropped with the rest
        why = self._batches.source.reposition(state)
        if why is None:
            self._ahead.clear()
            self.exhausted = False
            self._taken_state = self._batches.source.snapshot()
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
