r"""What one step optimizes: its losses, their optimizers and trainable parts.

A task's step is one or several `Part`s, run in order: each computes its
loss with the model bound to the current variables, differentiates it with
respect to its trainable parameters, and applies its optimizer, so a later
part sees the parameters an earlier one updated (a GAN's discriminator,
then its generator). A task with `loss(*outputs, *targets)` is one part
whose loss calls the model on the batch's inputs.

The model a loss sees (`Bound`): for an NNX module a new module holding the
step's variables; for linen a `LinenModel`, a callable that applies them.
Frozen models (`TrainTask(frozen=...)`) are `step/frozen.FrozenModels`.

>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainTask
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> kind = ModelKind.of(task.apply)  # the task's door settles it (check_train_task)
>>> objective = Objective.of(task, kind, rng_labels=[], mutable_collections=False)
>>> [part.name for part in objective.parts], objective.kind.nnx
([None], False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import optax
from flax.core.scope import CollectionFilter

from flax_loop.data.batch import BatchTree
from flax_loop.errors import ConfigError
from flax_loop.step.frozen import FrozenModels
from flax_loop.step.model import LinenModel
from flax_loop.step.modules import NNXModel, refuse_evaluation_defaults
from flax_loop.step.several import LinenModels, ModelKind, default_trainable
from flax_loop.step.supervised import supervised_loss
from flax_loop.step.trainable import Partition, union


class StepInputs(NamedTuple):
    r"""What every step takes besides the state and the batch: the run's
    training key and the frozen models' arrays (replicated on the devices,
    never donated)."""

    key: jax.Array
    frozen: Any = None


LossFn = Callable[..., Any]
r"""`compute_loss(model, batch, *, rng, step) -> loss | (loss, metrics)`."""


@dataclasses.dataclass(frozen=True)
class Part:
    r"""One optimizer's share of a step."""

    name: str | None
    r"""its name in the task's dicts; `None` for a task of one optimizer."""

    compute_loss: LossFn | None
    r"""its loss, `compute_loss(model, batch, *, rng, step)`; `None` in a
    task's own step (`TrainTask.update`)."""

    optimizer: optax.GradientTransformation
    r"""its optimizer."""

    trainable: Any
    r"""the filter of the parameters it trains (all with `None`)."""


