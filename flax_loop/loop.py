r"""`TrainLoop`: the iterator that trains and yields checkpoints.

Cadence: a checkpoint comes at every multiple of `n_steps_per_checkpoint`
and at the last step. With `n_steps=10, n_steps_per_checkpoint=3`, iteration
yields checkpoints at steps 3, 6, 9 and 10:

>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                  n_steps=10, n_steps_per_checkpoint=3, stdout=False)
>>> [checkpoint.step for checkpoint in loop]
[3, 6, 9, 10]

In a notebook, `loop.next_checkpoint()` runs to the next multiple (or to
`n_steps` if that comes first), `loop.next_step()` runs one step, and
`loop.run(n)` yields the checkpoints up to step `n`; none of them changes
`loop.n_steps`:

>>> loop.next_step().step, loop.next_checkpoint().step, loop.n_steps
(11, 12, 10)
"""

from __future__ import annotations  # help(TrainLoop) shows the short type names

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flax_loop import distributed, memory
from flax_loop.batch import Batch, BatchTree, normalize_batch, normalize_group
from flax_loop.checkpoint import Checkpoint, CheckpointFileReader, OrbaxCheckpointReader, Saved
from flax_loop.compiled import CompiledSteps
from flax_loop.console import describe_model
from flax_loop.errors import (
    ConfigError,
    DataExhaustedError,
    FlaxLoopError,
    StateLostError,
    check_count,
)
from flax_loop.feed import BatchFeed
from flax_loop.initial import (
    InitFn,
    Reader,
    initial_state,
    parameter_annotations,
    placed,
    run_key,
    run_once,
)
from flax_loop.interval import Intervals
from flax_loop.log import console, is_main_process, log
from flax_loop.memory import check_fits, dispatch_batch, format_plan, fullest
from flax_loop.modules import DEFAULT_STREAM, as_init, is_nnx
from flax_loop.objective import Objective, StepInputs
from flax_loop.parallel import DATA_AXIS, InFlight, Placement
from flax_loop.plan import DispatchPlan
from flax_loop.preemption import DEFAULT_SIGNALS, PreemptionGuard
from flax_loop.profiling import ProfileSteps
from flax_loop.progress import ProgressReport
from flax_loop.random import as_typed_key, labels_of, train_key
from flax_loop.sharding import (
    DEFAULT_FSDP_MIN_BYTES,
    Sharding,
    check_sharding,
    chosen_sharding,
    is_replicated,
    state_shardings,
)
from flax_loop.state import TrainState
from flax_loop.step import NONFINITE_MODES, build_step
from flax_loop.task import TrainTask, check_train_task
from flax_loop.throughput import Throughput
from flax_loop.timing import TimeBreakdown, describe

MAX_STEPS = 2**31 - 1
r"""The largest step number: the step counter on the devices is an int32."""

DEFAULT_MUTABLE_COLLECTIONS: CollectionFilter = DenyList("intermediates")
r"""every collection but `intermediates` may change while training."""

Collections = Mapping[str, Sequence[str]]
r"""RNG collection names by use, e.g. `{"init": ["params"], "apply": ["dropout"]}`."""


