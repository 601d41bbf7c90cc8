r"""`TrainLoop`'s keyword options, checked once when made, and its `init`.

>>> Options(steps_per_dispatch=0)
Traceback (most recent call last):
...
flax_loop.errors.ConfigError: steps_per_dispatch must be >= 1; got 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flax_loop.checkpoint import CheckpointFileReader, OrbaxCheckpointReader
from flax_loop.errors import ConfigError, check_count
from flax_loop.parallel import DATA_AXIS
from flax_loop.programs.sharding import DEFAULT_FSDP_MIN_BYTES, Sharding, check_sharding
from flax_loop.run.initial import InitFn, Reader
from flax_loop.run.profiling import ProfileSteps
from flax_loop.step import several
from flax_loop.step.modules import as_init
from flax_loop.step.nonfinite import MODES as NONFINITE_MODES

DEFAULT_MUTABLE_COLLECTIONS: CollectionFilter = DenyList("intermediates")
r"""every collection but `intermediates` may change while training."""

HYPERPARAMS = ("task", "file")
r"""`TrainLoop(hyperparams=...)`: a resumed run's injected hyperparameters are
the task's, or those its file holds."""

Collections = Mapping[str, Sequence[str]]
r"""RNG collection names by use, e.g. `{"init": ["params"], "apply": ["dropout"]}`."""


@dataclasses.dataclass(frozen=True)
class Options:
    r"""`TrainLoop`'s keyword options (documented there), checked when made.

    Raises:
        ConfigError: naming the first invalid option.
    """

    nonfinite: str = "raise"
    progress: bool | None = None
    preemption_signals: Sequence[int] | None = None
    steps_per_dispatch: int = 1
    sharding: Sharding | None = None
    mesh: Mesh | None = None
    batch_axis: str = DATA_AXIS
    fsdp_min_bytes: int = DEFAULT_FSDP_MIN_BYTES
    ema_decay: float | None = None
    profile: ProfileSteps | None = None
    prefetch: int | None = None
    hyperparams: str = "task"

    def __post_init__(self) -> None:
        def checked(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        checked("steps_per_dispatch", check_count("steps_per_dispatch", self.steps_per_dispatch, 1))
        if self.nonfinite not in NONFINITE_MODES:
            raise ConfigError(
                f"nonfinite must be one of {NONFINITE_MODES}; got {self.nonfinite!r}."
            )
        if self.profile is not None and not isinstance(self.profile, ProfileSteps):
            raise ConfigError(
                f"profile must be a ProfileSteps(start=..., n=..., log_dir=...); "
                f"got {self.profile!r}."
            )
        checked("sharding", check_sharding(self.sharding))
        checked("fsdp_min_bytes", check_count("fsdp_min_bytes", self.fsdp_min_bytes, 0))
        decay = self.ema_decay
        if decay is not None and not (isinstance(decay, (int, float)) and 0 < decay < 1):
            raise ConfigError(
                f"ema_decay must be a number between 0 and 1 (e.g. 0.999), or None "
                f"for no moving average; got {decay!r}."
            )
        if self.prefetch is not None:
            checked("prefetch", check_count("prefetch", self.prefetch, 0))
        if self.hyperparams not in HYPERPARAMS:
            raise ConfigError(
                f"hyperparams must be one of {HYPERPARAMS} (which injected hyperparameters "
                f"a resumed run trains with); got {self.hyperparams!r}."
            )


def as_reader(init: InitFn | Reader) -> tuple[InitFn, Reader | None]:
    r"""The model's `init` function, and the reader to resume from, if any.

    Raises:
        ConfigError: if `init` is neither.
    """
    reader = init if isinstance(init, (CheckpointFileReader, OrbaxCheckpointReader)) else None
    init_fn = as_init(several.as_init(reader.target if reader is not None else init))
    if not callable(init_fn):
        raise ConfigError(
            f"init must be a model's init function or a CheckpointFileReader; got {init_fn!r}."
        )
    return init_fn, reader
