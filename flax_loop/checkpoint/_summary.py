r"""A checkpoint's training statistics, and summaries built from them."""

from collections.abc import Mapping
from typing import Any

import jax
import optax

from flax_loop.checkpoint._checkpoint import Checkpoint, Summary, record
from flax_loop.parallel import to_host


def train_statistics(checkpoint: Checkpoint) -> dict[str, float]:
    r"""Training statistics of a checkpoint's interval, as plain floats.

    `loss` is the mean over the interval, `last_loss` the last step's;
    `seconds_per_step` and `steps_per_second` leave out the interval's
    compiling (the first interval's, and a changed cadence's), so they are
    the training speed from the first checkpoint on; the
    L2 norms are global norms over every leaf; the checkpoint's `throughput`
    follows (examples, tokens and FLOPs a second, MFU), and its `goodput`
    (the devices' share of the interval's wall time).

    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                       n_steps=2, stdout=False).next_checkpoint()
    >>> sorted(train_statistics(checkpoint))  # doctest: +NORMALIZE_WHITESPACE
    ['examples_per_second', 'flops_per_second_per_device', 'flops_per_step',
     'goodput', 'gradients_l2norm', 'last_loss', 'loss', 'seconds_per_step',
     'steps_per_second', 'weights_l2norm']
    """
    n_steps = max(int(checkpoint.n_completed_steps), 1)
    elapsed = float(checkpoint.elapsed_time)
    compiling = float(getattr(checkpoint, "time_breakdown", {}).get("compile", 0.0))
    if 0 < compiling < elapsed:
        elapsed -= compiling
    mean_loss = checkpoint.mean_loss if checkpoint.mean_loss is not None else checkpoint.loss
    grads_norm, weights_norm = to_host(_global_norms(checkpoint.grads, checkpoint.model_params))
    extra = {name: float(value) for name, value in checkpoint.train_metrics.items()}
    return {
        "loss": float(mean_loss),
        **{name: value for name, value in extra.items() if name != "loss"},
        "last_loss": float(checkpoint.loss),
        "seconds_per_step": elapsed / n_steps,
        "steps_per_second": n_steps / elapsed if elapsed > 0 else float("inf"),
        "gradients_l2norm": float(grads_norm),
        "weights_l2norm": float(weights_norm),
        **{name: float(value) for name, value in getattr(checkpoint, "throughput", {}).items()},
        **_goodput(checkpoint),
    }


def goodput(breakdown: dict[str, Any]) -> float:
    r"""The fraction of the wall time the devices' steps took (`device / wall`).

    >>> goodput({"device": 3.0, "wall": 4.0})
    0.75
    """
    wall = float(breakdown.get("wall", 0.0))
    return float(breakdown.get("device", 0.0)) / wall if wall > 0 else float("nan")


def _goodput(checkpoint: Checkpoint) -> dict[str, float]:
    breakdown = getattr(checkpoint, "time_breakdown", {})
    return {"goodput": goodput(breakdown)} if breakdown else {}


@jax.jit
def _global_norms(grads: Any, params: Any) -> tuple[jax.Array, jax.Array]:
    return optax.tree.norm(grads), optax.tree.norm(params)


def summarize(checkpoint: Checkpoint, group: str, metrics: Mapping[str, float]) -> Summary:
    r"""A summary of `checkpoint` with `metrics` under `group`.

    A summary given in is extended: its groups are kept and `group` is
    merged; a plain checkpoint gets its `"train"` statistics first.

    >>> import numpy as np
    >>> import flax.linen as nn
    >>> from flax_loop import TrainLoop, TrainTask
    >>> model = nn.Dense(3)
    >>> def cross_entropy(logits, labels):
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    >>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    >>> def accuracy(logits, labels):
    ...     return (logits.argmax(-1) == labels).mean()
    >>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
    >>> checkpoint = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
    ...                       n_steps=2, stdout=False).next_checkpoint()
    >>> summary = summarize(checkpoint, "eval", {"accuracy": 0.5})
    >>> list(summary.metrics)
    ['train', 'eval']
    """
    groups = {name: dict(values) for name, values in getattr(checkpoint, "metrics", {}).items()}
    if "train" not in groups:
        groups["train"] = train_statistics(checkpoint)
    groups[group] = {**groups.get(group, {}), **metrics}
    fields = {k: v for k, v in record(checkpoint).items() if k != "metrics"}
    return Summary(metrics=groups, **fields)


def as_summary(checkpoint: Checkpoint) -> Summary:
    r"""A summary as it is, or a plain checkpoint's training statistics as one."""
    if isinstance(checkpoint, Summary):
        return checkpoint
    statistics = train_statistics(checkpoint)
    return Summary(metrics={"train": statistics}, **record(checkpoint))
