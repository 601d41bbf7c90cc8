r"""The model's contract: how `apply` and `loss` are called, and what they must return.

A model is a linen module's `apply(variables, *inputs, rngs=..., mutable=...)`
(outputs, and with mutable collections `(outputs, mutated variables)`); a
loss is `loss(*outputs, *targets)` returning a floating-point scalar.
Violations become `ApplyError` and `LossError` exceptions that say what to pass.

>>> check_loss(jnp.zeros(()), per_device=False).shape
()
"""

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.core.scope import CollectionFilter, in_filter, union_filters
from flax.errors import InvalidRngError

from flax_loop.errors import ApplyError, ConfigError, LossError


def call_apply(
    apply: Callable[..., Any],
    variables: Any,
    inputs: tuple[Any, ...],
    rngs: dict[str, jax.Array],
    mutable: CollectionFilter,
    keywords: Mapping[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    r"""`apply(variables, *inputs, rngs=rngs[, mutable=mutable], **keywords)`
    as `(what the model returned, mutated collections but params)`, its
    contract violations turned into `ApplyError` exceptions that say what
    to pass (`as_outputs` makes the result a tuple of outputs)."""
    mutated: dict[str, Any] = {}
    keywords = keywords or {}
    try:
        if mutable in (False, None):
            result = apply(variables, *inputs, rngs=rngs, **keywords)
        else:
            result = apply(variables, *inputs, rngs=rngs, mutable=mutable, **keywords)
            if not (
                isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)
            ):
                raise ApplyError(
                    "With mutable collections, task.apply must return (outputs, mutated "
                    "variables), as a linen module's apply(..., mutable=...) does; it "
                    f"returned {_describe(result)}. Pass mutable_collections=False to "
                    "TrainLoop for a model without mutable state."
                )
            result, mutated = result
            mutated = {k: v for k, v in dict(mutated).items() if k != "params"}
    except ApplyError:
        raise
    except InvalidRngError as error:
        found = re.search(r'PRNG for "([^"]+)"', str(error))
        stream = found.group(1) if found else "dropout"
        given = sorted(rngs)
        raise ApplyError(
            f"The model asks for the RNG stream {stream!r}, which flax_loop was not told "
            f"of (the streams given: {given}). Name it: TrainLoop(collections="
            f"{{'apply': {sorted({*given, stream})}}}) (and in EvalLoop's collections if "
            "evaluation needs it)."
        ) from None
    except TypeError as error:
        if "rngs" not in str(error) and "mutable" not in str(error):
            raise
        raise ApplyError(
            f"task.apply must accept the keywords rngs= and mutable= (a linen module's "
            f"apply does); calling it raised TypeError: {error}. Wrap a plain function: "
            "apply=lambda variables, *x, rngs=None, mutable=False: ..."
        ) from error
    return result, mutated


def as_outputs(result: Any) -> tuple[Any, ...]:
    r"""A model's result as the tuple of outputs `loss(*outputs, *targets)` takes."""
    return result if isinstance(result, tuple) else (result,)


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    shape = getattr(value, "shape", None)
    return f"an array of shape {shape}" if shape is not None else f"a {type(value).__name__}"


def split_loss(value: Any, per_device: bool) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""A loss function's result as `(loss, metrics)`.

    A loss returns a floating scalar, or `(scalar, {"accuracy": scalar, ...})`
    to report training metrics without a second pass.

    >>> loss, metrics = split_loss((jnp.ones(()), {"accuracy": jnp.asarray(0.5)}), False)
    >>> float(loss), {name: float(v) for name, v in metrics.items()}
    (1.0, {'accuracy': 0.5})
    """
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        loss, metrics = value
        checked = {}
        if "loss" in metrics:
            raise LossError(
                "The loss function's metrics name one 'loss': the training metrics' "
                "'loss' is the loss it returns (each optimizer's '<name>_loss' with "
                "several), so this metric would hide it. Name the metric otherwise, "
                "such as 'raw_loss'."
            )
        for name, metric in metrics.items():
            array = jnp.asarray(metric)
            if not isinstance(name, str) or array.shape != ():
                raise LossError(
                    f"The loss function's metrics must map names to scalars; got "
                    f"{name!r}: an array of shape {array.shape}"
                    f"{' (shapes are per device)' if per_device else ''}. Reduce it with .mean()."
                )
            checked[name] = array.astype(jnp.float32)
        return check_loss(loss, per_device), checked
    return check_loss(value, per_device), {}


def check_loss(loss: Any, per_device: bool) -> jax.Array:
    if isinstance(loss, (tuple, list)):
        kinds = ", ".join(_described(item) for item in loss)
        raise LossError(
            f"The loss function returned a {type(loss).__name__} of {len(loss)} ({kinds}); "
            "it returns the loss, a floating-point scalar, or (loss, {name: scalar}) to "
            "report training metrics: a dict by name, such as (loss, {'accuracy': acc}). "
            "Other outputs (logits) stay inside it."
        )
    shape = getattr(loss, "shape", None)
    dtype = getattr(loss, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        described = (
            f"an array of shape {shape} and dtype {dtype}"
            if shape is not None
            else f"a {type(loss).__name__}"
        )
        raise LossError(
            f"The loss function must return a floating-point scalar; it "
            f"returned {described}{' (shapes are per device)' if per_device else ''}. "
            "Reduce it with .mean() and compute it in "
            "floating point (e.g. optax.softmax_cross_entropy_with_integer_labels"
            "(...).mean())."
        )
    return loss


SOWN = "intermediates"
r"""The collection linen's `self.sow` writes to by default; never state."""


class LinenModel:
    r"""A linen model bound to the step's variables, as `compute_loss` gets it.

    `model(*args, **kwargs)` is `apply(variables, *args, **kwargs)` with the
    step's RNG keys (a later call in the same step draws new ones) and any
    keyword such as `method=`. Collections the model changes (`batch_stats`)
    carry over to the next call and the next step; values sown with
    `self.sow` (into `intermediates`, or any collection the state lacks) are
    in `model.sown`, by collection, as the latest call left them.

    Attributes:
        params: the parameters (what the loss differentiates).
        state: the other collections, as the latest call left them.
        sown: the collections sown by the latest call.
    """

    def __init__(
        self,
        apply: Callable[..., Any],
        params: Any,
        state: Mapping[str, Any],
        rngs: dict[str, jax.Array],
        mutable: CollectionFilter,
    ) -> None:
        self._apply, self._rngs, self._mutable = apply, rngs, mutable
        self.params = params
        self.state = dict(state)
        self.sown: dict[str, Any] = {}
        self._changed: set[str] = set()
        self._calls = 0

    @property
    def variables(self) -> dict[str, Any]:
        r"""`{"params": ..., **state}`, as linen's `apply` takes them."""
        return {"params": self.params, **self.state}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rngs = self._rngs
        if self._calls:  # each call of a step draws its own numbers
            rngs = {label: jax.random.fold_in(key, self._calls) for label, key in rngs.items()}
        self._calls += 1
        given = sorted({"rngs", "mutable"} & set(kwargs))
        if given:
            raise ApplyError(
                f"The loss called the model with {', '.join(f'{k}=' for k in given)}: the "
                "step gives the model its keys and carries its collections. Name the RNG "
                "streams with TrainLoop(collections={'apply': ['dropout', ...]}) (each "
                "call draws new numbers), draw your own from the loss's rng, and name "
                "what training may change with TrainLoop(mutable_collections=...)."
            )
        mutable = self._mutable
        if mutable not in (False, None):  # a model without state keeps its own contract
            mutable = union_filters(mutable, SOWN)
        result, mutated = call_apply(self._apply, self.variables, args, rngs, mutable, kwargs)
        sown = {}
        for name, value in mutated.items():
            if name in self.state:
                if in_filter(self._mutable, name):
                    self.state[name] = value
                    self._changed.add(name)
            else:
                sown[name] = value
        self.sown = sown
        return result

    def outputs(self, *inputs: Any) -> Any:
        r"""`model(*inputs)`: what a supervised loss takes its outputs from."""
        return self(*inputs)

    @property
    def model(self) -> "LinenModel":
        return self

    def collected(self) -> dict[str, Any]:
        r"""The collections the calls changed (what the step carries)."""
        return {name: self.state[name] for name in self._changed}


def check_compute_loss(compute_loss: Any, name: str, frozen: bool, carry: bool = False) -> None:
    r"""Checks that `compute_loss` takes `(model, batch, *, rng, step[,
    frozen][, carry])`.

    Raises:
        ConfigError: naming what the signature lacks.
    """
    if not callable(compute_loss):
        raise ConfigError(f"{name} must be callable; got {compute_loss!r}.")
    try:
        signature = inspect.signature(compute_loss)
    except (TypeError, ValueError):
        return  # a builtin or C function: it will be called as documented
    keywords = ["rng", "step"] + (["frozen"] if frozen else []) + (["carry"] if carry else [])
    parameters = signature.parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        keywords = []
    missing = [keyword for keyword in keywords if keyword not in signature.parameters]
    positional = [
        parameter
        for parameter in parameters
        if parameter.kind
        in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(parameter.kind is inspect.Parameter.VAR_POSITIONAL for parameter in parameters)
    if missing or (len(positional) < 2 and not varargs):
        raise ConfigError(
            f"{name} must be compute_loss(model, batch, *, rng, step"
            f"{', frozen' if frozen else ''}{', carry' if carry else ''}) -> "
            f"{'(loss, metrics, new_carry)' if carry else 'loss or (loss, metrics)'}; "
            f"{compute_loss!r} has the signature {signature}"
            f"{' (missing ' + ', '.join(missing) + ')' if missing else ''}."
        )


def refuse_float_labels(error: TypeError, targets: Any) -> None:
    r"""A `LossError` for float class labels: a loss that needs integer
    labels (optax's `..._with_integer_labels`) raised `error` while the
    batch's targets (`(shape, dtype)` pairs) are floating point."""
    floating = [
        f"{shape} {dtype}" for shape, dtype in targets if jnp.issubdtype(dtype, jnp.floating)
    ]
    if floating and "integer" in str(error):
        raise LossError(
            f"The loss needs integer class labels, and the batch's targets are "
            f"{', '.join(floating)} ({type(error).__name__}: {str(error).splitlines()[0]}). "
            "Give the labels as integers: y.astype(np.int32) where the batches are made "
            "(or labels.astype(jnp.int32) in the loss)."
        ) from None


def _described(value: Any) -> str:
    r"""A value as a user wrote it: an array by its dtype and shape (a traced
    one's type is JAX's business), anything else by its type.

    >>> _described(jnp.zeros((8, 3))), _described({"a": 1})
    ('float32[8, 3]', 'dict')
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype}{list(shape)}"
    return type(value).__name__
