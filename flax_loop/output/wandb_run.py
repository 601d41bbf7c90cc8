r"""`WandbWriter`: summaries and hyperparameters into a Weights & Biases run.

>>> import os, tempfile
>>> import jax, optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask
>>> os.environ["WANDB_MODE"] = "offline"  # no account, no network: a run on disk
>>> model = nn.Dense(3)
>>> def cross_entropy(logits, labels):
...     return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
>>> batches = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
>>> task = TrainTask(model.apply, optax.sgd(0.1), cross_entropy, batches)
>>> loop = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
...                  n_steps=4, n_steps_per_checkpoint=2, stdout=False)
>>> with WandbWriter(project="digits", config={"learning_rate": 0.1},
...                  dir=tempfile.mkdtemp(), stdout=False) as write:
...     for checkpoint in loop:
...         _ = write(checkpoint)
>>> write.run_id is not None
True

Needs `pip install "flax_loop[wandb]"`. Where the run goes is W&B's own
choice: its account (`wandb login` or `WANDB_API_KEY`), or a run on disk
with `WANDB_MODE=offline` (`wandb sync` uploads it later).
"""

import math
import os
from typing import Any

from flax_loop.checkpoint import Checkpoint, as_summary, expect
from flax_loop.errors import CheckpointError, ConfigError
from flax_loop.log import is_main_process


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ConfigError(
            "WandbWriter needs Weights & Biases' client: pip install 'flax_loop[wandb]'."
        ) from error
    return wandb


class WandbWriter:
    r"""Logs each summary's metrics (as `group/name`, at its step) to one W&B run.

    The run starts at the first write, with `config` as its configuration;
    metrics logged at one step (a checkpoint's, then its evaluation's) land
    in one row; the run's summary holds each metric's last value and the
    last step (`step`). `close()` (or the `with` block's end) finishes the
    run. Only process 0 logs. A callable `Summary -> Summary`, so it chains
    with the other writers.

    Args:
        project: the W&B project (W&B's default, `WANDB_PROJECT`, when `None`).
        name: the run's name (W&B picks one by default).
        config: hyperparameters to record with the run.
        dir: the folder W&B writes its files under; by default the current
            directory when the run starts (its `./wandb`). W&B's own default is
            the folder of its first run in the process, wherever the program
            has moved since.
        stdout: whether W&B prints its own lines (the run's address, its
            closing table).
        init: any other keyword of `wandb.init` (`entity`, `tags`, `group`,
            `mode`, `resume`, `id`, ...).
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        config: dict[str, Any] | None = None,
        dir: str | None = None,
        stdout: bool = True,
        **init: Any,
    ) -> None:
        if config is not None and not isinstance(config, dict):
            raise ConfigError(f"config must be a dict of hyperparameters; got {config!r}.")
        if project is not None and (not isinstance(project, str) or not project):
            raise ConfigError(f"project must be a non-empty name; got {project!r}.")
        _wandb()
        self.project, self.name, self.dir, self.stdout = project, name, dir, stdout
        self.config = dict(config or {})
        self.init = init
        self.run: Any = None
        r"""the `wandb` run, once the first summary is written."""

    @property
    def run_id(self) -> str | None:
        r"""the run's id, once the first summary is written."""
        return None if self.run is None else str(self.run.id)

    def _start(self) -> Any:
        folder = os.getcwd() if self.dir is None else os.fspath(self.dir)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"WandbWriter cannot make dir={folder!r}: {error}.") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            # W&B would put the run elsewhere (its temporary folder), saying nothing
            raise CheckpointError(
                f"WandbWriter cannot write under dir={folder!r} (no write permission): give "
                "a folder it can write to."
            )
        wandb = _wandb()
        settings = self.init.pop("settings", None)
        if not self.stdout:
            settings = wandb.Settings(silent=True) if settings is None else settings
        return wandb.init(
            project=self.project,
            name=self.name,
            config=self.config,
            dir=folder,
            settings=settings,
            reinit="create_new",  # a second writer in one process: a run of its own
            **self.init,
        )

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        r"""Logs the summary's (or checkpoint's train) metrics and returns it unchanged."""
        expect(checkpoint, Checkpoint, "WandbWriter")
        if not is_main_process():
            return checkpoint
        summary = as_summary(checkpoint)
        metrics = {
            f"{group}/{name}": number
            for group, values in summary.metrics.items()
            for name, value in values.items()
            if (number := _number(value)) is not None
        }
        if self.run is None:
            self.run = self._start()
        self.run.log(metrics, step=int(summary.step))
        self.run.summary["step"] = int(summary.step)
        return checkpoint

    def close(self) -> None:
        r"""Finishes the run (W&B uploads or keeps what it has not yet)."""
        if self.run is not None:
            self.run.finish()

    def __enter__(self) -> "WandbWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _number(value: Any) -> float | None:
    r"""A metric as W&B charts it: a finite number (else `None`, not logged)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
