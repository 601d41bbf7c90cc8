r"""Set-up: `TrainLoop`'s options checked once, then everything its first step needs.

In order: the options (`flax_loop.run.options.Options`, checked when made);
the devices and the dispatch plan; the feed, whose first batch gives the
shapes; the model's layout; the initial state (the model's `init`, or the
newest checkpoint restored into `init`'s shapes); the state placed on the
devices; the compiled step; the interval closer. The result is a `Runner`.

>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainTask
>>> from flax_loop.run.assemble import assemble
>>> def loss(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> model = nn.Dense(3)
>>> data = [(np.ones((8, 4), np.float32), np.zeros(8, np.int32))] * 4
>>> runner = assemble(model.init, TrainTask(model.apply, optax.sgd(0.1), loss, data),
...                   jax.random.key(0), every=2, stdout=False)
>>> runner.step, runner.plan.dispatches()
(0, [('one', 1), ('last', 1)])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax.core.scope import CollectionFilter

from flax_loop import distributed
from flax_loop.checkpoint import CheckpointFile
from flax_loop.data.batch import Batch, BatchTree, normalize_batch, normalize_group
from flax_loop.data.feed import BatchFeed, DispatchPlan
from flax_loop.data.source import NoData
from flax_loop.errors import ConfigError
from flax_loop.log import console, is_main_process, log
from flax_loop.parallel import Placement
from flax_loop.programs.compiled import CompiledSteps
from flax_loop.programs.state import TrainState
from flax_loop.random import as_typed_key, labels_of, train_key
from flax_loop.run import compile_cache, memory
from flax_loop.run.compiling import compiled_at_set_up
from flax_loop.run.initial import (
    InitFn,
    Reader,
    initial_state,
    placed,
    run_key,
    run_once,
    start_fields,
)
from flax_loop.run.interval import Intervals
from flax_loop.run.layout import StepLayout, batch_rows
from flax_loop.run.memory import check_fits, describe_model, format_plan, fullest
from flax_loop.run.options import (
    DEFAULT_MUTABLE_COLLECTIONS,
    Collections,
    Options,
    as_reader,
)
from flax_loop.run.preemption import DEFAULT_SIGNALS, PreemptionGuard
from flax_loop.run.progress import ProgressReport
from flax_loop.run.runner import Runner
from flax_loop.run.throughput import Throughput, TimeBreakdown, meter
from flax_loop.step.modules import DEFAULT_STREAM
from flax_loop.step.objective import Objective, StepInputs, lora_hint
from flax_loop.step.several import ModelKind
from flax_loop.task import TrainTask, check_train_task


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
    n_steps: int = 0,
    say: Callable[[str], None] = lambda what: None,  # each phase, as it starts
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
    compile_cache.use()  # before set-up compiles anything
    cache_hits = compile_cache.CacheHits()
    options = options or Options()
    task, kind = check_train_task(task)
    init_fn, reader = as_reader(init)
    guard, report = _guard_and_report(options, stdout)
    placement = Placement(devices, options.mesh, options.batch_axis)
    plan = DispatchPlan(every, options.steps_per_dispatch)
    say("reading the first batch")
    objective, tree, feed = _objective_and_feed(
        task, kind, options, placement, guard, collections, mutable_collections
    )
    inputs = _init_inputs(input_sample, feed.sample, tree, kind, task.data is not None)
    key = as_typed_key(rnkey)
    init_labels = labels_of(collections, "init")
    model = (init_fn, key, inputs, init_labels, mutable_collections)
    layout = StepLayout.of(options, placement, objective, task, model, batch_rows(feed.sample))
    say("initializing the model" if reader is None else "reading the newest checkpoint")
    start, key, step, step_key, state, shardings = _start(
        init_fn, reader, objective, layout, placement, feed, key, stdout, model,
        options.hyperparams == "file",
    )  # fmt: skip
    interrupted = None if placement.multiprocess else lambda: guard.interrupted
    finished = start.path is not None and 0 < n_steps <= step  # nothing left to train
    say("compiling the step")
    steps = compiled_at_set_up(
        layout, placement, state, feed, step_key, plan, shardings, objective, interrupted,
        finished, stdout,
    )  # fmt: skip
    trained_part = objective.trained(start.model_params)
    rates = meter(feed, tree, placement, task.tokens, task.examples)
    intervals = _intervals(steps, placement, feed, key, options, step, objective, layout, rates)
    intervals.caller_state.update(start.caller_state or {})  # a resumed run's
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
        TimeBreakdown(setup_seconds, steps.compile_seconds),
        stdout,
        report,
        options.profile,
        n_steps,
    )
    trained = trained_part.split(start.model_params)
    _say_set_up(runner, start.model_params, trained, setup_seconds, stdout, layout)
    _say_cached(cache_hits.count, stdout)
    _say_hint(lora_hint(objective), stdout)
    return runner


def _say_cached(count: int, stdout: bool) -> None:
    if count:
        folder = compile_cache.folder_in_use()
        log(f"{count} programs from the cache ({folder}).", stdout, lead="Compiled:")


def _guard_and_report(
    options: Options, stdout: bool
) -> tuple[PreemptionGuard, ProgressReport | None]:
    r"""The signal guard and, on the main process, the progress report: asked
    for (`progress=True`: a bar in a terminal, lines elsewhere), or by
    default a bar when the console is a terminal (not a notebook, not
    `stdout=False`). The bar shows a stop request in its line."""
    signals = options.preemption_signals
    guard = PreemptionGuard(DEFAULT_SIGNALS if signals is None else signals)
    report = None
    shown = options.progress
    if shown is None:
        shown = stdout and console().is_terminal and not console().is_jupyter
    if shown and is_main_process():
        report = ProgressReport(console(), guard.short_notice)
        guard.quiet = report.live
    return guard, report


def _objective_and_feed(
    task: TrainTask,
    kind: ModelKind,
    options: Options,
    placement: Placement,
    guard: PreemptionGuard,
    collections: Collections | None,
    mutable_collections: CollectionFilter,
) -> tuple[Objective, BatchTree | None, BatchFeed]:
    r"""What the step optimizes, the structure of a `compute_loss` task's
    batches, and the feed (its first batch read: the run's shapes)."""
    apply_labels = labels_of(collections, "apply")
    if kind.nnx and not apply_labels:
        apply_labels = [DEFAULT_STREAM]  # an NNX module's streams are reseeded
    tree = None if getattr(task, "loss", None) is not None else BatchTree()
    objective = Objective.of(task, kind, apply_labels, mutable_collections, tree)
    feed = BatchFeed(
        NoData(placement.n_local_shards) if task.data is None else task.data,
        placement,
        options.steps_per_dispatch,
        options.prefetch,
        normalize=tree or normalize_batch,
        # several processes agree on a stop at checkpoints; one gives up a read
        give_up=None if placement.multiprocess else lambda: guard.requested,
    )
    return objective, tree, feed


def _start(
    init_fn: InitFn,
    reader: Reader | None,
    objective: Objective,
    layout: StepLayout,
    placement: Placement,
    feed: BatchFeed,
    key: Any,
    stdout: bool,
    model: tuple[Any, ...],
    keep_hyperparams: bool = False,
) -> tuple[CheckpointFile, Any, int, Any, TrainState, TrainState | None]:
    r"""The state training starts from (the model's `init`, or the newest
    checkpoint of `reader`), the run's key, the step the processes agree on,
    the steps' key (with the frozen models' arrays), and the state placed
    on the devices with its shardings (`None` when replicated)."""
    _, _, inputs, init_labels, mutable_collections = model
    start = initial_state(
        init_fn,
        objective,
        key,
        inputs,
        init_labels,
        mutable_collections,
        reader,
        layout.fields_layout,
        layout.step,
        layout.program_key,
        keep_hyperparams=keep_hyperparams,
        fields_key=layout.fields_key,
    )
    # processes that built other models must not meet in a collective
    distributed.agree_on_structure("training states", start.arrays())
    if start.path is not None:
        key = run_key(start, key, stdout)
        feed.restore(start.data_state, stdout)
        log(f"Resumed from step {start.step:,} ({start.path}).", stdout=stdout)
    step = distributed.agree("the step to resume from", start.step)
    # made in place on one process (several place it after: `Placement.place`)
    made_in = None if placement.multiprocess else placement.replicated
    step_key: Any = placement.replicate(run_once(train_key, made_in, key, key="train key"))
    frozen = None if objective.frozen is None else objective.frozen.arrays()
    if frozen is not None:  # beside the key: replicated, never donated
        step_key = StepInputs(step_key, placement.replicate(frozen))
    state, shardings = placed(
        start,
        step,
        start_fields(start, layout.step),
        placement,
        layout.shardings_for,
    )
    return start, key, step, step_key, state, shardings


def _say_set_up(
    runner: Runner,
    params: Any,
    trained: Any,
    setup_seconds: float,
    stdout: bool,
    layout: StepLayout,
) -> None:
    r"""Set-up's "Model:" and "Memory:" lines; a `ConfigError` when the
    memory plan exceeds a device's. Neither shown nor checked (no line
    printed here, no device that says its limit), the plan is not made."""
    shown = stdout and is_main_process()
    if shown:
        model = describe_model(params, runner.placement.n_devices, setup_seconds, trained)
        log(model, stdout, lead="Model:", style="bold")
    devices = runner.placement.devices
    if not shown and all(memory.device_limit(device) is None for device in devices):
        return
    figures = runner.memory_plan()
    log(format_plan(fullest(figures)), stdout, lead="Memory:")
    check_fits(figures, devices, fsdp=layout.sharding == "fsdp")


def _intervals(
    steps: CompiledSteps,
    placement: Placement,
    feed: BatchFeed,
    key: Any,
    options: Options,
    step: int,
    objective: Objective,
    layout: StepLayout,
    rates: Throughput,
) -> Intervals:
    r"""The run's interval closer: what each checkpoint says of the task
    (the frozen parameters, the fields that mirror them, the optimizers'
    order) besides the state."""
    params = steps.state_shapes.model_params
    return Intervals(
        steps,
        placement,
        feed,
        key,
        options.nonfinite == "raise",
        step,
        rates,
        frozen=objective.trained(params).frozen_mask(),
        mirrors_params=tuple(
            name for name, field in layout.step.fields.items() if field.mirrors_params
        ),
        optimizer_names=(
            tuple(str(part.name) for part in objective.parts) if objective.keyed else None
        ),
    )


def _say_hint(hint: str | None, stdout: bool) -> None:
    if hint is not None:
        log(hint, stdout, lead="Note:", style="yellow")


def _init_inputs(
    input_sample: Any,
    sample: Batch,
    tree: BatchTree | None,
    kind: ModelKind,
    reads_data: bool = True,
) -> tuple[Any, ...]:
    r"""The inputs `init` is called with: `input_sample`, or the first batch's
    inputs (a batch of any structure has them if it is a pair `(inputs,
    targets)`; an NNX module needs none; several linen models take a dict
    of each one's inputs).

    Raises:
        ConfigError: if a linen model's inputs cannot be found.
    """
    nnx_model = kind.nnx
    if kind.several and not nnx_model:
        if not isinstance(input_sample, Mapping):
            raise ConfigError(
                f"Several linen models are initialized each with its own inputs: pass "
                f"TrainLoop(..., input_sample={{name: inputs}}) for {list(kind.names or ())}; got "
                f"input_sample={type(input_sample).__name__}."
            )
        return (
            {
                name: normalize_group(x, f"input_sample[{name!r}]")
                for name, x in input_sample.items()
            },
        )
    if isinstance(input_sample, (int, float)) and not isinstance(input_sample, bool):
        raise ConfigError(
            f"input_sample is the number {input_sample!r}: TrainLoop's positional "
            "arguments are (init, task, rnkey, input_sample, n_steps_per_checkpoint, "
            "n_steps), flax-extra's order. Pass the counts by name: TrainLoop(init, task, "
            "rnkey, n_steps=..., n_steps_per_checkpoint=...)."
        )
    if input_sample is not None:
        return normalize_group(input_sample, "input_sample")
    if tree is None:
        return sample[0]
    given = tree.unflatten(sample)
    if isinstance(given, (tuple, list)) and len(given) == 2:
        return normalize_group(given[0], "the first batch's inputs")
    if nnx_model:
        return ()
    if not reads_data:
        raise ConfigError(
            "A step that reads no data (TrainTask(data=None)) has no batch to initialize "
            "the model with: pass TrainLoop(..., input_sample=x), x inputs of the model "
            "(a batch of them, such as np.zeros((1, 4), np.float32))."
        )
    raise ConfigError(
        "With compute_loss, the model is initialized with input_sample: pass "
        "TrainLoop(..., input_sample=x), x inputs of the model (a batch of them); "
        f"the first batch is {jax.tree.map(np.shape, given)}, not a pair (inputs, targets)."
    )
