r"""`MLflowWriter`: summaries and hyperparameters into an MLflow tracking store.

>>> import jax
>>> import optax
>>> import numpy as np
>>> import flax.linen as nn
>>> from flax_loop import TrainLoop, TrainTask, EvalLoop, EvalTask
>>> import pathlib, tempfile
>>> tmp = pathlib.Path(tempfile.mkdtemp())
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
>>> eval_loop = EvalLoop(EvalTask(model.apply, {"accuracy": accuracy}, test_batches),
...                      rnkey=jax.random.key(1), n_steps=None)
>>> import os
>>> os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 asks it for a local store
>>> writer = MLflowWriter(tracking_uri=f"file://{tmp}/mlruns", experiment="digits",
...                       params={"learning_rate": 1e-3})
>>> _ = writer(eval_loop(checkpoint))
>>> writer.close()
>>> client = writer.client()
>>> [m.value for m in client.get_metric_history(writer.run_id, "eval/accuracy")] == [
...     eval_loop(checkpoint).metrics["eval"]["accuracy"]]
True

Needs `pip install "flax_loop[mlflow]"` (the `mlflow-skinny` client). A
tracking server (`http://...`) or database URI needs nothing more; MLflow 3
opens a local `file://` store only with `MLFLOW_ALLOW_FILE_STORE=true`.
"""

import concurrent.futures
import math
import re
import threading
import time
from typing import Any

from flax_loop.checkpoint import Checkpoint, as_summary, expect
from flax_loop.errors import ConfigError
from flax_loop.log import is_main_process, log

_NAME = re.compile(r"[/\w.\- :]")
r"""A character MLflow takes in a metric name (its own rule, outside Windows)."""

MAX_PENDING = 100_000
r"""The most metric values kept for a store that does not take them (the oldest go)."""


def _raise_if_refused(error: Exception, tracking_uri: str | None) -> None:
    r"""Raises a `ConfigError` for a store this install can never write to
    (sending again would not help)."""
    where = tracking_uri or "the default store"
    if isinstance(error, ModuleNotFoundError):
        raise ConfigError(
            f"MLflowWriter cannot open {where}: MLflow needs the module {error.name!r} "
            "for it, which the mlflow-skinny client leaves out. Install MLflow whole "
            "(pip install mlflow) for a database store, or log to a tracking server "
            "(http://...)."
        ) from None
    if "filesystem tracking backend" in str(error):
        raise ConfigError(
            f"MLflowWriter cannot write to {where}: MLflow 3 writes to a local file "
            "store only with the environment variable MLFLOW_ALLOW_FILE_STORE=true. "
            "Set it, or use a database store (sqlite:///mlflow.db, with pip install "
            "mlflow) or a tracking server (http://...)."
        ) from error


def _mlflow() -> Any:
    try:
        import mlflow.entities
        import mlflow.tracking
    except ImportError as error:
        raise ConfigError(
            "MLflowWriter needs MLflow's client: pip install 'flax_loop[mlflow]'."
        ) from error
    return mlflow


