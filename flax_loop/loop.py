r"""`TrainLoop`: the iterator that trains and yields checkpoints.

Cadence: a checkpoint comes at every multiple of `n_steps_per_checkpoint` and
at the last step. With `n_steps=10, n_steps_per_checkpoint=3`, iteration
yields checkpoints at steps 3, 6, 9 and 10:

>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                  n_steps=10, n_steps_per_checkpoint=3)
>>> [checkpoint.step for checkpoint in loop]
[3, 6, 9, 10]

In a notebook, `loop.next_checkpoint()` runs to the next multiple (or to
`n_steps` if that comes first), `loop.next_step()` runs one step, and
`loop.run(n)` yields the checkpoints up to step `n`; none of them changes
`loop.n_steps`.
"""

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax.core import unfreeze
from flax.core.scope import CollectionFilter, DenyList

from flax_loop import console, distributed
from flax_loop.batch import Batch, BatchSpec, normalize_batch, normalize_group
from flax_loop.checkpoint._checkpoint import Checkpoint
from flax_loop.checkpoint._file import CheckpointFile
from flax_loop.checkpoint._reader import CheckpointFileReader
from flax_loop.errors import (
    ConfigError,
    DataExhaustedError,
    FlaxLoopError,
    InitError,
    NonFiniteError,
)
from flax_loop.parallel import DATA_AXIS, Placement, to_host
from flax_loop.preemption import DEFAULT_SIGNALS, PreemptionGuard
from flax_loop.progress import ProgressReport
from flax_loop.random import as_typed_key, into_collection, labels_of
from flax_loop.step import (
    NONFINITE_MODES,
    TrainState,
    all_finite,
    build_update,
    compile_update,
)
from flax_loop.task import TrainTask

InitFn = Callable[..., Any]

PER_PROCESS = "flax_loop/per_process"
r"""The key of a data state saved by several processes, one per process."""

DEFAULT_MUTABLE_COLLECTIONS: CollectionFilter = DenyList("intermediates")
r"""every collection but `intermediates` may change while training."""


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(
            f"{name} must be an integer >= {minimum}; got {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}; got {value}.")
    return int(value)


def _check_task(task: Any) -> TrainTask:
    missing = [name for name in ("apply", "optimizer", "loss", "data") if not hasattr(task, name)]
    if missing:
        raise ConfigError(
            f"task must be a TrainTask(apply, optimizer, loss, data); got "
            f"{type(task).__name__} without {', '.join(missing)}."
        )
    for name in ("apply", "loss"):
        if not callable(getattr(task, name)):
            raise ConfigError(f"task.{name} must be callable; got {getattr(task, name)!r}.")
    optimizer = task.optimizer
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ConfigError(
            f"task.optimizer must be an optax.GradientTransformation (with init "
            f"and update), such as optax.adam(1e-3); got {optimizer!r} of type "
            f"{type(optimizer).__name__}."
        )
    return task


