r"""The state training starts from: a model's `init`, or a checkpoint file.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> model, x = nn.Dense(3), np.ones((8, 4), np.float32)
>>> start = initial_state(model.init, optax.sgd(0.1), jax.random.key(0), (x,),
...                       init_labels=["params"], mutable_collections=True)
>>> start.step, start.path is None
(0, True)
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax.core import meta, unfreeze
from flax.core.scope import CollectionFilter, DenyList

from flax_loop.checkpoint import (
    CheckpointFile,
    CheckpointFileReader,
    OrbaxCheckpointReader,
    Saved,
    put_back,
    taken_from,
)
from flax_loop.errors import CheckpointMismatchError, ConfigError, FlaxLoopError, InitError
from flax_loop.log import log
from flax_loop.parallel import Placement
from flax_loop.programs import cache
from flax_loop.programs.cache import identity, signature
from flax_loop.programs.once import run_once
from flax_loop.programs.sharding import linen_annotations
from flax_loop.programs.state import TrainState
from flax_loop.random import init_key, into_collection, same_key
from flax_loop.run.hand import with_task_hyperparams
from flax_loop.step.core import CORE, Fields, Step
from flax_loop.step.model import SOWN
from flax_loop.step.modules import NNXModel
from flax_loop.step.objective import Objective

InitFn = Callable[..., Any]
r"""A model's `init(rngs, *inputs, mutable=...) -> variables` (linen's)."""

Reader = CheckpointFileReader | OrbaxCheckpointReader
r"""Where a resumed loop reads its state from."""

Layout = Callable[[Fields], Fields]
r"""`layout(fields) -> their shardings`; the carried fields' (`flax_loop.step.core`)."""


def run_key(start: CheckpointFile, given: jax.Array, stdout: bool) -> jax.Array:
    r"""The run's key: the one stored in the file resumed from, so that the
    run stays one random stream (saying so when it differs from `given`)."""
    if start.rnkey is None:
        return given
    if not same_key(start.rnkey, given):
        log(
            "The checkpoint's run key differs from rnkey: training continues with "
            "the checkpoint's, so that the run stays one random stream.",
            stdout=stdout,
        )
    return start.rnkey


def placed(
    start: Saved,
    step: int,
    fields: Fields,
    placement: Placement,
    shardings_of: Callable[[TrainState], TrainState | None] | None = None,
) -> tuple[TrainState, TrainState | None]:
    r"""The state the first step takes, on the devices, at `step`.

    Args:
        start: the saved state to start from.
        step: the step the processes agreed to start from.
        fields: every field the step carries, as `start` has them
            (`start_fields`).
        placement: the devices.
        shardings_of: the state's layout, given the state (`None`: every
            leaf replicated); `None` replicates it over the devices.

    Returns:
        the state, and its shardings (`None` when replicated).
    """
    created = TrainState.create(fields, step)
    shardings = None if shardings_of is None else shardings_of(created)
    if shardings is None:
        # the host's arrays (a file's, the counters) stay there on one process:
        # the packing program's call transfers them (`Variants._packed`)
        return placement.replicate(created, keep_host=not placement.multiprocess), None
    return placement.place(created, shardings), shardings


def start_fields(start: Saved, step: Step) -> Fields:
    r"""Every field `step` carries, from the saved state to start from: its
    own, and those it declares but `start` lacks (a moving average a resumed
    run starts keeping) from the step's `init`."""
    fields = step.init({name: getattr(start, name) for name in CORE})
    held = {name: tree for name, tree in start.carried.items() if tree is not None}
    return {name: held.get(name, tree) for name, tree in fields.items()}


