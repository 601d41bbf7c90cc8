r"""`EvalLoop`: exact, example-weighted metrics of a checkpoint on eval data.

>>> import optax
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> test_batches = batches[:2]
>>> def accuracy(logits, labels):
...     return (logits.argmax(-1) == labels).mean()
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                       n_steps=2, stdout=False).next_checkpoint()
>>> eval_loop = EvalLoop(EvalTask(apply=model.apply, metrics={"accuracy": accuracy},
...                               data=test_batches),
...                      rnkey=jax.random.key(1), n_steps=None)
>>> summary = eval_loop(checkpoint)
>>> list(summary.metrics)
['train', 'eval']

Each metric is `fn(*outputs, *targets)` returning one value per example (an
array with a leading batch axis) or the batch's mean (a scalar; it is then
computed per example, so the mean over examples is still exact). Batches
whose size does not divide by the device count are padded and the padding
is masked out: every example counts once, none is dropped.
"""

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.errors import ModifyScopeVariableError

from flax_loop import distributed
from flax_loop.checkpoint import Checkpoint, Summary, expect, summarize
from flax_loop.data.batch import Batch, BatchSpec, leading_size, normalize_batch
from flax_loop.data.source import DataSource
from flax_loop.errors import (
    ApplyError,
    ConfigError,
    DataExhaustedError,
    FlaxLoopError,
    check_count,
)
from flax_loop.parallel import InFlight, Placement, to_host
from flax_loop.random import as_typed_key, eval_key, into_collection, labels_of
from flax_loop.step.modules import as_apply
from flax_loop.step.several import is_several
from flax_loop.task import EvalTask

Totals = dict[str, jax.Array]