class Objective:
    r"""A task's step: its parts in order, the model they call, and its frozen models.

    Args:
        parts: the parts, in the order each step runs them.
        apply: the model's apply function or NNX module.
        rng_labels: the RNG collections the model draws from.
        mutable_collections: the collections training may change.
        frozen: frozen models or pytrees by name, one of them, or `None`.
        supervised: whether the parts' losses take `(inputs, targets)` batches
            (a task's `loss`) rather than the batch as the stream gave it.
        batch_tree: (not supervised) the structure of the stream's batches,
            the feed's normalizer (it learns the structure from the first batch).
    """

    def __init__(
        self,
        parts: Sequence[Part],
        apply: Any,
        rng_labels: Sequence[str],
        mutable_collections: CollectionFilter,
        frozen: Any = None,
        supervised: bool = False,
        batch_tree: BatchTree | None = None,
        kind: ModelKind | None = None,
    ) -> None:
        self.kind = ModelKind.of(apply) if kind is None else kind
        r"""what the model is (NNX or linen, one or several)."""
        apply = self.kind.as_one(apply)  # several NNX modules: one nnx.Dict
        self.parts = tuple(parts)
        self.keyed = self.parts[0].name is not None
        self.rng_labels = list(rng_labels)
        self.mutable_collections = mutable_collections
        self.supervised = supervised
        self.batch_tree = batch_tree
        r"""the structure of the stream's batches (not supervised), which the
        feed learns from the first batch."""
        self._nnx = NNXModel(apply, train=True) if self.kind.nnx else None
        if self._nnx is not None and supervised:
            refuse_evaluation_defaults(apply)
        self._apply = apply
        self.frozen = FrozenModels.of(frozen)
        r"""the frozen models, or `None`."""
        self._partitions: list[Partition] | None = None
        self.carries = False  # whether the losses take carry= (TrainTask.carry)
        self.losses: Any = None
        r"""the task's loss functions as it gave them (`loss`, `compute_loss`),
        for `key` (a supervised part's loss is a wrapper of its own)."""

    def key(self) -> Hashable:
        r"""What determines the step this objective computes, as a cache key
        (`flax_loop.programs.cache`): the model (an NNX module by its graph
        definition, a linen `apply` by identity), the losses, each part's
        optimizer and trainable filter, the RNG labels, the mutable
        collections, the frozen models and the batches' structure."""
        from flax_loop.step.keys import identity

        model = self._nnx.graphdef if self._nnx is not None else identity(self._apply)
        frozen = () if self.frozen is None else self.frozen.key()
        parts = tuple(
            (part.name, identity(part.optimizer), identity(part.trainable)) for part in self.parts
        )
        tree = None if self.batch_tree is None else self.batch_tree.treedef
        return (
            model,
            identity(self.losses),
            parts,
            tuple(self.rng_labels),
            identity(self.mutable_collections),
            frozen,
            self.supervised,
            tree,
            self.carries,
        )

    @classmethod
    def of(
        cls,
        task: Any,
        kind: ModelKind,
        rng_labels: Sequence[str],
        mutable_collections: CollectionFilter,
        batch_tree: BatchTree | None = None,
    ) -> Objective:
        r"""The objective a (checked) `TrainTask` describes, its model of
        `kind` (`batch_tree` as the constructor takes it)."""
        compute_loss = getattr(task, "compute_loss", None)
        supervised = getattr(task, "loss", None) is not None
        # a task's own `update` has no loss of the objective's: its parts are
        # its optimizers and what each trains
        losses: Any = supervised_loss(task.loss) if supervised else compute_loss
        optimizer, trainable = task.optimizer, default_trainable(task, kind)
        frozen = getattr(task, "frozen", None)
        if isinstance(optimizer, Mapping):
            parts = [
                Part(
                    name,
                    losses[name] if isinstance(losses, Mapping) else losses,
                    optimizer[name],
                    trainable.get(name) if isinstance(trainable, Mapping) else trainable,
                )
                for name in optimizer
            ]
        else:
            parts = [Part(None, losses, optimizer, trainable)]
        objective = cls(
            parts, task.apply, rng_labels, mutable_collections, frozen, supervised, batch_tree, kind
        )
        objective.losses = getattr(task, "loss", None) or compute_loss
        objective.carries = compute_loss is not None and getattr(task, "carry", None) is not None
        return objective

    # -- parameters and optimizer states ------------------------------------

    def partitions(self, params: Any) -> list[Partition]:
        r"""Each part's trainable partition of `params` (computed once)."""
        if self._partitions is None:
            nnx_params = None if self._nnx is None else self._nnx.params_state
            self._partitions = [
                Partition.of(part.trainable, params, nnx_params) for part in self.parts
            ]
        return self._partitions

    def trained(self, params: Any) -> Partition:
        r"""The parameters some part trains."""
        return union(self.partitions(params), params)

    def init_optimizer(self, params: Any) -> Any:
        r"""The optimizer state for `params`: one part's, or a dict by part name.

        Raises:
            ConfigError: if an optimizer cannot be initialized.
        """
        states = []
        for part, partition in zip(self.parts, self.partitions(params)):
            try:
                states.append(part.optimizer.init(partition.split(params)))
            except Exception as error:
                named = "task.optimizer" + (f"[{part.name!r}]" if part.name is not None else "")
                raise ConfigError(
                    f"{named}.init failed with {type(error).__name__}: {error}. "
                    "Pass an optax.GradientTransformation such as optax.adam(1e-3)."
                ) from error
        return self.by_part(states)

    def by_part(self, values: Sequence[Any]) -> Any:
        r"""Per-part values as the state holds them: a dict by name, or the one."""
        if self.keyed:
            return {part.name: value for part, value in zip(self.parts, values)}
        return values[0]

    def of_parts(self, value: Any) -> list[Any]:
        r"""The inverse of `by_part`."""
        if self.keyed:
            return [value[part.name] for part in self.parts]
        return [value]

    def grads_like(self, params: Any) -> Any:
        r"""A tree shaped as the gradients the step returns, from one shaped as
        the parameters (each part's trainable part)."""
        return self.by_part([partition.split(params) for partition in self.partitions(params)])

    def optimizer_shardings(
        self,
        follow: Callable[..., Any],
        optimizer_state: Any,
        params: Any,
        param_shardings: Any,
        other: Any,
    ) -> Any:
        r"""The optimizer state's shardings, each part's following its parameters
        (`follow(optimizer, state, params, shardings, other)`)."""
        partitions = self.partitions(params)
        return self.by_part(
            [
                follow(
                    part.optimizer,
                    state,
                    partition.split(params),
                    partition.split(param_shardings),
                    other,
                )
                for part, partition, state in zip(
                    self.parts, partitions, self.of_parts(optimizer_state)
                )
            ]
        )

    # -- the model and the frozen models inside the step --------------------

    def bind(self, params: Any, model_state: Any, rngs: dict[str, jax.Array]) -> Any:
        r"""The model holding the step's variables (`.model`, `.outputs`, `.collected()`)."""
        if self._nnx is not None:
            carries = self.mutable_collections not in (False, None)
            return self._nnx.bind({"params": params, **model_state}, rngs, carries)
        if self.kind.several:
            return LinenModels(self._apply, params, model_state, rngs, self.mutable_collections)
        return LinenModel(self._apply, params, model_state, rngs, self.mutable_collections)


def lora_hint(objective: Objective) -> str | None:
    r"""For an NNX module holding `nnx.LoRAParam`s that every part trains
    whole (no `trainable`), the line that says so and how to train the
    LoRA parameters alone; `None` otherwise."""
    if objective._nnx is None or any(part.trainable is not None for part in objective.parts):
        return None
    from flax import nnx

    variables = jax.tree.leaves(
        objective._nnx.params_state, is_leaf=lambda leaf: isinstance(leaf, nnx.Variable)
    )
    lora = sum(v.size for v in variables if isinstance(v, nnx.LoRAParam))
    if not lora:
        return None
    total = sum(v.size for v in variables)
    return (
        f"The model holds {lora:,} LoRA parameters (nnx.LoRAParam) and every one of its "
        f"{total:,} parameters trains, the base too: pass TrainTask(..., trainable="
        "nnx.LoRAParam) to train the LoRA parameters alone."
    )
