r"""`SavedState`: the one record of what a checkpoint saves.

The state a run resumes from is declared once, here: the arrays (parameters,
the model's other collections, the optimizer's state, the moving average of
the parameters) and what places the run in its streams (the step, the run's
key, the data iterator's state). Every form of it is this record plus its
own extras: a `Checkpoint` adds the interval's statistics, a
`CheckpointFile` its metrics, format version and path. They convert into
each other by the record's field names, never field by field:

>>> import jax
>>> import numpy as np
>>> from flax_loop.checkpoint import CheckpointFile, SavedState
>>> saved = SavedState({"w": np.ones(2)}, {}, (), 7)
>>> file = CheckpointFile.from_saved(saved, metrics={"eval": {"accuracy": 0.9}})
>>> file.step, file.metrics["eval"]["accuracy"], file.saved_state() is not saved
(7, 0.9, True)
>>> halved = saved.map_arrays(lambda arrays: jax.tree.map(lambda a: a / 2, arrays))
>>> halved.model_params["w"], halved.step
(array([0.5, 0.5]), 7)

A new field of the saved state is declared in `Saved` (and carried by the
compiled step): every form, file and reader follows from the names.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import jax

_Form = TypeVar("_Form", bound="Saved")


@dataclass
class Saved:
    r"""The fields every form of the saved state has (the record's, but the step)."""

    ARRAYS: ClassVar[tuple[str, ...]] = (
        "model_params",
        "model_state",
        "optimizer_state",
        "ema_params",
    )
    r"""the fields that hold device arrays: what a checkpoint copies and a file stores."""

    model_params: Any
    r"""parameters of the model at the checkpoint."""

    model_state: Any
    r"""the model's other collections at the checkpoint (e.g. `batch_stats`)."""

    optimizer_state: Any
    r"""a state of the optimizer at the checkpoint."""

    ema_params: Any = field(default=None, kw_only=True, repr=False)
    r"""the exponential moving average of the parameters, with
    `TrainLoop(ema_decay=...)`; `None` without."""

    rnkey: jax.Array | None = field(default=None, kw_only=True, repr=False)
    r"""the run's key, kept so that a resumed run draws the same random numbers."""

    data_state: Any = field(default=None, kw_only=True, repr=False)
    r"""the data iterator's `get_state()` at this step, when it has one
    (restored with `set_state` on resume)."""

    def saved_state(self) -> "SavedState":
        r"""The record of what this holds that a run resumes from."""
        return SavedState(**{name: getattr(self, name) for name in SAVED_FIELDS})

    @classmethod
    def from_saved(cls: type[_Form], saved: "Saved", **extras: Any) -> _Form:
        r"""This form of `saved` (any form), with its own `extras`."""
        return cls(**{name: getattr(saved, name) for name in SAVED_FIELDS}, **extras)

    def arrays(self) -> dict[str, Any]:
        r"""`{name: tree}` of the fields that hold arrays (`ARRAYS`)."""
        return {name: getattr(self, name) for name in self.ARRAYS}

    def map_arrays(self: _Form, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> _Form:
        r"""A copy whose array fields are `fn(self.arrays())` (one call over
        all of them: one host transfer, one compiled program); the other
        fields are kept as they are."""
        return dataclasses.replace(self, **fn(self.arrays()))


@dataclass
class SavedState(Saved):
    r"""What a checkpoint saves and a run resumes from (see the module's doc)."""

    step: int
    r"""the number of steps trained."""


SAVED_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(SavedState))
r"""The names of the record's fields."""

REQUIRED_ARRAYS: tuple[str, ...] = tuple(
    field.name
    for field in dataclasses.fields(SavedState)
    if field.name in Saved.ARRAYS and field.default is dataclasses.MISSING
)
r"""The array fields every saved state has; the others (a moving average)
may be absent (`None`), and are then left out of files."""