def initial_state(
    init: InitFn,
    optimizer: optax.GradientTransformation | Objective,
    rnkey: jax.Array,
    inputs: tuple[Any, ...],
    init_labels: Sequence[str],
    mutable_collections: CollectionFilter,
    reader: Reader | None = None,
    layout: Layout | None = None,
    step: Step | None = None,
    program_key: Hashable | None = None,
    keep_hyperparams: bool = False,
    fields_key: Hashable | None = None,
) -> CheckpointFile:
    r"""The newest file of `reader`'s directory, or a fresh initialization at
    step 0 (a `CheckpointFile` whose `path` is `None`).

    Resuming never runs the model's `init`: the file is restored into the
    shapes and dtypes `init` would give (`jax.eval_shape`). With a `layout`
    (the shardings of the step's fields, given their shapes), a fresh state
    is created in it and a reader that can restores into it directly. The
    fields `step` declares are restored when the file holds them.

    Raises:
        InitError: if `init` fails or returns no `params`.
        ConfigError: if the optimizer cannot be initialized.
        CheckpointError: if the directory's files cannot be used.
    """

    def start(rnkey: jax.Array, *inputs: Any) -> tuple[Any, Any, Any]:
        key = init_key(rnkey)  # derived in the program: no key op compiled apart
        params, model_state = initialize_model(init, key, inputs, init_labels, mutable_collections)
        return params, model_state, _init_optimizer(optimizer, params)

    key = _init_key(init, init_labels, mutable_collections, program_key)
    signed = None if key is None else signature((rnkey, *inputs))
    core = cache.compiled(  # a re-run traces nothing: the shapes are known
        None if key is None else ("init shapes", key, signed),
        lambda: _guarded(lambda: jax.eval_shape(start, rnkey, *inputs), init, inputs, init_labels),
    )
    shapes, shardings = _laid_out(dict(zip(CORE, core)), step, layout, fields_key)
    # In one process the state is created in its layout (never whole on one
    # device); several processes create it on their own and place it later.
    place = None
    if shardings is not None and jax.process_count() == 1:
        place = tuple(shardings[name] for name in CORE)
    if reader is not None:
        restored = reader.restore(
            CheckpointFile(
                **{name: shapes[name] for name in CORE},
                step=0,
                carried={name: tree for name, tree in shapes.items() if name not in CORE},
            )
        )
        if restored is not None and restored.left_out is not None:
            restored = _put_back_frozen(restored, lambda: run_once(start, place, rnkey, *inputs)[0])
        if restored is not None and restored.optimizer_state is None:
            initialize = lambda: run_once(start, place, rnkey, *inputs)  # noqa: E731
            return _from_parameters(
                restored, optimizer, place, initialize, init, inputs, init_labels
            )
        if restored is not None:
            restored = dataclasses.replace(restored, step=int(restored.step))
            _check_optimizer_order(restored, optimizer)
            return with_task_hyperparams(restored, optimizer, keep_hyperparams)
    params, model_state, optimizer_state = _guarded(
        lambda: run_once(start, place, rnkey, *inputs, key=key, signed=signed),
        init,
        inputs,
        init_labels,
    )
    return CheckpointFile(params, model_state, optimizer_state, step=0)


def _init_key(
    init: InitFn,
    labels: Sequence[str],
    mutable_collections: CollectionFilter,
    program_key: Hashable | None,
) -> Hashable | None:
    r"""What determines the initialization's program and shapes: a linen init
    by identity, with the labels and the optimizers of the program key; `None`
    for an NNX module, whose init returns its own values (constants of the
    program): compiled each time."""
    if program_key is None or isinstance(getattr(init, "__self__", None), NNXModel):
        return None
    return ("init", identity(init), tuple(labels), identity(mutable_collections), program_key)


def _laid_out(
    shapes: Fields, step: Step | None, layout: Layout | None, key: Hashable | None = None
) -> tuple[Any, Any]:
    r"""The shapes of the step's fields (its `init` of the core `shapes`; a
    re-run finds them by the step's fields `key`, `StepLayout.fields_key`),
    each with its sharding, and those shardings (`None` without a layout)."""
    if step is not None:
        core, init = shapes, step.init
        key = None if key is None else ("fields shapes", key, signature(core))
        shapes = cache.compiled(key, lambda: jax.eval_shape(init, core))
    shardings = None if layout is None else layout(shapes)
    if shardings is not None:
        shapes = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            shapes,
            shardings,
        )
    return shapes, shardings


def _from_parameters(
    restored: CheckpointFile,
    optimizer: Any,
    place: Any,
    initialize: Callable[[], Any],
    init: InitFn,
    inputs: tuple[Any, ...],
    init_labels: Sequence[str],
) -> CheckpointFile:
    r"""A start at step 0 from a directory of parameters only: the model
    state of the run's initialization, a new optimizer state."""
    log(f"Training starts from the parameters in {restored.path}.")
    params = restored.model_params
    _, model_state, _ = _guarded(initialize, init, inputs, init_labels)
    optimizer_state = run_once(
        functools.partial(_init_optimizer, optimizer),
        None if place is None else place[2],
        params,
    )
    return CheckpointFile(params, model_state, optimizer_state, step=0)


def _check_optimizer_order(restored: CheckpointFile, optimizer: Any) -> None:
    r"""A `CheckpointMismatchError` when the file's optimizers ran in another
    order than the task's (the step would run another algorithm)."""
    parts = getattr(optimizer, "parts", None)
    if parts is None or restored.optimizer_names is None or not optimizer.keyed:
        return
    names = tuple(part.name for part in parts)
    if names != restored.optimizer_names:
        raise CheckpointMismatchError(
            f"{restored.path} was written by a step that ran its optimizers in the order "
            f"{list(restored.optimizer_names)}; the task runs {list(names)}. A step runs "
            "them in the dict's order: give task.optimizer (and compute_loss, "
            "trainable) in the file's order, or start a new directory."
        )


