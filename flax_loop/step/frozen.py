r"""Frozen models a step reads (`TrainTask(frozen=...)`), as a transform.

A frozen model (a teacher, a reference policy, a pretrained encoder) is no
parameter of the trained model: it travels to the devices as arrays beside
the run's key (`StepInputs`, never donated, never saved), and inside the
step `with_frozen` turns those arrays back into what the task gave: NNX
modules in evaluation mode (split once; merged in the step), anything else
as it was. A `compute_loss` or a task's own step then reads them as
`frozen=` / `state.frozen`.

>>> import jax.numpy as jnp
>>> from flax_loop.step.core import Context, Outcome, Step
>>> models = FrozenModels({"scale": {"w": jnp.float32(3)}})
>>> def scaled(fields, batch, context):
...     loss = context.frozen["scale"]["w"] * batch
...     return fields, Outcome(loss, {}, {}, True)
>>> step = with_frozen(models)(Step(dict, scaled))
>>> _, outcome = step.update({}, jnp.float32(2), Context(None, 0, models.arrays()))
>>> float(outcome.loss)
6.0
"""

from collections.abc import Hashable, Mapping
from typing import Any

from flax_loop.step.core import Context, Fields, Outcome, Step, Transform
from flax_loop.step.modules import NNXModel, is_nnx


class FrozenModels:
    r"""The task's frozen models or pytrees by name.

    Args:
        models: `TrainTask.frozen` as a dict (one value is named `"frozen"`).
    """

    def __init__(self, models: Mapping[str, Any]) -> None:
        self.models = dict(models)
        self._nnx = {
            name: NNXModel(value, train=False)
            for name, value in self.models.items()
            if is_nnx(value)
        }

    @classmethod
    def of(cls, frozen: Any) -> "FrozenModels | None":
        r"""`TrainTask.frozen` (a dict, one model or pytree, or `None`)."""
        if frozen is None:
            return None
        return cls(frozen if isinstance(frozen, Mapping) else {"frozen": frozen})

    def key(self) -> Hashable:
        r"""What determines the programs: each model's structure (an NNX
        module's graph definition), never its values (they are arguments)."""
        from flax_loop.step.keys import signature

        return tuple(
            (name, self._nnx[name].graphdef if name in self._nnx else signature(value))
            for name, value in self.models.items()
        )

    def arrays(self) -> dict[str, Any]:
        r"""The models as arrays, for the devices."""
        return {
            name: self._nnx[name].init(None) if name in self._nnx else value
            for name, value in self.models.items()
        }

    def view(self, arrays: Mapping[str, Any]) -> Mapping[str, Any]:
        r"""The models of `arrays()`, inside the step: NNX modules in
        evaluation mode, anything else as it was given. An NNX module is
        made when it is looked up, at the trace level of the code that looks
        it up (a loss inside `jax.grad`), so that the code may call it and
        read what it sows (`self.sow`, `nnx.capture`): NNX refuses a write to
        a module made at another level."""
        return _View(self, arrays)

    def model(self, name: str, value: Any) -> Any:
        r"""The frozen model `name` of its arrays `value`."""
        return self._nnx[name].module(value) if name in self._nnx else value


class _View(Mapping[str, Any]):
    r"""`FrozenModels.view`: the models by name, each made when looked up."""

    def __init__(self, models: FrozenModels, arrays: Mapping[str, Any]) -> None:
        self._models, self._arrays = models, arrays

    def __getitem__(self, name: str) -> Any:
        return self._models.model(name, self._arrays[name])

    def __iter__(self) -> Any:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def with_frozen(models: FrozenModels) -> Transform:
    r"""The transform giving the step it wraps the frozen models themselves
    in `Context.frozen` (the program takes their arrays)."""

    def transform(step: Step) -> Step:
        def update(fields: Fields, batch: Any, context: Context) -> tuple[Fields, Outcome]:
            return step.update(fields, batch, context._replace(frozen=models.view(context.frozen)))

        return Step(step.init, update, step.fields)

    return transform