class EvalLoop:
    r"""The evaluation loop runs a model over eval batches and returns a `Summary`.

    Its summary holds `metrics={"train": <interval statistics>, "eval": {...}}`;
    chained after another `EvalLoop`, it merges into that summary's groups.
    """

    def __init__(
        self,
        task: EvalTask,
        rnkey: Any,
        n_steps: int | None = 1,
        collections: Mapping[str, Sequence[str]] | None = None,
        n_devices: int | None = None,
        *,
        devices: Sequence[Any] | None = None,
        group: str = "eval",
        use_ema: bool = False,
    ) -> None:
        r"""Initializes the evaluation loop.

        Args:
            task: the model's apply, the metrics and the eval data.
            rnkey: a key for RNG collections the model needs at evaluation.
            n_steps: batches per evaluation; `None` for a whole pass over
                `task.data` (a list, or a function returning a fresh iterator).
            collections: RNG collection names, `{"apply": [...]}`.
            n_devices: evaluate on the first `n_devices` devices.
            devices: the devices to evaluate on (e.g. the training loop's);
                all of them by default.
            group: the name of the metric group in the summary.
            use_ema: evaluate the checkpoint's moving average of the
                parameters (`TrainLoop(ema_decay=...)`) instead of them.
        """
        if n_steps is not None:
            n_steps = check_count("n_steps", n_steps, 1)
        if not isinstance(task.metrics, Mapping) or not task.metrics:
            raise ConfigError(
                f"task.metrics must map names to functions, e.g. "
                f"{{'accuracy': accuracy}}; got {task.metrics!r}."
            )
        for name, metric in task.metrics.items():
            if not callable(metric):
                raise ConfigError(f"metric {name!r} is not callable: {metric!r}.")
        if devices is None and n_devices is not None:
            devices = jax.devices()[: check_count("n_devices", n_devices, 1, len(jax.devices()))]
        models: Any = task.apply
        if is_several(models):
            raise ConfigError(
                f"EvalTask.apply is a dict of models {list(models)}: an evaluation "
                "calls one model. Pass the one to evaluate on its share of the "
                "variables, such as apply=lambda variables, *x, **kw: critic.apply("
                "{c: v['critic'] for c, v in variables.items() if 'critic' in v}, *x, **kw)."
            )
        self._task = task
        self._apply = as_apply(task.apply, train=False)
        self._n_steps = n_steps
        self._group = group
        self._use_ema = use_ema
        self._key = as_typed_key(rnkey)
        self._labels = labels_of(dict(collections or {}), "apply")
        self._placement = Placement(devices)
        self._source: DataSource | None = None  # read on across calls with n_steps
        self._batch_size: int | None = None
        self._used_iterator = False
        self._evaluate = jax.jit(self._accumulate)

    @property
    def n_steps(self) -> int | None:
        r"""batches per evaluation; `None` for a whole pass."""
        return self._n_steps

    def __call__(self, checkpoint: Checkpoint) -> Summary:
        r"""Evaluates the checkpoint's model and returns its summary."""
        expect(checkpoint, Checkpoint, "EvalLoop")
        with distributed.failing_together():
            return summarize(checkpoint, self._group, self.evaluate(checkpoint))

    def evaluate(self, checkpoint: Checkpoint) -> dict[str, float]:
        r"""The metrics of the checkpoint's model, averaged over examples."""
        params = checkpoint.model_params
        if self._use_ema:
            params = checkpoint.ema_params
            if params is None:
                raise ConfigError(
                    f"EvalLoop(use_ema=True) was given the checkpoint of step "
                    f"{checkpoint.step}, which has no ema_params: train with "
                    "TrainLoop(ema_decay=0.999) (or any decay in (0, 1))."
                )
        variables = self._placement.replicate({"params": params, **dict(checkpoint.model_state)})
        step = int(checkpoint.step)
        totals: Totals | None = None
        in_flight = InFlight(self._placement.dispatch_depth)
        batches: Iterable[Batch] = self._batches()
        pad_to = None
        if self._placement.multiprocess:
            batches, pad_to = self._agreed_batches(list(batches))
        for index, batch in enumerate(batches):
            inputs, targets, mask = self._pad(batch, pad_to)
            if totals is None:
                totals = self._placement.replicate(
                    {name: np.zeros((), np.float32) for name in [*self._task.metrics, "__count__"]}
                )
            try:
                totals = self._evaluate(
                    totals,
                    variables,
                    inputs,
                    targets,
                    mask,
                    self._key,
                    np.int32(step),
                    np.int32(index),
                )
            except FlaxLoopError:
                raise  # its message is the last word
            except Exception as error:
                error.add_note(
                    "flax_loop: raised while evaluating (the model and the metrics) on eval "
                    f"batch {index}: {BatchSpec.of(batch).describe()}."
                )
                raise
            in_flight.push(totals["__count__"])
        if totals is None:
            raise DataExhaustedError(
                "The eval data yielded no batch. For whole passes (n_steps=None) "
                "give EvalTask a list or a function returning a fresh iterator."
            )
        host = to_host(totals)
        count = float(host.pop("__count__"))
        return {name: float(value) / count for name, value in host.items()}

    def _batches(self) -> Iterator[Batch]:
        if self._n_steps is None:
            data: Any = self._task.data
            fresh = callable(data) and not hasattr(data, "__iter__")
            source = data() if fresh else data
            stream = iter(source)
            one_shot = stream is source and not fresh
            if one_shot and self._used_iterator:
                raise DataExhaustedError(
                    "EvalLoop(n_steps=None) was given an iterator, which a first "
                    "pass used up; give EvalTask a list or a function returning a "
                    "fresh iterator."
                )
            self._used_iterator = one_shot
            for raw in stream:
                yield normalize_batch(raw)
            return
        for _ in range(self._n_steps):
            raw = self._next_raw()
            if raw is None:
                return
            yield normalize_batch(raw)

    def _next_raw(self) -> Any:
        r"""The next raw batch, epoch after epoch for a re-iterable source;
        `None` at a one-shot iterator's end."""
        if self._source is None:
            self._source = DataSource(self._task.data)
        try:
            return self._source.next()
        except StopIteration:
            return None

    def _agreed_batches(self, batches: list[Batch]) -> tuple[list[Batch], int]:
        r"""The same number of batches of the same size on every process.

        Processes may hold different numbers of examples; each evaluates as
        many batches as the process with the most, padding with empty (fully
        masked) ones, all padded to the largest batch of any process.
        """
        counts = distributed.gather(len(batches))
        if min(counts) == 0:
            raise DataExhaustedError(
                f"Process {counts.index(0)} has no eval batch (batches per process: "
                f"{counts}); give every process at least one."
            )
        n = self._placement.n_local_shards
        largest = max(max(np.shape(b[0][0])[0] for b in batches), 1)
        pad_to = max(distributed.gather(-(-largest // n) * n))
        empty = jax.tree.map(lambda leaf: np.asarray(leaf)[:0], batches[0])
        return batches + [empty] * (max(counts) - len(batches)), pad_to

    def _pad(self, batch: Batch, pad_to: int | None = None) -> tuple[Any, Any, Any]:
        inputs, targets = batch
        size = leading_size([np.shape(leaf) for leaf in inputs + targets])
        n = self._placement.n_local_shards
        padded = -(-size // n) * n
        if self._batch_size is None:
            self._batch_size = padded
        padded = pad_to if pad_to is not None else max(self._batch_size, padded)

        def pad(leaf: Any) -> Any:
            leaf = np.asarray(leaf)
            if leaf.shape[0] == padded:
                return leaf
            filler = np.zeros((padded - leaf.shape[0], *leaf.shape[1:]), leaf.dtype)
            return np.concatenate([leaf, filler])

        mask = np.arange(padded) < size
        placed = tuple(map(pad, inputs)), tuple(map(pad, targets)), mask
        if self._placement.n_devices == 1 and not self._placement.multiprocess:
            return placed  # numpy straight into the call: the cheapest copy to one device
        return self._placement.shard_batch(placed)

    def _accumulate(
        self,
        totals: Totals,
        variables: Any,
        inputs: tuple[Any, ...],
        targets: tuple[Any, ...],
        mask: jax.Array,
        key: jax.Array,
        step: jax.Array,
        index: jax.Array,
    ) -> Totals:
        # The batch's key is derived here, not on the host: two fold_in
        # dispatches per batch cost 10% of a small model's evaluation.
        rngs = into_collection(eval_key(key, step, index), self._labels)
        try:
            outputs = self._apply(variables, *inputs, rngs=rngs)
        except ModifyScopeVariableError as error:
            found = re.search(r'collection "([^"]+)"', str(error))
            collection = found.group(1) if found else "batch_stats"
            raise ApplyError(
                f"The model changes its {collection!r} while it is evaluated ({error}): it "
                "runs in training mode (a BatchNorm updating its statistics). Give "
                "EvalTask the model in evaluation mode, e.g. EvalTask(apply="
                "functools.partial(model.apply, train=False), ...) for a module with a "
                "train argument, or a module built with use_running_average=True."
            ) from None
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        weights = mask.astype(jnp.float32)
        updated = dict(totals)
        for name, metric in self._task.metrics.items():
            values = _per_example(metric, outputs, targets, mask.shape[0], name)
            updated[name] = totals[name] + jnp.sum(values * weights)
        updated["__count__"] = totals["__count__"] + jnp.sum(weights)
        return updated


def _per_example(
    metric: Callable[..., Any],
    outputs: tuple[Any, ...],
    targets: tuple[Any, ...],
    batch_size: int,
    name: str,
) -> jax.Array:
    returned = metric(*outputs, *targets)
    try:
        value = jnp.asarray(returned)
    except TypeError:
        raise ConfigError(
            f"metric {name!r} returned {returned!r} ({type(returned).__name__}); return a "
            "number: one value per example or the batch mean."
        ) from None
    if value.ndim >= 1 and value.shape[0] == batch_size:
        return value.reshape(batch_size, -1).mean(axis=1).astype(jnp.float32)
    if value.ndim == 0:
        # A batch mean cannot be masked; compute it on each example alone.
        def one(*args: Any) -> jax.Array:
            return jnp.asarray(metric(*(arg[None] for arg in args)), jnp.float32)

        return jax.vmap(one)(*outputs, *targets)
    raise ConfigError(
        f"metric {name!r} returned shape {value.shape} for a batch of "
        f"{batch_size}; return one value per example or the batch mean."
    )