def _put_back_frozen(restored: CheckpointFile, initialize: Callable[[], Any]) -> CheckpointFile:
    r"""A file without its frozen parameters, completed by the run's
    initialization (checked against the file's digest of them)."""
    assert restored.left_out is not None
    values = taken_from(restored.left_out, initialize(), restored.path or "The checkpoint")
    arrays = restored.arrays()
    # the parameters, and the fields that mirror them (a frozen parameter's
    # average is the parameter)
    return restored.with_arrays(
        {
            name: put_back(arrays[name], values)
            for name in restored.left_out.fields
            if arrays.get(name) is not None
        }
    )


def _guarded(
    run: Callable[[], Any], init: InitFn, inputs: tuple[Any, ...], labels: Sequence[str]
) -> Any:
    try:
        return run()
    except FlaxLoopError:
        raise
    except Exception as error:
        raise InitError(
            f"init raised {type(error).__name__}: {error}. It was called with "
            f"inputs of shapes {[tuple(np.shape(x)) for x in inputs]} and RNG "
            f"collections {list(labels)}; check the model against the data "
            "(or pass input_sample)."
        ) from error


def parameter_annotations(
    init: InitFn,
    rnkey: jax.Array,
    inputs: tuple[Any, ...],
    labels: Sequence[str],
    mutable_collections: CollectionFilter,
) -> Any:
    r"""The `PartitionSpec` each parameter's annotation asks for (a tree of
    the parameters' structure), or `None` if the model annotates none.

    An NNX module's are read from its variables; a linen `init` is traced
    (`jax.eval_shape`, nothing computed) for its `nn.Partitioned` boxes.

    Raises:
        InitError: if `init` fails.
    """
    module = getattr(init, "__self__", None)
    if isinstance(module, NNXModel):
        return module.annotations()

    def boxed(rnkey: jax.Array, *inputs: Any) -> Any:
        return _variables(init, init_key(rnkey), inputs, labels, mutable_collections)["params"]

    params = _guarded(lambda: jax.eval_shape(boxed, rnkey, *inputs), init, inputs, labels)
    return linen_annotations(params)


def _variables(
    init: InitFn,
    key: jax.Array,
    inputs: tuple[Any, ...],
    labels: Sequence[str],
    mutable_collections: CollectionFilter,
) -> dict[str, Any]:
    r"""The model's variables as its `init` returns them (annotated
    parameters in their boxes).

    `init` creates every collection the model makes: those training may
    change (`mutable_collections`) and those it only reads (a BatchNorm's
    statistics with `mutable_collections=False`). Only `True` and a deny
    list are passed as they are; anything narrower (`False`, a list) would
    leave `params` uncreated, so every collection but `intermediates` is.
    """
    if mutable_collections is not True and not isinstance(mutable_collections, DenyList):
        mutable_collections = DenyList("intermediates")
    variables = init(into_collection(key, labels), *inputs, mutable=mutable_collections)
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise InitError(
            f"init must return variables with a 'params' collection (as a linen "
            f"Module's init does); got {type(variables).__name__} "
            f"{list(variables) if isinstance(variables, Mapping) else ''}."
        )
    return unfreeze(variables)  # type: ignore[arg-type]


def initialize_model(
    init: InitFn,
    key: jax.Array,
    inputs: tuple[Any, ...],
    labels: Sequence[str],
    mutable_collections: CollectionFilter,
) -> tuple[Any, Any]:
    r"""Runs the model's init and splits params from the other collections,
    without the annotations' boxes (`parameter_annotations` reads those)."""
    variables = meta.unbox(_variables(init, key, inputs, labels, mutable_collections))
    variables.pop(SOWN, None)  # sown values are outputs, never state
    params = variables.pop("params")
    return params, variables


def _init_optimizer(optimizer: Any, params: Any) -> Any:
    r"""The optimizer state of `params`: an `optax.GradientTransformation`'s,
    or an `Objective`'s (each part's over its trainable parameters)."""
    init_optimizer = getattr(optimizer, "init_optimizer", None)
    if init_optimizer is not None:
        return init_optimizer(params)
    try:
        return optimizer.init(params)
    except Exception as error:
        raise ConfigError(
            f"task.optimizer.init failed with {type(error).__name__}: {error}. "
            "Pass an optax.GradientTransformation such as optax.adam(1e-3)."
        ) from error
