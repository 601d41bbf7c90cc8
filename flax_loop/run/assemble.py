r"""Set-up: `TrainLoop`'s options checked once, then everything its first step needs.

In order: the options (`Options`, a frozen dataclass, validated when made);
the devices and the dispatch plan; the feed, whose first batch gives the
shapes; the model's layout; the initial state (the model's `init`, or the
newest checkpoint restored into `init`'s shapes); the state placed on the
devices; the compiled step; the interval closer. The result is a `Runner`.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainTask
>>> from flax_loop.run.assemble import Options, assemble
>>> def loss(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> data = [(np.ones((8, 4), np.float32), np.zeros(8, np.int32))] * 4
>>> runner = assemble(model.init, TrainTask(model.apply, optax.sgd(0.1), loss, data),
...                   jax.random.key(0), every=2, stdout=False)
>>> runner.step, runner.plan.dispatches()
(0, [('one', 1), ('last', 1)])
>>> Options(steps_per_dispatch=0)
Traceback (most recent call last):
...
flax_loop.errors.ConfigError: steps_per_dispatch must be >= 1; got 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flax_loop import distributed
from flax_loop.checkpoint import CheckpointFileReader, OrbaxCheckpointReader
from flax_loop.data.batch import Batch, BatchTree, normalize_batch, normalize_group
from flax_loop.data.feed import BatchFeed, DispatchPlan
from flax_loop.errors import ConfigError, FlaxLoopError, check_count
from flax_loop.log import console, is_main_process, log
from flax_loop.parallel import DATA_AXIS, Placement
from flax_loop.random import as_typed_key, labels_of, train_key
from flax_loop.run.initial import (
    InitFn,
    Reader,
    initial_state,
    parameter_annotations,
    placed,
    run_key,
    run_once,
    start_fields,
)
from flax_loop.run.interval import Intervals
from flax_loop.run.memory import check_fits, describe_model, format_plan, fullest
from flax_loop.run.preemption import DEFAULT_SIGNALS, PreemptionGuard
from flax_loop.run.profiling import ProfileSteps
from flax_loop.run.progress import ProgressReport
from flax_loop.run.runner import Runner
from flax_loop.run.throughput import (
    Throughput,
    TimeBreakdown,
    TokenCount,
    device_peak,
    tokens_per_batch,
)
from flax_loop.step.build import task_step
from flax_loop.step.compiled import CompiledSteps
from flax_loop.step.modules import DEFAULT_STREAM, as_init, is_nnx
from flax_loop.step.nonfinite import MODES as NONFINITE_MODES
from flax_loop.step.objective import Objective, StepInputs
from flax_loop.step.sharding import (
    DEFAULT_FSDP_MIN_BYTES,
    Sharding,
    check_sharding,
    chosen_sharding,
    is_replicated,
    state_shardings,
)
from flax_loop.step.state import TrainState
from flax_loop.step.statistics import counted
from flax_loop.task import TrainTask, check_train_task

DEFAULT_MUTABLE_COLLECTIONS: CollectionFilter = DenyList("intermediates")
r"""every collection but `intermediates` may change while training."""

Collections = Mapping[str, Sequence[str]]
r"""RNG collection names by use, e.g. `{"init": ["params"], "apply": ["dropout"]}`."""


@dataclasses.dataclass(frozen=True)
class Options:
    r"""`TrainLoop`'s keyword options (documented there), checked when made.

    Raises:
        ConfigError: naming the first invalid option.
    """

    nonfinite: str = "raise"
    progress: bool = False
    preemption_signals: Sequence[int] | None = None
    steps_per_dispatch: int = 1
    sharding: Sharding | None = None
    mesh: Mesh | None = None
    batch_axis: str = DATA_AXIS
    fsdp_min_bytes: int = DEFAULT_FSDP_MIN_BYTES
    ema_decay: float | None = None
    profile: ProfileSteps | None = None
    prefetch: int | None = None

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


def as_reader(init: InitFn | Reader) -> tuple[InitFn, Reader | None]:
    r"""The model's `init` function, and the reader to resume from, if any.

    Raises:
        ConfigError: if `init` is neither.
    """
    reader = init if isinstance(init, (CheckpointFileReader, OrbaxCheckpointReader)) else None
    init_fn = as_init(reader.target if reader is not None else init)
    if not callable(init_fn):
        raise ConfigError(
            f"init must be a model's init function or a CheckpointFileReader; got {init_fn!r}."
        )
    return init_fn, reader


def assemble(
    init: InitFn | Reader,
    task: TrainTask,
    rnkey: Any,
    input_sample: Any = None,
    every: int = 1,
    collections: Collections | None = None,
    mutable_collections: CollectionFilter = DEFAULT_MUTABLE_COLLECTIONS,
    devices: Sequence[Any] | None = None,
    stdout: bool = True,
    options: Options | None = None,
) -> Runner:
    r"""Sets up a run: `TrainLoop`'s arguments (`every` is
    `n_steps_per_checkpoint`) to the `Runner` of its first interval.

    Raises:
        ConfigError: for an invalid argument.
        BatchError: if the first batch has the wrong form.
        DataExhaustedError: if the data stream yields no batch.
        InitError: if `init` fails.
    """
    started = time.perf_counter()
    options = options or Options()
    task = check_train_task(task)
    init_fn, reader = as_reader(init)
    signals = options.preemption_signals
    guard = PreemptionGuard(DEFAULT_SIGNALS if signals is None else signals)
    report = None
    if options.progress and is_main_process():
        report = ProgressReport(console(), guard.notice)
        guard.quiet = report.live  # the bar shows a stop request in its line
    placement = Placement(devices, options.mesh, options.batch_axis)
    plan = DispatchPlan(every, options.steps_per_dispatch)
    apply_labels = labels_of(collections, "apply")
    if is_nnx(task.apply) and not apply_labels:
        apply_labels = [DEFAULT_STREAM]  # an NNX module's streams are reseeded
    objective = Objective.of(task, task.apply, apply_labels, mutable_collections)
    tree = None if objective.supervised else BatchTree()
    feed = BatchFeed(
        task.data,
        placement,
        options.steps_per_dispatch,
        options.prefetch,
        normalize=tree or normalize_batch,
    )
    objective.batch_tree = tree
    if not placement.multiprocess:  # several processes agree on a stop at checkpoints
        feed.give_up = lambda: guard.requested  # no wait for an unused read
    inputs = _init_inputs(input_sample, feed.sample, tree, is_nnx(task.apply))
    throughput = _throughput(feed, tree, placement, task.tokens)
    key = as_typed_key(rnkey)
    init_labels = labels_of(collections, "init")
    annotations = None
    if options.sharding == "model" or (options.sharding is None and options.mesh is not None):
        annotations = parameter_annotations(init_fn, key, inputs, init_labels, mutable_collections)
    sharding = chosen_sharding(options.sharding, annotations)

    sharded = not is_replicated(sharding)
    step_value = task_step(
        objective,
        placement.batch_axis if placement.n_devices > 1 or sharded else None,
        skip=options.nonfinite == "skip",
        shards=placement.batch_sharding if sharded else None,
        ema_decay=options.ema_decay,
        frozen=lambda params: objective.trained(params).frozen_mask(),
        transforms=getattr(task, "transforms", ()),
    )

    def shardings_of(state: TrainState) -> TrainState:
        return state_shardings(
            sharding,
            placement,
            state,
            objective,
            options.fsdp_min_bytes,
            annotations,
            step_value.fields,
        )

    def layout(fields: Any) -> Any:
        return shardings_of(TrainState.create(fields, 0)).fields

    start = initial_state(
        init_fn,
        objective,
        key,
        inputs,
        init_labels,
        mutable_collections,
        reader,
        layout,
        step_value,
    )
    if start.path is not None:
        key = run_key(start, key, stdout)
        feed.restore(start.data_state, stdout)
        log(f"Resumed from step {start.step} ({start.path}).", stdout=stdout)
    step = distributed.agree("the step to resume from", start.step)
    step_key: Any = placement.replicate(run_once(train_key, None, key))
    frozen = objective.frozen_arrays()
    if frozen is not None:  # beside the key: replicated, never donated
        step_key = StepInputs(step_key, placement.replicate(frozen))
    state, shardings = placed(
        start,
        step,
        start_fields(start, step_value),
        placement,
        shardings_of if sharded else None,
    )
    update = counted(step_value)
    try:
        steps = CompiledSteps(
            update, placement, state, feed.sample_batch, step_key, plan, shardings,
            objective.grads_like,
        )  # fmt: skip
    except Exception as error:  # say what the step was traced with
        if not isinstance(error, FlaxLoopError):
            error.add_note(
                "flax_loop: raised while tracing the training step (the model and "
                f"the loss) on the first batch: {feed.spec.describe()}."
            )
        raise
    if not placement.multiprocess:
        steps.interrupted = lambda: guard.interrupted
    trained_part = objective.trained(start.model_params)
    intervals = Intervals(
        steps,
        placement,
        feed,
        key,
        options.nonfinite == "raise",
        step,
        frozen=trained_part.frozen_mask(),
        mirrors_params=tuple(
            name for name, field in step_value.fields.items() if field.mirrors_params
        ),
    )
    if options.profile is not None:
        options.profile.stdout = stdout
    setup_seconds = time.perf_counter() - started
    runner = Runner(
        steps.state,
        step,
        step_key,
        steps,
        feed,
        plan,
        intervals,
        placement,
        guard,
        throughput,
        TimeBreakdown(setup_seconds, steps.compile_seconds),
        stdout,
        report,
        options.profile,
    )
    trained = trained_part.split(start.model_params)
    log(
        describe_model(start.model_params, placement.n_devices, setup_seconds, trained),
        stdout,
        lead="Model:",
        style="bold",
    )
    figures = runner.memory_plan()
    log(format_plan(fullest(figures)), stdout, lead="Memory:")
    check_fits(figures, placement.devices, fsdp=sharding == "fsdp")
    return runner


def _init_inputs(
    input_sample: Any, sample: Batch, tree: BatchTree | None, nnx_model: bool
) -> tuple[Any, ...]:
    r"""The inputs `init` is called with: `input_sample`, or the first batch's
    inputs (a batch of any structure has them if it is a pair `(inputs,
    targets)`; an NNX module needs none).

    Raises:
        ConfigError: if a linen model's inputs cannot be found.
    """
    if input_sample is not None:
        return normalize_group(input_sample, "input_sample")
    if tree is None:
        return sample[0]
    given = tree.unflatten(sample)
    if isinstance(given, (tuple, list)) and len(given) == 2:
        return normalize_group(given[0], "the first batch's inputs")
    if nnx_model:
        return ()
    raise ConfigError(
        "With compute_loss, the model is initialized with input_sample: pass "
        "TrainLoop(..., input_sample=x), x inputs of the model (a batch of them); "
        f"the first batch is {jax.tree.map(np.shape, given)}, not a pair (inputs, targets)."
    )


def _throughput(
    feed: BatchFeed, tree: BatchTree | None, placement: Placement, tokens: TokenCount | None
) -> Throughput:
    r"""A run's meter, from its feed's first batch (`tree`: its structure,
    for a `compute_loss` task) and its devices.

    Raises:
        ConfigError: for a `tokens` that fails.
    """
    sample = feed.sample
    if tree is None:
        inputs, targets = sample
        one_each = len(inputs) == len(targets) == 1
        given = (inputs[0], targets[0]) if one_each else (inputs, targets)
        first_input = inputs[0] if inputs else None
    else:
        given = tree.unflatten(sample)
        first_input = jax.tree.leaves(sample)[0]
    processes = placement.n_shards // max(placement.n_local_shards, 1)  # every process feeds
    counted = tokens_per_batch(tokens, given, first_input)
    return Throughput(
        examples_per_step=feed.spec.batch_size * processes,
        tokens_per_step=None if counted is None else counted * processes,
        n_devices=placement.n_devices,
        peak_flops=device_peak(placement.devices[0]),
    )
