r"""The run's step and how its state is laid out over the devices.

`StepLayout.of` chooses the layout (`TrainLoop(sharding=...)`, the model's
own annotations with a mesh) and builds the task's step over it: the fields
the step declares are laid out by their `Field`. The step is written for
the whole batch, as on one device; the same step written per device (each
device its share of the batch, averaging with `pmean`) is built only for a
model or loss that names the batch axis itself (`per_device_note`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Hashable
from typing import Any

import jax

from flax_loop.parallel import Placement
from flax_loop.programs.cache import identity, signature
from flax_loop.programs.sharding import Sharding, chosen_sharding, is_replicated, state_shardings
from flax_loop.programs.state import TrainState
from flax_loop.run.initial import parameter_annotations
from flax_loop.run.options import Options
from flax_loop.step.build import task_step
from flax_loop.step.core import Step
from flax_loop.step.objective import Objective
from flax_loop.task import TrainTask


@dataclasses.dataclass(frozen=True)
class StepLayout:
    r"""The run's step and how its state is laid out over the devices."""

    step: Step
    r"""the task's step (its fields declared by its transforms)."""

    sharding: Sharding
    r"""the chosen layout (`flax_loop.programs.sharding`)."""

    annotations: Any
    r"""the model's own partition specs, if read."""

    shardings_of: Callable[[TrainState], TrainState]
    r"""the state's shardings, given the state."""

    per_device: Callable[[bool], Step]
    r"""builds the task's step written per device, for a model or loss that
    names the batch axis (its fields are the step's), given whether the
    state is laid out by shardings of its own (not all replicated)."""

    program_key: Hashable
    r"""what determines the step's programs but the shapes they take
    (`flax_loop.programs.cache`)."""

    fields_key: Hashable
    r"""what determines the shapes of the step's fields but the shapes of
    the state it starts from: the step's key and the task's carry (its
    arrays' shapes, or the function that makes them)."""

    @property
    def sharded(self) -> bool:
        return not is_replicated(self.sharding)

    def shardings_for(self, state: TrainState) -> TrainState | None:
        r"""The state's shardings, or `None` where every leaf is replicated
        (the replicated layout, with no carry split with the batch)."""
        shardings = self.shardings_of(state)
        if self.sharded:
            return shardings
        replicated = all(sharding.is_fully_replicated for sharding in jax.tree.leaves(shardings))
        return None if replicated else shardings

    def fields_layout(self, fields: Any) -> Any:
        r"""The shardings of the step's fields, given their shapes."""
        return self.shardings_of(TrainState.create(fields, 0)).fields

    @classmethod
    def of(
        cls,
        options: Options,
        placement: Placement,
        objective: Objective,
        task: TrainTask,
        model: tuple[Any, ...],
        batch_rows: Collection[int] = (),
    ) -> StepLayout:
        r"""The layout the options and the model ask for, and the task's step
        over it (`model`: `parameter_annotations`' arguments; `batch_rows`:
        the global batch's leading sizes, which a carry's rows follow)."""
        annotations = None
        if options.sharding == "model" or (options.sharding is None and options.mesh is not None):
            annotations = parameter_annotations(*model)
        sharding = chosen_sharding(options.sharding, annotations)
        step_of = functools.partial(
            task_step,
            objective,
            skip=options.nonfinite == "skip",
            ema_decay=options.ema_decay,
            frozen=lambda params: objective.trained(params).frozen_mask(),
            transforms=getattr(task, "transforms", ()),
            update=getattr(task, "update", None),
            carry=getattr(task, "carry", None),
            reads_data=getattr(task, "data", None) is not None,
        )
        step = step_of(None)  # the whole batch, as on one device

        def per_device(laid_out: bool) -> Step:
            per_device = placement.n_devices > 1 or laid_out
            axis_name = placement.batch_axis if per_device else None
            return step_of(axis_name, shards=placement.batch_sharding if laid_out else None)

        def shardings_of(state: TrainState) -> TrainState:
            return state_shardings(
                sharding,
                placement,
                state,
                objective,
                options.fsdp_min_bytes,
                annotations,
                step.fields,
                batch_rows,
            )

        program_key = (
            objective.key(),
            identity(getattr(task, "update", None)),
            identity(getattr(task, "transforms", ())),
            getattr(task, "data", None) is not None,
            options.ema_decay,
            options.nonfinite,
            identity(sharding),
            identity(annotations),
            options.fsdp_min_bytes,
            tuple(placement.devices),
            placement.mesh,
            placement.batch_axis,
        )
        carry = getattr(task, "carry", None)
        fields_key = (program_key, identity(carry) if callable(carry) else signature(carry))
        return cls(step, sharding, annotations, shardings_of, per_device, program_key, fields_key)


def batch_rows(sample: Any) -> frozenset[int]:
    r"""The global batch's leading sizes, from a process's first batch
    (`sample`; every process feeds its share): a carry's leaf of one of
    them has a row per example and is split with the batch."""
    n_processes = jax.process_count()
    return frozenset(
        int(leaf.shape[0]) * n_processes
        for leaf in jax.tree.leaves(sample)
        if len(getattr(leaf, "shape", ())) >= 1
    )


def per_device_note(axis: str) -> str:
    r"""What set-up says of a step that names the batch axis `axis`."""
    return (
        f"The model or loss names the batch axis {axis!r} (BatchNorm(axis_name={axis!r}), "
        "all_gather, psum, axis_index): the step runs per device, each device on its "
        "share of the batch with keys of its own, so N devices do not compute what one "
        "does. Drop the axis name and the collectives: the step sees the whole batch, "
        "as on one device."
    )
