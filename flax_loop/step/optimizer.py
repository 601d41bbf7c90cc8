r"""An optimizer's update with optax's extra arguments, for those that take them.

Some optax optimizers read more than the gradients: `optax.contrib.
reduce_on_plateau` and `optax.polyak_sgd` the loss (`value`), `optax.lbfgs`
and the line searches also the gradient (`grad`) and the loss as a function
of the parameters (`value_fn`). Optax's own training loops pass them as
keywords to `update`; so does the step: every optimizer that declares extra
arguments (an `optax.GradientTransformationExtraArgs`, such as any
`optax.chain`, or an `optax.MultiSteps`) is given them, and ignores those it
does not read. A plain `GradientTransformation` is called as before, so a
step of such an optimizer compiles to the same program; so is one that
declares extra arguments but takes none of these (`optax.contrib.sam`, whose
`update` refuses them, alone or in a chain).

>>> import jax.numpy as jnp, optax
>>> params, grads = {"w": jnp.ones(2)}, {"w": jnp.full(2, 0.5)}
>>> optimizer = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1))
>>> state = optimizer.init(params)
>>> for loss in [1.0, 2.0]:  # no better the second time: the rate goes down tenfold
...     updates, state = update(optimizer, grads, state, params, {"value": jnp.float32(loss)})
...     print(updates["w"].tolist())
[-0.5, -0.5]
[-0.05000000074505806, -0.05000000074505806]
"""

import re
from collections.abc import Mapping
from typing import Any

import optax

from flax_loop.errors import ConfigError

_MISSING = re.compile(r"missing \d+ required keyword-only arguments?: (.+)$")
_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")
_NOT_PROVIDED = re.compile(r"\b(\w+) must be provided")


def takes_extra_args(optimizer: Any) -> bool:
    r"""Whether `optimizer.update` takes optax's extra keyword arguments."""
    return isinstance(optimizer, (optax.GradientTransformationExtraArgs, optax.MultiSteps))


def step_arguments(value: Any, grad: Any, value_fn: Any = None) -> dict[str, Any]:
    r"""The extra arguments a built-in step gives: the loss (`value`), its
    gradient (`grad`) and, unless `None`, the loss as a function of the
    trained parameters (`value_fn`)."""
    given = {"value": value, "grad": grad}
    return given if value_fn is None else {**given, "value_fn": value_fn}


PER_DEVICE = (
    "A step written per device (its model or loss names the batch axis) gives an "
    "optimizer no function of the parameters (value_fn, obj_fn): its gradient would be "
    "one device's. Leave the axis name out: the step is then one program over the "
    "whole batch."
)
r"""What `update`'s error adds when a step of the per-device form leaves out a
function of the parameters."""


def update(
    optimizer: Any,
    grads: Any,
    state: Any,
    params: Any,
    extra_args: Mapping[str, Any],
    per_device: str = "",
) -> tuple[Any, Any]:
    r"""`optimizer.update(grads, state, params, **extra_args)`, the extra
    arguments left out for an optimizer that takes none; `per_device` is
    added to the error for a function of the parameters wanted and not
    given.

    Raises:
        ConfigError: if the optimizer wants a keyword argument it was not
            given (named, with what the step gives).
    """
    given = dict(extra_args) if takes_extra_args(optimizer) else {}
    try:
        return optimizer.update(grads, state, params, **given)
    except TypeError as error:
        refused = _UNEXPECTED.search(str(error))
        if refused is None or refused.group(1) not in given:
            _raise_if_left_out(error, given, per_device)
            raise
    except ValueError as error:
        _raise_if_left_out(error, given, per_device)
        raise
    # a transformation that declares extra arguments yet takes none of these
    # (`optax.contrib.sam`, in a chain or not): called as before them
    try:
        return optimizer.update(grads, state, params)
    except (TypeError, ValueError) as error:
        _raise_if_left_out(error, {}, per_device)
        raise


def _raise_if_left_out(error: Exception, given: Mapping[str, Any], per_device: str) -> None:
    r"""A `ConfigError` naming the keyword arguments the optimizer wants if
    `error` says it was called without them (none that was given): Python's
    missing keyword-only arguments, or an optax transformation's "obj_fn
    must be provided" (`optax.contrib.sophia`; `optax.contrib.sam`'s
    `grad_fn` in its opaque mode)."""
    missing = _MISSING.search(str(error))
    names = re.findall(r"'(\w+)'", missing.group(1)) if missing else []
    names += [name for name in _NOT_PROVIDED.findall(str(error)) if name != "params"]
    if not names or set(names) & set(given):
        return  # not an argument the step left out
    wanted = ", ".join(repr(name) for name in names)
    raise ConfigError(
        f"The optimizer's update wants the keyword argument(s) {wanted}, "
        "which the step does not give (it gives: "
        f"{', '.join(sorted(given)) or 'none'}). The built-in steps give optax's value "
        "(the loss), grad and value_fn (the loss as a function of the parameters); for "
        "others write your own step (TrainTask(update=...)) and pass them: "
        "state.apply_gradients(grads, value=loss, ...)."
        + (f" {per_device}" if per_device and any(n.endswith("_fn") for n in names) else "")
    ) from error
