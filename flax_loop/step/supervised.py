r"""The supervised form: `loss(*outputs, *targets)` as a step's loss.

A task with `TrainTask(apply, optimizer, loss, data)` trains on batches of
`(inputs, targets)`: its step calls the model on the inputs and the loss on
the outputs and the targets. `supervised_loss` makes that the loss a
gradient step differentiates (`flax_loop.step.gradient`), the same step a
`compute_loss` has; nothing else of the step differs.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop.step.model import LinenModel
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> x, y = np.ones((8, 4), np.float32), np.zeros(8, np.int32)
>>> params = model.init(jax.random.key(0), x)["params"]
>>> bound = LinenModel(model.apply, params, {}, {}, False)
>>> loss = supervised_loss(cross_entropy)(bound, ((x,), (y,)))
>>> bool(np.isclose(loss, cross_entropy(model.apply({"params": params}, x), y)))
True
"""

from collections.abc import Callable
from typing import Any

from flax_loop.data.batch import Batch
from flax_loop.step.model import as_outputs


def supervised_loss(loss: Callable[..., Any]) -> Callable[[Any, Batch], Any]:
    r"""`loss(*outputs, *targets)` as a step's loss of the bound model and an
    `(inputs, targets)` batch: the model called on the batch's inputs."""

    def compute_loss(bound: Any, batch: Batch) -> Any:
        inputs, targets = batch
        return loss(*as_outputs(bound.outputs(*inputs)), *targets)

    return compute_loss