class MLflowWriter:
    r"""Logs each summary's metrics (as `group/name`, at its step) to one MLflow run.

    The run is created at the first write, in `experiment` (created if
    missing), with `params` logged as its parameters; `close()` marks it
    finished. Only process 0 logs. A callable `Summary -> Summary`, so it
    chains with the other writers.

    Training never waits long for the store, nor loses a metric to it: a
    write waits at most `timeout` seconds (the store is called from a thread
    of the writer's own), none while the store has not answered the last
    one, and what the store did not take (it is down, it
    does not answer) is a note, kept and sent again with the next write and
    at `close()`. A metric name MLflow does not accept (`"top-1 (%)"`) is
    logged with each such character replaced by `_`, said once.

    Args:
        tracking_uri: where the store is (`None`: MLflow's default, e.g.
            `MLFLOW_TRACKING_URI`).
        experiment: the experiment's name.
        run_name: the run's name (MLflow picks one by default).
        params: hyperparameters to log once (values become strings).
        timeout: the most seconds a write (or `close`) waits for the store.
        stdout: whether to print the writer's notes (a renamed metric, a
            store that did not take a write).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "flax_loop",
        run_name: str | None = None,
        params: dict[str, Any] | None = None,
        timeout: float = 5.0,
        stdout: bool = True,
    ) -> None:
        if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ConfigError(f"timeout must be a positive number of seconds; got {timeout!r}.")
        if not isinstance(experiment, str) or not experiment:
            raise ConfigError(f"experiment must be a non-empty name; got {experiment!r}.")
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"params must be a dict of hyperparameters; got {params!r}.")
        _mlflow()
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.params = dict(params or {})
        self.timeout = float(timeout)
        self.stdout = stdout
        self.run_id: str | None = None
        r"""the MLflow run's id, once the first summary is written."""
        self._pending: list[Any] = []  # metrics the store has not taken yet
        self._sending: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._renamed: dict[str, str] = {}

    def client(self) -> Any:
        r"""An `mlflow.tracking.MlflowClient` of the store."""
        return _mlflow().tracking.MlflowClient(tracking_uri=self.tracking_uri)

    def _start(self, client: Any) -> str:
        mlflow = _mlflow()
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment)
        run = client.create_run(experiment_id, run_name=self.run_name)
        params = [mlflow.entities.Param(str(k), str(v)) for k, v in self.params.items()]
        if params:
            client.log_batch(run.info.run_id, params=params)
        return str(run.info.run_id)

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        r"""Logs the summary's (or checkpoint's train) metrics and returns it unchanged."""
        expect(checkpoint, Checkpoint, "MLflowWriter")
        if not is_main_process():
            return checkpoint
        summary = as_summary(checkpoint)
        now = int(time.time() * 1000)
        entity = _mlflow().entities.Metric
        metrics = []
        for group, values in summary.metrics.items():
            for name, value in values.items():
                number = _number(value)
                if number is not None:
                    key = self._name(f"{group}/{name}")
                    metrics.append(entity(key, number, now, int(summary.step)))
        with self._lock:
            self._pending.extend(metrics)
            del self._pending[:-MAX_PENDING]
        self._send(f"step {summary.step}'s metrics")
        return checkpoint

    def _name(self, name: str) -> str:
        r"""`name`, or the name MLflow takes for it (said once)."""
        if name not in self._renamed:
            taken = "".join(c if _NAME.fullmatch(c) else "_" for c in name)[:250]
            if taken != name:
                log(
                    f"MLflow does not take the metric name {name!r}: it is logged as {taken!r}.",
                    self.stdout,
                    lead="MLflowWriter:",
                    style="yellow",
                )
            self._renamed[name] = taken
        return self._renamed[name]

    def _send(self, what: str) -> bool:
        r"""Sends what the store has not taken, waiting at most `timeout`
        seconds; `False` (and a note) if it is not all taken by then."""
        if self._sending is not None and not self._sending.done():
            # the store has not answered the last send: no second wait for it
            why = "it has not answered the last write yet"
        else:
            self._sending = _in_thread(self._send_pending)
            try:
                self._sending.result(timeout=self.timeout)
                return True
            except concurrent.futures.TimeoutError:
                why = f"it has not answered in {self.timeout:g} s"
            except Exception as error:
                _raise_if_refused(error, self.tracking_uri)
                why = f"{type(error).__name__}: {str(error)[:300]}"
        with self._lock:
            n_kept = len(self._pending)
        log(
            f"the store {self.tracking_uri or '(default)'} did not take {what} ({why}); "
            f"{n_kept} values are kept and sent again with the next write.",
            self.stdout,
            lead="MLflowWriter:",
            style="yellow",
        )
        return False

    def _send_pending(self) -> None:
        r"""On the writer's thread: starts the run if needed, then logs every
        pending metric (those it did not log stay pending)."""
        client = self.client()
        if self.run_id is None:
            self.run_id = self._start(client)
        while True:
            with self._lock:
                batch = self._pending[:1000]  # MLflow's batch limit
            if not batch:
                return
            client.log_batch(self.run_id, metrics=batch)
            with self._lock:
                del self._pending[: len(batch)]

    def close(self) -> None:
        r"""Sends what is pending (waiting at most `timeout`) and marks the run
        finished; a store that does not answer is a note."""
        if not is_main_process():
            return
        if self._pending and not self._send("the metrics kept"):
            return
        if self.run_id is not None:
            try:
                _in_thread(self._finish_run, self.run_id).result(timeout=self.timeout)
            except Exception as error:
                log(
                    f"the run could not be marked finished ({type(error).__name__}: "
                    f"{str(error)[:300]}).",
                    self.stdout,
                    lead="MLflowWriter:",
                    style="yellow",
                )

    def _finish_run(self, run_id: str) -> None:
        self.client().set_terminated(run_id, "FINISHED")

    def __enter__(self) -> "MLflowWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _in_thread(function: Any, *args: Any) -> concurrent.futures.Future:
    r"""`function(*args)` called on a daemon thread: a store that never answers
    holds neither the caller nor the interpreter's exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # the caller's to see
            future.set_exception(error)

    threading.Thread(target=run, name="flax_loop-mlflow", daemon=True).start()
    return future


def _number(value: Any) -> float | None:
    r"""A metric as MLflow takes it: a finite number (else `None`, not logged)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
