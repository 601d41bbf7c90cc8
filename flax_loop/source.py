r"""A task's data as a stream of raw batches, and the stream's position.

A re-iterable source (a list, a `DataLoader`, a grain dataset: anything
whose `iter()` gives a fresh iterator) is read epoch after epoch, its state
being the epoch and the batches read in it (with the iterator's own state,
if it has one); a one-shot iterator ends when it ends, its state being its
own `get_state()`, if any.

>>> source = DataSource([1, 2])
>>> [source.next() for _ in range(3)], source.snapshot()
([1, 2, 1], {'flax_loop/epoch': {'epoch': 1, 'batches': 1}})
"""

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from flax_loop.errors import ConfigError

EPOCH = "flax_loop/epoch"
r"""The key of a re-iterable source's data state: the epoch, and the position in it."""


class DataSource:
    r"""The raw batches of `data`, epoch after epoch if it is re-iterable.

    Raises:
        ConfigError: if `data` cannot be iterated.
    """

    def __init__(self, data: Any) -> None:
        try:
            iterator = iter(data)
        except TypeError as error:
            raise ConfigError(
                f"task.data must be an iterator or iterable of batches; got {type(data).__name__}."
            ) from error
        self._source: Iterable[Any] | None = None if iterator is data else data
        self._iterator: Iterator[Any] = iterator
        self._epoch = 0
        self._position = 0  # batches read in this epoch
        self._peeked: Any = _NOTHING  # a batch read to see if the epoch ends

    @property
    def repeats(self) -> bool:
        r"""whether the source is read epoch after epoch."""
        return self._source is not None

    def next(self) -> Any:
        r"""The next raw batch (of the next epoch at an epoch's end).

        Raises:
            StopIteration: at a one-shot iterator's end, or an epoch without a batch.
        """
        try:
            if self._peeked is not _NOTHING:
                raw, self._peeked = self._peeked, _NOTHING
                self._position += 1
                return raw
            raw = next(self._iterator)
        except StopIteration:
            if self._source is None or self._position == 0:
                raise  # a one-shot iterator, or an epoch without a batch
            self._epoch, self._position = self._epoch + 1, 0
            self._iterator = iter(self._source)
            raw = next(self._iterator)
        self._position += 1
        return raw

    def ends_after(self) -> bool:
        r"""Whether the current iterator has no batch after the one just read."""
        if self._peeked is _NOTHING:
            try:
                self._peeked = next(self._iterator)
            except StopIteration:
                return True
        return False

    def snapshot(self) -> Any:
        r"""The source's state now (a deep copy); `None` if it has none."""
        get_state = getattr(self._iterator, "get_state", None)
        if self._source is not None:
            position: dict[str, Any] = {"epoch": self._epoch, "batches": self._position}
            if callable(get_state):
                position["state"] = get_state()
            return copy.deepcopy({EPOCH: position})
        if callable(get_state):
            return copy.deepcopy(get_state())
        return None

    def reposition(self, state: Any) -> str | None:
        r"""Repositions the source at a `snapshot()`; `None` if done, or why it
        cannot be (then the source is as it was)."""
        set_state = getattr(self._iterator, "set_state", None)
        if self._source is None and not callable(set_state):
            return "it has no get_state/set_state"
        if state is None:
            return "the checkpoint holds no state of it, or one of another number of processes"
        if self._source is not None:
            if not (isinstance(state, dict) and isinstance(state.get(EPOCH), dict)):
                return "the checkpoint's data state is not that of a re-iterable source"
            self._peeked = _NOTHING
            saved = state[EPOCH]
            self._iterator, self._epoch = iter(self._source), int(saved.get("epoch", 0))
            set_state = getattr(self._iterator, "set_state", None)
            if "state" in saved and callable(set_state):
                set_state(saved["state"])
                self._position = int(saved.get("batches", 0))
                return None
            self._position = 0
            for _ in range(int(saved.get("batches", 0))):  # skip what was trained on
                self.next()
            return None
        assert callable(set_state)
        self._peeked = _NOTHING
        set_state(state)
        return None


_NOTHING = object()