class TrainLoop:
    r"""Trains a model and yields a `Checkpoint` every `n_steps_per_checkpoint` steps.

    `n_steps` is the total to train to, counted from step 0 (a resumed loop
    trains up to the same total). The model is `init(rngs, *inputs,
    mutable=...) -> variables` and `task.apply(variables, *inputs, rngs=...,
    mutable=...)` (a linen module's `init` and `apply`), or an `nnx.Module`
    given as both `init` and `task.apply` (it is never changed: put a
    checkpoint back with `nnx.update(model, checkpoint.model_params,
    checkpoint.model_state)`).

    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                  n_steps=4, n_steps_per_checkpoint=2, stdout=False)
    >>> for checkpoint in loop:
    ...     print(checkpoint.step, checkpoint.n_completed_steps)
    2 2
    4 2

    Resume from the newest checkpoint file of a directory, or start afresh
    when it holds none: `init=CheckpointFileReader(dir="ckpts", target=model.init)`.

    Args:
        init: the model's `init` function or NNX module, or a `CheckpointFileReader`
            (or `OrbaxCheckpointReader`) to resume from its newest checkpoint
            (its `target` initializes the model when the directory holds none).
        task: what to train: apply, optimizer, loss and data.
        rnkey: the run's key, `jax.random.key(seed)` or `PRNGKey(seed)`.
        input_sample: inputs to initialize the model with; by default the
            first batch's inputs (that batch is still trained on).
        n_steps_per_checkpoint: steps between checkpoints.
        n_steps: the total number of steps to train, counted from step 0.
        collections: RNG collection names; keys for "apply" are derived on
            the devices from `rnkey`, the step and the device index.
        mutable_collections: the collections the model may change while
            training (e.g. `batch_stats`).
        devices: the devices to train on; all of them by default.
        stdout: whether to print the model's size, the set-up time and notes.
        nonfinite: what a NaN or infinite loss or gradient does: "raise" (a
            `NonFiniteError` naming the first bad step, raised at the next
            checkpoint) or "skip" (that step's update is not applied).
        progress: whether to show a progress bar (step, steps/s, ETA, the
            latest checkpoint's loss); plain lines when stdout is not a
            terminal. It never waits for the devices.
        preemption_signals: signals that make the loop finish the current
            step, yield a checkpoint marked `preempted` and stop (SIGTERM and
            SIGINT with the default, None; `()` to disable).
        steps_per_dispatch: steps per compiled call (a `jax.lax.scan` over
            stacked batches), for models so small that dispatching a step
            costs more than computing it. Checkpoints keep their steps: an
            interval's last steps (what remains of `n_steps_per_checkpoint`
            after whole dispatches) run in one call that also closes it.
        sharding: where the parameters and optimizer state live:
            "replicated" (every device holds them), "fsdp" (leaves of at
            least `fsdp_min_bytes` split along their largest dimension the
            device count divides), "model" (as the model annotates them:
            `nnx.with_partitioning`, linen's `nn.with_partitioning` or
            `nn.with_logical_partitioning`, logical names translated by the
            `nn.logical_axis_rules` in force around this call), or
            `rule(path, leaf) -> PartitionSpec` over the parameters (the
            optimizer state follows). The default, None, is "model" when a
            `mesh` is given and the model is annotated, else "replicated".
            Checkpoints keep the layout.
        mesh: a `jax.sharding.Mesh` to train on instead of `devices`: the
            batch is split along its `batch_axis`; annotations and rules may
            use the other axes, e.g. "model" for tensor parallelism.
        batch_axis: the mesh axis the batch is split along (and gradients
            averaged over): "data" by default, e.g. "batch" for a
            `("batch", "model")` mesh. A model's own collectives name it
            (`nn.BatchNorm(axis_name=...)`).
        fsdp_min_bytes: with "fsdp", leaves smaller than this stay replicated.
        ema_decay: keep an exponential moving average of the parameters,
            updated in the compiled step (`ema = ema_decay * ema + (1 -
            ema_decay) * params`, starting at the parameters), returned as
            `Checkpoint.ema_params` and saved in checkpoints; `EvalLoop(...,
            use_ema=True)` evaluates it. It has the parameters' dtype: keep
            float32 parameters with a decay near 1 (in bfloat16 the small
            updates are partly rounded away).
        profile: a `ProfileSteps` window of steps to trace with `jax.profiler`.
        prefetch: batches a background thread reads ahead of the devices
            (a slow source then reads while they compute; each checkpoint
            still saves the data state after its last trained batch): `0`
            reads inline, `N` starts the thread at once; the default, None,
            uses one if the source's first reads took 0.2 ms or more each.

    Raises:
        ConfigError: for an invalid argument.
        BatchError: if the first batch has the wrong form.
        DataExhaustedError: if the data stream yields no batch.
        InitError: if `init` fails.
    """

    def __init__(
        self,
        init: InitFn | Reader,
        task: TrainTask,
        rnkey: Any,
        input_sample: Any = None,
        n_steps_per_checkpoint: int = 1,
        n_steps: int = 0,
        collections: Collections | None = None,
        mutable_collections: CollectionFilter = DEFAULT_MUTABLE_COLLECTIONS,
        devices: Sequence[Any] | None = None,
        stdout: bool = True,
        *,
        nonfinite: str = "raise",
        progress: bool = False,
        preemption_signals: Sequence[int] | None = None,
        steps_per_dispatch: int = 1,
        sharding: Sharding | None = None,
        mesh: Mesh | None = None,
        batch_axis: str = DATA_AXIS,
        fsdp_min_bytes: int = DEFAULT_FSDP_MIN_BYTES,
        ema_decay: float | None = None,
        profile: ProfileSteps | None = None,
        prefetch: int | None = None,
    ) -> None:
        with distributed.failing_together():
            started = time.perf_counter()
            self.n_steps = n_steps
            self.n_steps_per_checkpoint = n_steps_per_checkpoint
            steps_per_dispatch = check_count("steps_per_dispatch", steps_per_dispatch, 1)
            if nonfinite not in NONFINITE_MODES:
                raise ConfigError(f"nonfinite must be one of {NONFINITE_MODES}; got {nonfinite!r}.")
            task = check_train_task(task)
            reader = (
                init if isinstance(init, (CheckpointFileReader, OrbaxCheckpointReader)) else None
            )
            init_fn = as_init(reader.target if reader is not None else init)
            if not callable(init_fn):
                raise ConfigError(
                    f"init must be a model's init function or a CheckpointFileReader; "
                    f"got {init_fn!r}."
                )
            self._stdout = stdout
            self._lost: str | None = None  # why the loop cannot go on (an interrupt)
            if profile is not None and not isinstance(profile, ProfileSteps):
                raise ConfigError(
                    f"profile must be a ProfileSteps(start=..., n=..., log_dir=...); "
                    f"got {profile!r}."
                )
            self.profile = profile
            r"""the window of steps traced, if any (its `traced_steps`)."""
            self._guard = PreemptionGuard(
                DEFAULT_SIGNALS if preemption_signals is None else preemption_signals
            )
            self._report = ProgressReport(console()) if progress and is_main_process() else None
            sharding = check_sharding(sharding)
            fsdp_min_bytes = check_count("fsdp_min_bytes", fsdp_min_bytes, 0)
            if ema_decay is not None and not (
                isinstance(ema_decay, (int, float)) and 0 < ema_decay < 1
            ):
                raise ConfigError(
                    f"ema_decay must be a number between 0 and 1 (e.g. 0.999), or None "
                    f"for no moving average; got {ema_decay!r}."
                )
            if prefetch is not None:
                prefetch = check_count("prefetch", prefetch, 0)
            self._placement = placement = Placement(devices, mesh, batch_axis)
            self._steps_per_dispatch = steps_per_dispatch
            self._plan = DispatchPlan(self._n_steps_per_checkpoint, steps_per_dispatch)
            apply_labels = labels_of(collections, "apply")
            if is_nnx(task.apply) and not apply_labels:
                apply_labels = [DEFAULT_STREAM]  # an NNX module's streams are reseeded
            objective = Objective.of(task, task.apply, apply_labels, mutable_collections)
            tree = None if objective.supervised else BatchTree()
            self._feed = BatchFeed(
                task.data,
                placement,
                steps_per_dispatch,
                prefetch,
                normalize=tree or normalize_batch,
            )
            objective.batch_tree = tree
            if not placement.multiprocess:  # several processes agree on a stop at checkpoints
                guard = self._guard
                self._feed.give_up = lambda: guard.requested  # no wait for an unused read
            inputs = _init_inputs(input_sample, self._feed.sample, tree, is_nnx(task.apply))
            self._throughput = Throughput.of(self._feed, tree, placement, task.tokens)
            key = as_typed_key(rnkey)
            annotations = None
            if sharding == "model" or (sharding is None and mesh is not None):
                annotations = parameter_annotations(
                    init_fn, key, inputs, labels_of(collections, "init"), mutable_collections
                )
            sharding = chosen_sharding(sharding, annotations)

            def shardings_of(state: TrainState) -> TrainState:
                return state_shardings(
                    sharding, placement, state, objective, fsdp_min_bytes, annotations
                )

            def layout(params: Any, model_state: Any, optimizer_state: Any) -> Any:
                laid = shardings_of(TrainState.create(params, model_state, optimizer_state, 0))
                return laid.model_params, laid.model_state, laid.optimizer_state

            start = initial_state(
                init_fn,
                objective,
                key,
                inputs,
                labels_of(collections, "init"),
                mutable_collections,
                reader,
                layout,
                ema=ema_decay is not None,
            )
            if start.path is not None:
                key = run_key(start, key, stdout)
                self._feed.restore(start.data_state, stdout)
                log(f"Resumed from step {start.step} ({start.path}).", stdout=stdout)
            self._step = distributed.agree("the step to resume from", start.step)
            self._train_key = placement.replicate(run_once(train_key, None, key))
            frozen = objective.frozen_arrays()
            if frozen is not None:  # beside the key: replicated, never donated
                self._train_key = StepInputs(self._train_key, placement.replicate(frozen))
            self._state, shardings = placed(
                start,
                self._step,
                ema_decay is not None,
                placement,
                None if is_replicated(sharding) else shardings_of,
            )
            update = build_step(
                objective,
                placement.batch_axis if placement.n_devices > 1 or shardings is not None else None,
                skip_nonfinite=nonfinite == "skip",
                shards=None if shardings is None else placement.batch_sharding,
                ema_decay=ema_decay,
            )
            try:
                self._steps = CompiledSteps(
                    update,
                    placement,
                    self._state,
                    self._feed.sample_batch,
                    self._train_key,
                    self._plan,
                    shardings,
                    objective.grads_like,
                )
            except Exception as error:  # say what the step was traced with
                if not isinstance(error, FlaxLoopError):
                    error.add_note(
                        "flax_loop: raised while tracing the training step (the model and "
                        f"the loss) on the first batch: {self._feed.spec.describe()}."
                    )
                raise
            self._state = self._steps.state
            if not placement.multiprocess:
                self._steps.interrupted = lambda: guard.interrupted
            trained_part = objective.trained(start.model_params)
            self._intervals = Intervals(
                self._steps,
                placement,
                self._feed,
                key,
                nonfinite == "raise",
                self._step,
                frozen=trained_part.frozen_mask(),
            )
            setup_seconds = time.perf_counter() - started
            trained = trained_part.split(start.model_params)
            log(
                describe_model(start.model_params, placement.n_devices, setup_seconds, trained),
                stdout,
                lead="Model:",
                style="bold",
            )
            figures = self.memory_plan()
            log(format_plan(fullest(figures)), stdout, lead="Memory:")
            check_fits(figures, placement.devices, fsdp=sharding == "fsdp")
            # the caller's code runs from here
            self._times = TimeBreakdown(setup_seconds, self._steps.compile_seconds)

    @property
    def step(self) -> int:
        r"""the number of completed steps."""
        return self._step

    def memory_plan(self) -> dict[str, Any]:
        r"""The bytes each device holds while training (`flax_loop.memory`):
        `params` (with `model_state` apart), `optimizer_state`, `ema`, a
        dispatch's `batch`, the compiled step's `temporaries` (XLA's memory
        analysis of the programs compiled so far), the `checkpoint` copy of
        the saved state, and their `total`. One dict when every device holds
        the same, else a dict of them by device. Set-up prints it with
        `stdout=True`, and raises a `ConfigError` when it exceeds a device's
        memory (where the device says how much it has: GPUs, TPUs)."""
        shapes = self._steps.state_shapes
        placement = self._placement
        return memory.plan(
            {name: getattr(shapes, name) for name in Saved.ARRAYS},
            dispatch_batch(self._feed.sample, self._plan.steps_per_dispatch, placement),
            self._steps.programs.values(),
            placement.devices,
        )

    @property
    def time_breakdown(self) -> dict[str, float]:
        r"""where the run's time went so far, in seconds: `setup` (without
        its compiling), `compile`, `data`, `device`, `caller` (your code
        between checkpoints) and `wall`; each checkpoint's `time_breakdown`
        holds its interval's (`flax_loop.timing`)."""
        return self._times.totals()

    @property
    def peak_flops(self) -> float | None:
        r"""one device's peak FLOP/s, for `Checkpoint.throughput`'s `mfu`:
        looked up by the device's kind (recent GPUs and TPUs,
        `flax_loop.throughput.PEAK_FLOPS`), or set (`loop.peak_flops =
        989e12`); `None` when unknown."""
        return self._throughput.peak_flops

    @peak_flops.setter
    def peak_flops(self, value: float | None) -> None:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
        ):
            raise ConfigError(
                f"peak_flops must be one device's peak FLOP/s, a positive number such as "
                f"989e12, or None; got {value!r}."
            )
        self._throughput.peak_flops = value

    @property
    def n_steps(self) -> int:
        r"""the total number of steps the loop trains to."""
        return self._n_steps

    @n_steps.setter
    def n_steps(self, value: int) -> None:
        self._n_steps = check_count("n_steps", value, 0, MAX_STEPS)

    @property
    def n_steps_per_checkpoint(self) -> int:
        r"""the number of steps between checkpoints."""
        return self._n_steps_per_checkpoint

    @n_steps_per_checkpoint.setter
    def n_steps_per_checkpoint(self, value: int) -> None:
        r"""A new cadence takes effect from the next interval (its variants
        compile when first called)."""
        self._n_steps_per_checkpoint = check_count("n_steps_per_checkpoint", value, 1, MAX_STEPS)
        if hasattr(self, "_steps"):  # set-up done: the plan follows the cadence
            self._plan = DispatchPlan(self._n_steps_per_checkpoint, self._steps_per_dispatch)
            self._steps.follow(self._plan)

    @property
    def compiled(self) -> CompiledSteps:
        r"""The compiled variants of the step (`compiled.programs` by name,
        `compiled.wait()` for those compiling in the background): for tests
        and benchmarks, which time or count them."""
        return self._steps

    @property
    def devices(self) -> list[Any]:
        r"""the devices the loop trains on."""
        return list(self._placement.devices)

    def __iter__(self) -> Iterator[Checkpoint]:
        self._check_n_steps()
        return self._run(target=None)

    def _check_n_steps(self) -> None:
        if self._n_steps == 0 and self._step == 0:
            raise ConfigError(
                "n_steps is 0 (its default), so iterating the loop would train nothing: "
                "pass TrainLoop(..., n_steps=N), the total number of steps to train "
                "(or call loop.next_checkpoint() for one interval at a time)."
            )

    def __next__(self) -> Checkpoint:
        self._check_n_steps()
        return next(self._run(target=None))

    def next_checkpoint(self) -> Checkpoint:
        r"""Runs to the next checkpoint and returns it.

        The next checkpoint is at the next multiple of `n_steps_per_checkpoint`,
        or at `n_steps` if the loop has not reached it and it comes first.

        Raises:
            DataExhaustedError: if the data stream has no batch left.
        """
        target = self._n_steps if self._step < self._n_steps else None
        return self._require(self._run_alone(self._boundary(target)))

    def next_step(self) -> Checkpoint:
        r"""Runs one step and returns its checkpoint.

        Raises:
            DataExhaustedError: if the data stream has no batch left.
        """
        return self._require(self._run_alone(self._step + 1))

    def run(self, n_steps: int) -> Iterator[Checkpoint]:
        r"""Yields the checkpoints up to step `n_steps` (an absolute step number).

        Checkpoints come at the multiples of `n_steps_per_checkpoint` and at
        `n_steps`; the loop's own `n_steps` target is left as it is.
        """
        return self._run(target=check_count("n_steps", n_steps, 0, MAX_STEPS))

    @contextlib.contextmanager
    def _training(self, last_step: int) -> Iterator[None]:
        r"""While training up to `last_step`: signals become stop requests,
        failures reach the other processes, and the progress report shows."""
        if self._lost is not None:
            raise StateLostError(self._lost)
        self._guard.install()
        try:
            # a reading thread reads meanwhile, never past the last step trained
            self._feed.resume(self._step + 1, max(last_step, self._n_steps))
            with distributed.failing_together():
                yield
        except KeyboardInterrupt:
            self._guard.clear()  # the interrupt ends this call; the next one trains on
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(self._state)):
                self._lost = (
                    f"An interrupt at step {self._step} came while the loop's state was "
                    "handed from one step to the next, and that state is gone: this "
                    "loop cannot go on. Make a new TrainLoop that resumes from the last "
                    "checkpoint written (init=CheckpointFileReader(dir=...))."
                )
            raise
        finally:
            self._feed.pause()  # no thread reads on after a call (nor is waited for)
            self._guard.uninstall()
            if self.profile is not None:
                self.profile.finish()  # never leave a trace running
            if self._report is not None:
                self._report.stop()

    def _run(self, target: int | None) -> Iterator[Checkpoint]:
        with self._training(self._n_steps if target is None else target):
            stop = self._n_steps if target is None else target
            if self._step >= stop:
                log(
                    f"Nothing to train: the loop is at step {self._step} and trains to "
                    f"step {stop} (n_steps is the total, counted from step 0).",
                    stdout=self._stdout,
                )
            while self._step < (self._n_steps if target is None else target):
                stop = self._n_steps if target is None else target
                checkpoint = self._run_interval(self._boundary(stop), total=stop)
                if checkpoint is None:
                    log(
                        f"The data stream ended at step {self._step} of {stop}: training "
                        "stops there. Give task.data a re-iterable source (a list, a "
                        "DataLoader, a grain dataset) to read it epoch after epoch.",
                        stdout=self._stdout,
                    )
                    return
                yield checkpoint
                if checkpoint.preempted:
                    return
            if target is None and self._step >= self._n_steps:
                self._say_done()

    def _say_done(self) -> None:
        r"""The closing line of a run trained to `n_steps`: where the time went."""
        times = self._times.totals()
        log(
            f"{self._step:,} steps in {times['wall']:.1f} s: {describe(times)}.",
            self._stdout,
            lead="Done:",
            style="bold",
        )

    def _run_alone(self, boundary: int) -> Checkpoint | None:
        with self._training(boundary):
            return self._run_interval(boundary, total=boundary)

    def _boundary(self, target: int | None) -> int:
        every = self._n_steps_per_checkpoint
        boundary = (self._step // every + 1) * every
        return boundary if target is None else min(boundary, target)

    def _require(self, checkpoint: Checkpoint | None) -> Checkpoint:
        if checkpoint is None:
            raise DataExhaustedError(
                f"The data stream has no batch left after step {self._step}; "
                "give the task a longer or re-iterable source."
            )
        return checkpoint

    def _stop_requested(self) -> bool:
        r"""Whether any process was asked to stop (processes agree on it)."""
        if self._placement.multiprocess:
            return any(distributed.gather(int(self._guard.requested)))
        return self._guard.requested

    def _run_interval(self, boundary: int, total: int) -> Checkpoint | None:
        r"""Runs steps up to `boundary`: its checkpoint, or `None` if the
        stream had no batch left. A stop request, even one made before the
        interval started, ends it after the step in flight."""
        guard = self._guard
        # A second Ctrl-C is raised between steps, never inside one (preemption.py).
        guard.defer = not self._placement.multiprocess
        try:
            return self._train_interval(boundary, total)
        finally:
            guard.defer = False

    def _train_interval(self, boundary: int, total: int) -> Checkpoint | None:
        report = self._report
        if report is not None and not report.active:
            report.start(self._step, total)
        started = mark = time.perf_counter()
        compiled_before = self._steps.compile_seconds
        data = device = 0.0  # seconds waiting for batches, dispatching (timing.py)
        # The per-step path reads locals only: each attribute lookup or call
        # here is a measurable part of a small model's step.
        programs, take, group = self._steps.programs, self._feed.take, self._plan.group
        perf_counter = time.perf_counter
        key, guard, intervals, profile = self._train_key, self._guard, self._intervals, self.profile
        # every step's loss, read at the checkpoint
        note_loss, note_losses = intervals.losses.append, intervals.losses.extend
        queue = InFlight(self._placement.dispatch_depth)
        # Several processes must stop at the same step: they agree on it at
        # the checkpoint, never between steps.
        may_stop = not self._placement.multiprocess
        loss: Any = None
        ending = None  # what the step that ends the interval returns
        step = self._step
        while step < boundary:
            remaining = boundary - step
            dispatch = take(group(remaining), remaining, may_stop and guard.requested, step + 1)
            taken = perf_counter()
            data += taken - mark
            if dispatch is None:
                break
            batch, n_steps, variant, last = dispatch
            traced = profile is not None and profile.wants(step + 1, step + n_steps)
            if traced:
                profile.begin()  # type: ignore[union-attr]
                annotation = profile.annotate(step + 1)  # type: ignore[union-attr]
                annotation.__enter__()
            try:
                result = programs[variant](self._state, batch, key)
            except KeyboardInterrupt:  # raised before it ran: waiting for its compilation
                self._feed.untake()
                raise
            self._state, loss = result[0], result[1]
            if traced:
                annotation.__exit__(None, None, None)
                profile.record(step + 1, step + n_steps, loss)  # type: ignore[union-attr]
            self._step = step = step + n_steps
            if n_steps > 1:
                note_losses(loss)
            else:
                note_loss(loss)
            queue.push(loss)
            if report is not None:
                report.advance(step)
            mark = perf_counter()
            device += mark - taken
            if last:
                ending = result
                break
        if guard.interrupted:  # a second Ctrl-C: the state is whole here
            raise KeyboardInterrupt
        preempted = self._stop_requested()
        if self._step == self._intervals.start and not preempted:
            return None
        self._state, checkpoint = self._intervals.close(
            self._state, self._step, loss, ending, started, preempted
        )
        self._throughput.read_flops(self._steps.programs)
        checkpoint.throughput = self._throughput.measure(
            checkpoint.n_completed_steps, checkpoint.elapsed_time
        )
        ended = time.perf_counter()
        checkpoint.time_breakdown = self._times.close(
            started,
            ended,
            data,
            device + ended - mark,  # the checkpoint's copy and statistics: waiting for the devices
            self._steps.compile_seconds - compiled_before,  # inside dispatches or the close
        )
        if preempted:
            self._guard.clear()
        if report is not None:
            metrics = {k: v for k, v in checkpoint.train_metrics.items() if k != "loss"}
            loss = checkpoint.mean_loss if checkpoint.n_completed_steps else checkpoint.loss
            report.checkpoint(self._step, loss, metrics)
        return checkpoint


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