class TrainLoop:
    r"""The training loop updates model parameters and yields checkpoints.

    >>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                  n_steps=1000, n_steps_per_checkpoint=100)
    >>> for checkpoint in loop:
    ...     summary = eval_loop(checkpoint)

    Resume from the newest checkpoint file of a directory, or start afresh
    when it holds none:

    >>> loop = TrainLoop(init=CheckpointFileReader(dir="ckpts", target=model.init),
    ...                  task=task, rnkey=jax.random.key(0), n_steps=1000)
    """

    def __init__(
        self,
        init: InitFn | CheckpointFileReader,
        task: TrainTask,
        rnkey: Any,
        input_sample: Any = None,
        n_steps_per_checkpoint: int = 1,
        n_steps: int = 0,
        collections: Mapping[str, Sequence[str]] | None = None,
        mutable_collections: CollectionFilter = DEFAULT_MUTABLE_COLLECTIONS,
        devices: Sequence[Any] | None = None,
        stdout: bool = True,
        *,
        nonfinite: str = "raise",
        progress: bool = False,
        preemption_signals: Sequence[int] = DEFAULT_SIGNALS,
        steps_per_dispatch: int = 1,
    ) -> None:
        r"""Initializes the model and the optimizer and compiles the update.

        Args:
            init: the model's `init` function, or a `CheckpointFileReader` to
                resume from its newest file (its `target` initializes the model
                when the directory holds no checkpoint).
            task: what to train: apply, optimizer, loss and data.
            rnkey: the run's key, `jax.random.key(seed)` or `PRNGKey(seed)`.
            input_sample: inputs to initialize the model with; by default the
                first batch's inputs (that batch is still trained on).
            n_steps_per_checkpoint: steps between checkpoints.
            n_steps: the total number of steps to train, counted from step 0
                (a resumed loop trains up to the same total).
            collections: RNG collection names, `{"init": ["params"],
                "apply": ["dropout"]}`; keys for "apply" are derived on the
                devices from `rnkey`, the step and the device index.
            mutable_collections: the collections the model may change while
                training (e.g. `batch_stats`).
            devices: the devices to train on; all of them by default.
            stdout: whether to print the model's size and the set-up time.
            nonfinite: what a NaN or infinite loss or gradient does: "raise"
                (a `NonFiniteError` naming the first bad step, raised at the
                next checkpoint) or "skip" (the update is not applied, using
                `optax.apply_if_finite`).
            progress: whether to show a progress bar (step, steps/s, ETA and
                the latest checkpoint's loss); plain lines when stdout is not
                a terminal. It never waits for the devices.
            preemption_signals: signals that, while the loop trains, make it
                finish the current step, yield a checkpoint marked `preempted`
                and stop (SIGTERM and SIGINT by default; `()` to disable).
            steps_per_dispatch: run this many steps in one compiled call (a
                `jax.lax.scan` over as many stacked batches), for models so
                small that dispatching each step costs more than computing it.
                Results are those of single steps; checkpoints keep their steps.

        Raises:
            ConfigError: for an invalid argument.
            BatchError: if the first batch has the wrong form.
            DataExhaustedError: if the data stream yields no batch.
            InitError: if `init` fails.
        """
        with distributed.failing_together():
            self._construct(
                init=init,
                task=task,
                rnkey=rnkey,
                input_sample=input_sample,
                n_steps_per_checkpoint=n_steps_per_checkpoint,
                n_steps=n_steps,
                collections=collections,
                mutable_collections=mutable_collections,
                devices=devices,
                stdout=stdout,
                nonfinite=nonfinite,
                progress=progress,
                preemption_signals=preemption_signals,
                steps_per_dispatch=steps_per_dispatch,
            )

    def _construct(  # the body of __init__, run inside failing_together()
        self,
        *,
        init: InitFn | CheckpointFileReader,
        task: TrainTask,
        rnkey: Any,
        input_sample: Any,
        n_steps_per_checkpoint: int,
        n_steps: int,
        collections: Mapping[str, Sequence[str]] | None,
        mutable_collections: CollectionFilter,
        devices: Sequence[Any] | None,
        stdout: bool,
        nonfinite: str,
        progress: bool,
        preemption_signals: Sequence[int],
        steps_per_dispatch: int,
    ) -> None:
        started = time.perf_counter()
        self._n_steps = _check_count("n_steps", n_steps, 0)
        self._n_steps_per_checkpoint = _check_count(
            "n_steps_per_checkpoint", n_steps_per_checkpoint, 1
        )
        self._steps_per_dispatch = _check_count("steps_per_dispatch", steps_per_dispatch, 1)
        if nonfinite not in NONFINITE_MODES:
            raise ConfigError(f"nonfinite must be one of {NONFINITE_MODES}; got {nonfinite!r}.")
        task = _check_task(task)
        if collections is None:
            collections = {}
        if not isinstance(collections, Mapping):
            raise ConfigError(
                f'collections must be a mapping such as {{"apply": ["dropout"]}}; '
                f"got {collections!r}."
            )
        reader = init if isinstance(init, CheckpointFileReader) else None
        init_fn = reader.target if reader is not None else init
        if not callable(init_fn):
            raise ConfigError(
                f"init must be a model's init function or a CheckpointFileReader; got {init_fn!r}."
            )
        self._stdout = stdout
        self._nonfinite = nonfinite
        self._guard = PreemptionGuard(preemption_signals)
        self._report = (
            ProgressReport(console.console()) if progress and console.is_main_process() else None
        )
        self._placement = Placement(devices)
        key = as_typed_key(rnkey)

        try:
            self._data: Iterator[Any] = iter(task.data)
        except TypeError as error:
            raise ConfigError(
                f"task.data must be an iterator or iterable of batches; got "
                f"{type(task.data).__name__}."
            ) from error
        self._pending: Batch | None = self._first_batch()
        self._spec = BatchSpec.of(self._pending)
        self._spec.check_batch_axis(self._placement.n_local_devices)
        distributed.agree("the process-local batch size", self._spec.batch_size)
        self._exhausted = False

        inputs = (
            self._pending[0]
            if input_sample is None
            else normalize_group(input_sample, "input_sample")
        )
        optimizer = task.optimizer
        if nonfinite == "skip":
            optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=2**31 - 1)
        params, model_state = _initialize(
            init_fn,
            _init_key(key),
            inputs,
            labels_of(collections, "init"),
            mutable_collections,
        )
        optimizer_state = _init_optimizer(optimizer, params)

        step = 0
        if reader is not None:
            initializer = CheckpointFile(
                model_params=params,
                model_state=model_state,
                optimizer_state=optimizer_state,
                step=0,
            )
            loaded = reader(initializer)
            if loaded is not initializer:
                params, model_state = loaded.model_params, loaded.model_state
                optimizer_state, step = loaded.optimizer_state, int(loaded.step)
                if loaded.rnkey is not None:
                    key = loaded.rnkey
                self._restore_data_state(loaded.data_state)
                console.log(f"Resumed from step {step} of {reader.dir}.", stdout=stdout)
        self._step = distributed.agree("the step to resume from", step)
        self._key = key
        self._replicated_key = self._placement.replicate(_train_key(key))
        self._state = self._placement.replicate(
            TrainState.create(params, model_state, optimizer_state, step)
        )

        axis_name = DATA_AXIS if self._placement.n_devices > 1 else None
        update = build_update(
            task.apply,
            task.loss,
            optimizer,
            labels_of(collections, "apply"),
            mutable_collections,
            axis_name,
            skip_nonfinite=nonfinite == "skip",
        )
        if not self._peek(self._step + 1):  # set_state dropped the batch read first
            raise DataExhaustedError(
                f"The data stream has no batch for step {self._step + 1}, where the "
                "checkpoint resumes; give the task a longer or repeating stream."
            )
        sample = self._pending
        placed = self._place_batch(sample)
        compile_args = (update, self._placement, self._state, placed, self._replicated_key)
        # Three variants, all compiled here and none later: a step, the last
        # step of an interval (which also returns the gradients), and, if
        # asked for, several steps in one call.
        self._update = compile_update(*compile_args)
        self._update_last = compile_update(*compile_args, with_grads=True)
        self._update_many: Callable[..., Any] | None = None
        if self._steps_per_dispatch > 1:
            stacked = self._place_batch(_stack([sample] * self._steps_per_dispatch), stacked=True)
            self._update_many = compile_update(
                update,
                self._placement,
                self._state,
                stacked,
                self._replicated_key,
                n_steps=self._steps_per_dispatch,
            )
        self._depth = self._placement.dispatch_depth
        self._grads: Any = None
        self._all_finite = (
            jax.jit(all_finite)
            .lower((self._state.model_params, self._state.model_params))
            .compile()
        )
        self._n_nonfinite_before = 0
        console.log(
            console.describe_model(
                params, self._placement.n_devices, time.perf_counter() - started
            ),
            stdout=stdout,
        )

    # Properties.

    @property
    def step(self) -> int:
        r"""the number of completed steps."""
        return self._step

    @property
    def n_steps(self) -> int:
        r"""the total number of steps the loop trains to."""
        return self._n_steps

    @n_steps.setter
    def n_steps(self, value: int) -> None:
        self._n_steps = _check_count("n_steps", value, 0)

    @property
    def n_steps_per_checkpoint(self) -> int:
        r"""the number of steps between checkpoints."""
        return self._n_steps_per_checkpoint

    @n_steps_per_checkpoint.setter
    def n_steps_per_checkpoint(self, value: int) -> None:
        self._n_steps_per_checkpoint = _check_count("n_steps_per_checkpoint", value, 1)

    @property
    def devices(self) -> list[Any]:
        r"""the devices the loop trains on."""
        return list(self._placement.devices)

    # Iteration.

    def __iter__(self) -> Iterator[Checkpoint]:
        return self._run(target=None)

    def __next__(self) -> Checkpoint:
        if self._step >= self._n_steps or self._exhausted:
            raise StopIteration
        checkpoint = self._run_alone(self._boundary(self._n_steps))
        if checkpoint is None:
            raise StopIteration
        return checkpoint

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
        return self._run(target=_check_count("n_steps", n_steps, 0))

    # Internals.

    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        r"""While training: signals become stop requests, failures reach the
        other processes, and the progress report shows."""
        self._guard.install()
        try:
            with distributed.failing_together():
                yield
        finally:
            self._guard.uninstall()
            if self._report is not None:
                self._report.stop()

    def _run(self, target: int | None) -> Iterator[Checkpoint]:
        with self._training():
            while True:
                stop = self._n_steps if target is None else target
                if self._step >= stop or self._exhausted:
                    return
                checkpoint = self._run_interval(self._boundary(stop), total=stop)
                if checkpoint is None:
                    return
                yield checkpoint
                if checkpoint.preempted:
                    return

    def _run_alone(self, boundary: int) -> Checkpoint | None:
        with self._training():
            return self._run_interval(boundary, total=boundary)

    def _boundary(self, target: int | None) -> int:
        every = self._n_steps_per_checkpoint
        boundary = (self._step // every + 1) * every
        return boundary if target is None else min(boundary, target)

    def _require(self, checkpoint: Checkpoint | None) -> Checkpoint:
        if checkpoint is None:
            raise DataExhaustedError(
                f"The data stream has no batch left after step {self._step}; "
                "give the task a longer or repeating stream."
            )
        return checkpoint

    def _first_batch(self) -> Batch:
        try:
            raw = next(self._data)
        except StopIteration:
            raise DataExhaustedError(
                "task.data yielded no batch: the data stream is empty. Give it "
                "at least one batch (check the data set's size and batch size)."
            ) from None
        return normalize_batch(raw)

    def _restore_data_state(self, data_state: Any) -> None:
        can_restore = callable(getattr(self._data, "set_state", None))
        if isinstance(data_state, dict) and PER_PROCESS in data_state:
            states = data_state[PER_PROCESS]
            if len(states) == jax.process_count():
                data_state = states[jax.process_index()]
            elif all(state == states[0] for state in states):
                data_state = states[0]
            else:
                data_state = None  # written by another number of processes
        if data_state is not None and can_restore:
            self._data.set_state(data_state)  # type: ignore[attr-defined]
            self._pending = None  # read before the stream was repositioned
        elif self._stdout:
            why = (
                "the checkpoint holds no state of it (or one written by another "
                "number of processes)"
                if can_restore
                else "it has no get_state/set_state"
            )
            console.log(
                f"The data stream cannot be repositioned ({why}); it continues "
                "from its current position.",
                stdout=True,
            )

    def _next_batches(self, count: int) -> list[Batch]:
        r"""Up to `count` batches; fewer (and `_exhausted` set) at the stream's end."""
        group = []
        for index in range(count):
            batch = self._next_batch(self._step + 1 + index)
            if batch is None:
                self._exhausted = True
                break
            group.append(batch)
        return group

    def _next_batch(self, for_step: int) -> Batch | None:
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        try:
            raw = next(self._data)
        except StopIteration:
            if self._placement.multiprocess:
                raise DataExhaustedError(
                    f"The data stream of process {jax.process_index()} ended before step "
                    f"{for_step}. With several processes every stream must yield a batch "
                    "for every step, so that all take the same steps: give each process "
                    "an endless stream and stop with n_steps."
                ) from None
            return None
        fast = self._spec.fast_path(raw)
        if fast is not None:
            return fast
        normalized = normalize_batch(raw)
        self._spec.validate(normalized, step=for_step)
        return normalized

    def _place_batch(self, batch: Batch, stacked: bool = False) -> Any:
        if self._placement.multiprocess:
            return self._placement.shard_batch(batch, stacked=stacked)
        return batch

    def _run_interval(self, boundary: int, total: int) -> Checkpoint | None:
        r"""Runs steps up to `boundary`; `None` if the stream ran dry first.

        The last step of an interval also returns its gradients. It is the
        step at `boundary`, the step whose batch is the stream's last (the
        loop reads one batch ahead to know), or, once a stop is requested,
        the step with the batch read ahead, if any.
        """
        report = self._report
        if report is not None and not report.active:
            report.start(self._step, total)
        started = time.perf_counter()
        in_flight: deque[jax.Array] = deque()
        loss: Any = None
        n_completed = 0
        many = self._steps_per_dispatch
        # The per-step path reads locals only: at ~25 us a step (a small MLP on
        # this CPU), each attribute lookup or call here is measurable.
        guard, multiprocess = self._guard, self._placement.multiprocess
        update, key, depth = self._update, self._replicated_key, self._depth
        next_batch = self._next_batch
        last = False
        while not last:
            # Several processes must stop at the same step: they agree on it at
            # the checkpoint, not at the next step.
            stopping = guard.requested and not multiprocess
            if stopping and self._pending is None:
                break  # nothing read ahead: the previous step was the last
            remaining = boundary - self._step
            if many > 1 and remaining > many and not stopping:
                group = self._next_batches(many)
                if not group:
                    break
                if len(group) == many and self._peek(self._step + many + 1):
                    assert self._update_many is not None
                    self._state, loss = self._update_many(
                        self._state,
                        self._place_batch(_stack(group), stacked=True),
                        self._replicated_key,
                    )
                    self._step += many
                    n_completed += many
                else:  # the stream ends within or right after the group
                    for index, grouped in enumerate(group):
                        loss = self._single(grouped, last=index == len(group) - 1)
                        n_completed += 1
                    last = True
            else:
                single = next_batch(self._step + 1)
                if single is None:
                    self._exhausted = True
                    break
                last = remaining == 1 or stopping or not self._peek(self._step + 2)
                if last or multiprocess:
                    loss = self._single(single, last)
                else:
                    self._state, loss = update(self._state, single, key)
                    self._step += 1
                n_completed += 1
            in_flight.append(loss)
            if len(in_flight) > depth:
                in_flight.popleft().block_until_ready()
            if report is not None:
                report.advance(self._step)
        if n_completed == 0:
            return None
        loss.block_until_ready()
        elapsed = time.perf_counter() - started
        preempted = self._guard.requested
        if self._placement.multiprocess:
            preempted = any(distributed.gather(int(preempted)))
        checkpoint = self._checkpoint(loss, n_completed, elapsed, preempted)
        if report is not None:
            report.checkpoint(self._step, checkpoint.loss)
        return checkpoint

    def _single(self, batch: Batch, last: bool) -> jax.Array:
        r"""Dispatches one step; the last of an interval keeps its gradients."""
        placed = self._place_batch(batch)
        if last:
            self._state, loss, self._grads = self._update_last(
                self._state, placed, self._replicated_key
            )
        else:
            self._state, loss = self._update(self._state, placed, self._replicated_key)
        self._step += 1
        return loss

    def _peek(self, for_step: int) -> bool:
        r"""Reads the batch of `for_step` ahead; whether there is one."""
        if self._pending is None:
            self._pending = self._next_batch(for_step)
            if self._pending is None:
                self._exhausted = True
                return False
        return True

    def _checkpoint(
        self, loss: jax.Array, n_completed: int, elapsed: float, preempted: bool
    ) -> Checkpoint:
        state = self._state
        finite = self._all_finite((state.model_params, self._grads))
        last_loss, loss_sum, counters, finite = to_host(
            (loss, state.loss_sum, state.counters, finite)
        )
        _, n_bad, first_bad = (int(count) for count in counters)
        n_nonfinite, self._n_nonfinite_before = n_bad - self._n_nonfinite_before, n_bad
        if self._nonfinite == "raise" and (first_bad or not bool(finite)):
            where = (
                f"at step {first_bad}"
                if first_bad
                else f"between steps {self._step - n_completed + 1} and {self._step}"
            )
            raise NonFiniteError(
                f"The loss or a gradient was NaN or infinite {where} (detected at "
                f"step {self._step}). Lower the learning rate, check the data for "
                "NaN or Inf, or pass nonfinite='skip' to TrainLoop to skip such "
                "updates."
            )
        params, model_state, optimizer_state = self._placement.copy(
            (state.model_params, state.model_state, state.optimizer_state)
        )
        grads, self._grads = self._grads, None
        self._state = state._replace(
            loss_sum=self._placement.replicate(np.zeros((), np.float32)),
        )
        n_finite = n_completed - n_nonfinite
        data_state = None
        get_state = getattr(self._data, "get_state", None)
        if callable(get_state):
            data_state = get_state()
            if self._placement.multiprocess:
                states = distributed.gather_objects(f"data_state/{self._step}", data_state)
                data_state = {PER_PROCESS: states}
        return Checkpoint(
            model_params=params,
            model_state=model_state,
            optimizer_state=optimizer_state,
            grads=grads,
            loss=float(last_loss),
            n_completed_steps=n_completed,
            elapsed_time=elapsed,
            step=self._step,
            mean_loss=float(loss_sum) / n_finite if n_finite else float("nan"),
            n_nonfinite_steps=n_nonfinite,
            preempted=preempted,
            rnkey=self._key,
            data_state=data_state,
        )


def _stack(batches: list[Batch]) -> Batch:
    r"""Stacks batches along a new leading axis, for several steps per dispatch."""
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


def _init_key(key: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, 0)


def _train_key(key: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, 1)


def _initialize(
    init: InitFn,
    key: jax.Array,
    inputs: tuple[Any, ...],
    labels: Sequence[str],
    mutable_collections: CollectionFilter,
) -> tuple[Any, Any]:
    r"""Runs the model's init and splits params from the other collections."""

    def initialize(key: jax.Array, *inputs: Any) -> Any:
        return init(into_collection(key, labels), *inputs, mutable=mutable_collections)

    try:
        variables = jax.jit(initialize)(key, *inputs)
    except FlaxLoopError:
        raise
    except Exception as error:
        raise InitError(
            f"init raised {type(error).__name__}: {error}. It was called with "
            f"inputs of shapes {[tuple(np.shape(x)) for x in inputs]} and RNG "
            f"collections {list(labels)}; check the model against the data "
            "(or pass input_sample)."
        ) from error
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise InitError(
            f"init must return variables with a 'params' collection (as a linen "
            f"Module's init does); got {type(variables).__name__} "
            f"{list(variables) if isinstance(variables, Mapping) else ''}."
        )
    variables = unfreeze(variables)  # type: ignore[arg-type]
    params = variables.pop("params")
    return params, variables


def _init_optimizer(optimizer: optax.GradientTransformation, params: Any) -> Any:
    try:
        return jax.jit(optimizer.init)(params)
    except Exception as error:
        raise ConfigError(
            f"task.optimizer.init failed with {type(error).__name__}: {error}. "
            "Pass an optax.GradientTransformation such as optax.adam(1e-3)."
        ) from error
