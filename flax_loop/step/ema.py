r"""The moving average of the parameters, as a transform of a step.

`with_ema(decay)` declares the field `ema_params`, starts it at the
parameters and, after each update of the wrapped step, moves it towards
them: `ema = ema + (1 - decay) * (params - ema)`, in the average's dtype.
The one product and one sum leave a compiler a single way to fuse them
(`decay * ema + (1 - decay) * params` has two products: a multiply-add may
take either, differently in a scan of K steps than in a single step, and
the average would then depend on `steps_per_dispatch`).

>>> import jax.numpy as jnp
>>> from flax_loop.step.core import Context, Outcome, Step
>>> def halve(fields, batch, context):
...     params = {"w": fields["model_params"]["w"] / 2}
...     return {**fields, "model_params": params}, Outcome(jnp.float32(0), {}, {}, True)
>>> step = with_ema(0.75)(Step(dict, halve))
>>> fields = step.init({"model_params": {"w": jnp.ones(2)}, "model_state": {},
...                     "optimizer_state": ()})
>>> fields, _ = step.update(fields, None, Context(None, jnp.int32(0)))
>>> fields["ema_params"]["w"].tolist()  # 1 + 0.25 * (0.5 - 1)
[0.875, 0.875]
"""

from collections.abc import Callable
from typing import Any

import jax

from flax_loop.step.core import Context, Field, Fields, Outcome, Step, Transform, declare

FIELD = "ema_params"
r"""The field the moving average is carried (and saved) as."""


def with_ema(decay: float, frozen: Callable[[Any], Any] | None = None) -> Transform:
    r"""The transform keeping a moving average of the parameters.

    Args:
        decay: the average's decay, in (0, 1).
        frozen: `frozen(params)`, a tree of booleans shaped as the
            parameters, `True` for a parameter no optimizer trains (its
            average is the parameter, bit for bit), or `None` when every
            parameter trains.
    """

    def transform(step: Step) -> Step:
        fields = declare(step, FIELD, Field(mirrors_params=True))

        def init(given: Fields) -> Fields:
            return {
                **step.init(given),
                FIELD: jax.tree.map(lambda leaf: leaf.copy(), given["model_params"]),
            }

        def update(carried: Fields, batch: Any, context: Context) -> tuple[Fields, Outcome]:
            new, outcome = step.update(carried, batch, context)
            params = new["model_params"]
            mask = None if frozen is None else frozen(carried["model_params"])
            if mask is None:
                mask = jax.tree.map(lambda _: False, params)
            average = jax.tree.map(
                lambda old, param, is_frozen: (
                    param.astype(old.dtype)
                    if is_frozen
                    else old + (param.astype(old.dtype) - old) * (1 - decay)  # see above
                ),
                carried[FIELD],
                params,
                mask,
            )
            return {**new, FIELD: average}, outcome

        return Step(init, update, fields)

    return transform
