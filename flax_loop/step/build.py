r"""The step a `TrainTask` describes, composed of the built-in transforms.

`task_step` is the objective's parts (`flax_loop.step.parts`) with the
moving average (`with_ema`) and the skipping of non-finite updates
(`skip_nonfinite`) applied as the options ask (the loop compiles it as
`flax_loop.programs.statistics.counted` makes it).

>>> import optax
>>> import flax.linen as nn
>>> from flax_loop.step.objective import Objective, Part
>>> from flax_loop.step.supervised import supervised_loss
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> part = Part(None, supervised_loss(cross_entropy), optax.sgd(0.1), None)
>>> objective = Objective([part], nn.Dense(3).apply, [], False, supervised=True)
>>> sorted(task_step(objective, None, ema_decay=0.9).fields)
['ema_params']
"""

from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import NamedSharding

from flax_loop.step.core import Step, Transform, chain
from flax_loop.step.ema import with_ema
from flax_loop.step.nonfinite import skip_nonfinite
from flax_loop.step.objective import Objective
from flax_loop.step.own import UpdateFn, own_step
from flax_loop.step.parts import parts_step


def task_step(
    objective: Objective,
    axis_name: str | None,
    skip: bool = False,
    shards: NamedSharding | None = None,
    ema_decay: float | None = None,
    frozen: Callable[[Any], Any] | None = None,
    transforms: Sequence[Transform] = (),
    update: UpdateFn | None = None,
    carry: Any = None,
    reads_data: bool = True,
) -> Step:
    r"""The objective's step with the transforms the options ask for.

    Args:
        objective: the step's parts, model and frozen models.
        axis_name, shards: as `parts_step` takes them.
        skip: leave every field as it was after a non-finite step.
        ema_decay: with a value, carry the parameters' moving average.
        frozen: `frozen(params)`, the parameters no optimizer trains (a
            tree of booleans, or `None`): their average is the parameter.
        transforms: the task's own transforms (`TrainTask.transforms`),
            applied first.
        update, carry: a step of the task's own (`TrainTask.update`) and the
            arrays it carries, instead of the objective's parts.
        reads_data: whether the task has a data stream (`own_step`).
    """
    applied = list(transforms)
    if ema_decay is not None:
        applied.append(with_ema(ema_decay, frozen))
    if skip:  # outermost: a skipped step leaves every field as it was
        applied.append(skip_nonfinite())
    if update is not None:
        base = own_step(update, objective, carry, axis_name, shards, reads_data)
    else:
        base = parts_step(objective, axis_name, shards, carry)
    return chain(base, *applied)
