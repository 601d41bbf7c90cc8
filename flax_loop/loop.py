r"""`TrainLoop`: the iterator that trains and yields checkpoints.

Cadence: a checkpoint comes at every multiple of `n_steps_per_checkpoint`
and at the last step. With `n_steps=10, n_steps_per_checkpoint=3`, iteration
yields checkpoints at steps 3, 6, 9 and 10:

>>> import jax
>>> import optax
>>> import numpy as np
>>> import flax.linen as nn
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                       n_steps=2, stdout=False).next_checkpoint()
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from flax.core.scope import CollectionFilter
from jax.sharding import Mesh

from flax_loop import distributed
from flax_loop.checkpoint import Checkpoint, SavedState
from flax_loop.errors import ConfigError, check_count
from flax_loop.log import console, is_main_process
from flax_loop.parallel import DATA_AXIS
from flax_loop.programs.compiled import CompiledSteps
from flax_loop.programs.sharding import DEFAULT_FSDP_MIN_BYTES, Sharding
from flax_loop.run.assemble import assemble
from flax_loop.run.hand import hyperparams_changer
from flax_loop.run.initial import InitFn, Reader
from flax_loop.run.options import DEFAULT_MUTABLE_COLLECTIONS, Collections, Options
from flax_loop.run.preemption import quiet_interrupt
from flax_loop.run.profiling import ProfileSteps
from flax_loop.run.progress import SetUpStatus
from flax_loop.task import TrainTask

__all__ = ["MAX_STEPS", "DEFAULT_MUTABLE_COLLECTIONS", "Collections", "TrainLoop"]

MAX_STEPS = 2**31 - 1
r"""The largest step number; the step counter on the devices is an int32."""


class TrainLoop:
    r"""Trains a model and yields a `Checkpoint` every `n_steps_per_checkpoint` steps.

    `n_steps` is the total to train to, counted from step 0 (a resumed loop
    trains up to the same total). The model is `init(rngs, *inputs,
    mutable=...) -> variables` and `task.apply(variables, *inputs, rngs=...,
    mutable=...)` (a linen module's `init` and `apply`), or an `nnx.Module`
    given as both `init` and `task.apply` (it is never changed: put a
    checkpoint back with `nnx.update(model, checkpoint.model_params,
    checkpoint.model_state)`).

    >>> import jax, optax, numpy as np, flax.linen as nn
    >>> model, batches = nn.Dense(3), [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                  n_steps=4, n_steps_per_checkpoint=2, stdout=False)
    >>> for checkpoint in loop:
    ...     print(checkpoint.step, checkpoint.n_completed_steps)
    2 2
    4 2

    Resume with `init=CheckpointFileReader(dir="ckpts", target=model.init)` (or start afresh).

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
            the devices from `rnkey` and the step: the same keys on any
            number of devices.
        mutable_collections: the collections the model may change while
            training (e.g. `batch_stats`).
        devices: the devices to train on; all of them by default.
        stdout: whether to print the model's size, the set-up time and notes.
        nonfinite: what a NaN or infinite loss or gradient does: "raise" (a
            `NonFiniteError` naming the first step whose loss was not finite,
            raised at the next checkpoint; a step checks its loss, so a
            non-finite gradient with a finite loss is named a step late) or
            "skip" (that step's update is not applied).
        progress: whether to show a progress bar (steps, the loss of the
            newest finished step, steps/s, elapsed time, ETA); by default
            (None) when the console is a terminal and `stdout` is on, not in
            notebooks. `True` shows it anywhere (plain lines every 30 s and
            at checkpoints when the console is no terminal); `False` never.
            It never waits for the devices.
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
        ema_decay: keep a moving average of the parameters (`ema = ema +
            (1 - ema_decay) * (params - ema)`, from the parameters, in their
            dtype: keep float32 with a decay near 1), as `Checkpoint.ema_params`,
            saved in checkpoints; `EvalLoop(..., use_ema=True)` evaluates it.
        profile: a `ProfileSteps` window of steps to trace with `jax.profiler`.
        prefetch: batches a background thread reads ahead of the devices
            (a slow source then reads while they compute; each checkpoint
            still saves the data state after its last trained batch): `0`
            reads inline, `N` starts the thread at once; the default, None,
            uses one if the source's first reads took 0.2 ms or more each.
        hyperparams: which injected hyperparameters (`optax.inject_hyperparams`)
            a resumed run trains with where its file and the task differ:
            `"task"` (the default: the task's) or `"file"` (the file's, so
            that a rate the caller set with `set_hyperparams` survives a
            restart); set-up says which in one line.

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
        progress: bool | None = None,
        preemption_signals: Sequence[int] | None = None,
        steps_per_dispatch: int = 1,
        sharding: Sharding | None = None,
        mesh: Mesh | None = None,
        batch_axis: str = DATA_AXIS,
        fsdp_min_bytes: int = DEFAULT_FSDP_MIN_BYTES,
        ema_decay: float | None = None,
        profile: ProfileSteps | None = None,
        prefetch: int | None = None,
        hyperparams: str = "task",
    ) -> None:
        with distributed.failing_together(), _interrupted_during_set_up():
            n_steps = check_count("n_steps", n_steps, 0, MAX_STEPS)
            every = check_count("n_steps_per_checkpoint", n_steps_per_checkpoint, 1, MAX_STEPS)
            options = Options(
                nonfinite=nonfinite,
                progress=progress,
                preemption_signals=preemption_signals,
                steps_per_dispatch=steps_per_dispatch,
                sharding=sharding,
                mesh=mesh,
                batch_axis=batch_axis,
                fsdp_min_bytes=fsdp_min_bytes,
                ema_decay=ema_decay,
                profile=profile,
                prefetch=prefetch,
                hyperparams=hyperparams,
            )
            self.profile = options.profile  # the window of steps traced (`traced_steps`)
            self._iterator: Iterator[Checkpoint] | None = None
            optimizer = getattr(task, "optimizer", None)
            self._optimizers: dict[str | None, Any] = (
                dict(optimizer) if isinstance(optimizer, Mapping) else {None: optimizer}
            )
            status = SetUpStatus(console(), shown=stdout and is_main_process())
            try:
                self._runner = assemble(
                    init, task, rnkey, input_sample, every, collections, mutable_collections,
                    devices, stdout, options, n_steps, say=status,
                )  # fmt: skip
            finally:
                status.stop()

    @property
    def step(self) -> int:
        r"""the number of completed steps."""
        return self._runner.step

    @property
    def caller_state(self) -> dict[str, Any]:
        r"""your loop body's own small state, saved with every checkpoint and
        given back on resume: a dict of plain numbers, strings, lists and
        dicts (a plateau's best loss and patience). A file holds it as the
        body left it when the file is written; a fresh run starts with `{}`."""
        return self._runner.intervals.caller_state

    def memory_plan(self) -> dict[str, Any]:
        r"""The bytes each device holds while training, by part, and `total`
        (`flax_loop.run.memory`); set-up refuses a plan over a device's memory."""
        return self._runner.memory_plan()

    @property
    def time_breakdown(self) -> dict[str, float]:
        r"""where the run's time went so far, in seconds (`flax_loop.run.throughput`);
        each checkpoint's `time_breakdown` holds its interval's."""
        return self._runner.times.totals()

    @property
    def peak_flops(self) -> float | None:
        r"""one device's peak FLOP/s, for `Checkpoint.throughput`'s `mfu`:
        known for recent GPUs and TPUs (`flax_loop.run.throughput.PEAK_FLOPS`),
        or set (`loop.peak_flops = 989e12`); `None` when unknown."""
        return self._runner.intervals.throughput.peak_flops

    @peak_flops.setter
    def peak_flops(self, value: float | None) -> None:
        self._runner.intervals.throughput.peak_flops = value

    @property
    def n_steps(self) -> int:
        r"""the total number of steps the loop trains to."""
        return self._runner.n_steps

    @n_steps.setter
    def n_steps(self, value: int) -> None:
        self._runner.n_steps = check_count("n_steps", value, 0, MAX_STEPS)

    @property
    def n_steps_per_checkpoint(self) -> int:
        r"""the number of steps between checkpoints."""
        return self._runner.plan.every

    @n_steps_per_checkpoint.setter
    def n_steps_per_checkpoint(self, value: int) -> None:
        r"""A new cadence takes effect from the next interval (its variants
        compile when first called)."""
        self._runner.follow(check_count("n_steps_per_checkpoint", value, 1, MAX_STEPS))

    @property
    def compiled(self) -> CompiledSteps:
        r"""The compiled variants of the step (`programs` by name, `wait()` for
        those compiling in the background), for tests and benchmarks."""
        return self._runner.steps

    @property
    def devices(self) -> list[Any]:
        r"""the devices the loop trains on."""
        return list(self._runner.placement.devices)

    def __iter__(self) -> Iterator[Checkpoint]:
        self._check_n_steps()
        return self._runner.run(target=None)

    def _check_n_steps(self) -> None:
        if self.n_steps == 0 and self.step == 0:
            raise ConfigError(
                "n_steps is 0 (its default), so iterating the loop would train nothing: "
                "pass TrainLoop(..., n_steps=N), the total number of steps to train "
                "(or call loop.next_checkpoint() for one interval at a time)."
            )

    def __next__(self) -> Checkpoint:
        self._check_n_steps()
        # one generator across calls, as `for` holds one: its scope (signal
        # handlers, the reading thread) is closed once, when it ends
        if self._iterator is None:
            self._iterator = self._runner.run(target=None)
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = None  # a raised n_steps starts a new one
            raise

    def update_state(self, fn: Callable[[SavedState], SavedState]) -> None:
        r"""Changes the state the next step takes: `fn(saved)` of the saved
        record now (a `SavedState`: `model_params`, `model_state`,
        `optimizer_state`, the step's `carried` fields) returns it changed,
        with the same structure, dtypes and shapes; the next step starts
        from it, without compiling again, and the next checkpoint (and its
        file) holds it. Called in the loop's body, the checkpoint the body
        holds (the newest, of this step) holds it too, so a file written
        after the call has it: a resumed run trains on as this one does.
        Writing to a `Checkpoint`'s arrays changes nothing.
        `flax_loop.run.hand` shows a call.

        Raises:
            ConfigError: if `fn` returns another structure, dtype or shape.
        """
        self._runner.update_state(fn)

    def set_hyperparams(self, name: str | None = None, **values: Any) -> None:
        r"""Sets hyperparameters of an optimizer built with
        `optax.inject_hyperparams` (`learning_rate=1e-4`) for the steps from
        the next on: of the task's optimizer, or with a dict of them, the one
        named `name`. Saved with the next checkpoint; nothing compiles again.

        Raises:
            ConfigError: for an optimizer without injected hyperparameters, a
                hyperparameter it does not have or that a schedule sets at
                every step (`learning_rate=optax.linear_schedule(...)`), or
                an unknown `name`.
        """
        self._runner.update_state(hyperparams_changer(self._optimizers, name, values))

    def current_checkpoint(self) -> Checkpoint:
        r"""The checkpoint of the state the loop holds now, training nothing:
        a finished run's (resumed at its `n_steps`) trained parameters for
        the next phase of a program (pre-training, then fine-tuning), with
        `n_completed_steps` 0 when no step ran since the newest checkpoint."""
        return self._runner.current()

    def next_checkpoint(self) -> Checkpoint:
        r"""Runs to the next checkpoint and returns it.

        The next checkpoint is at the next multiple of `n_steps_per_checkpoint`,
        or at `n_steps` if the loop has not reached it and it comes first.

        Raises:
            DataExhaustedError: if the data stream has no batch left.
        """
        runner = self._runner
        target = runner.n_steps if runner.step < runner.n_steps else None
        return runner.run_alone(runner.boundary(target))

    def next_step(self) -> Checkpoint:
        r"""Runs one step and returns its checkpoint.

        Raises:
            DataExhaustedError: if the data stream has no batch left.
        """
        return self._runner.run_alone(self.step + 1)

    def run(self, n_steps: int) -> Iterator[Checkpoint]:
        r"""Yields the checkpoints up to step `n_steps` (an absolute step number).

        Checkpoints come at the multiples of `n_steps_per_checkpoint` and at
        `n_steps`; the loop's own `n_steps` target is left as it is.
        """
        return self._runner.run(target=check_count("n_steps", n_steps, 0, MAX_STEPS))


@contextlib.contextmanager
def _interrupted_during_set_up() -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt as error:
        quiet_interrupt(error, "interrupted during set-up (reading, initializing or compiling).")
        raise
