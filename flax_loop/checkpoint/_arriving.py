r"""A checkpoint's statistics that arrive after it (`STATISTICS`).

A loop may hand a checkpoint out while the devices still compute the
interval it closes (`flax_loop.run.arrival`): its numbers are filled in
the first time one is read, through a descriptor per field, and before
anything copies the checkpoint's attributes (`Checkpoint.__dict__`).
"""

import types
from collections.abc import Callable
from typing import Any

STATISTICS = (
    "loss",
    "mean_loss",
    "n_nonfinite_steps",
    "train_metrics",
    "losses",
    "elapsed_time",
    "throughput",
)
r"""The fields of a checkpoint that its interval's numbers fill in: a loop may
hand the checkpoint out while the devices still compute them, and they are
filled in the first time one is asked for (`arriving`)."""

_SETTLE = "_settle"  # a checkpoint's pending statistics: `arriving`'s `fill`


def own_attributes(instance: Any) -> dict[str, Any]:
    r"""`instance`'s own attribute dict, past a `__dict__` of its class (a
    `Checkpoint`'s settles first)."""
    for kind in type(instance).__mro__:
        entry = kind.__dict__.get("__dict__")
        if isinstance(entry, types.GetSetDescriptorType):
            attributes: dict[str, Any] = entry.__get__(instance)
            return attributes
    raise TypeError(f"{type(instance).__name__} has no attribute dict")


class Statistic:
    r"""A field of `STATISTICS`: settled before it is read (`settle`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, checkpoint: Any, owner: type | None = None) -> Any:
        if checkpoint is None:
            return self
        settle(checkpoint)
        return own_attributes(checkpoint)[self.name]

    def __set__(self, checkpoint: Any, value: Any) -> None:
        own_attributes(checkpoint)[self.name] = value


def arriving(checkpoint: Any, fill: Callable[[Any], None]) -> None:
    r"""Marks `checkpoint`'s statistics as still on their way from the
    devices: the first read of one of them (or `settle`) calls
    `fill(checkpoint)`, which waits for them and sets the fields of
    `STATISTICS`. A `fill` that raises (the interval went non-finite) raises
    again at every read: a checkpoint the loop refuses is never read as if
    it were sound."""
    own_attributes(checkpoint)[_SETTLE] = fill


def settle(checkpoint: Any) -> None:
    r"""Fills `checkpoint`'s statistics in if they are on their way (`arriving`),
    waiting for the devices; raises the error of its interval if it has
    one. A writer settles a checkpoint before writing it."""
    attributes = own_attributes(checkpoint)
    fill = attributes.pop(_SETTLE, None)
    if fill is not None:  # (taken out first: what `fill` reads of the checkpoint is in)
        try:
            fill(checkpoint)
        except BaseException:
            attributes[_SETTLE] = fill  # raised again at the next read
            raise
