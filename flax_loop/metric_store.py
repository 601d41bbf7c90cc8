r"""`MLflowWriter`: summaries and hyperparameters into an MLflow tracking store.

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

import math
import time
from typing import Any

from flax_loop.checkpoint import Checkpoint, as_summary, expect
from flax_loop.errors import ConfigError
from flax_loop.log import is_main_process


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

    Args:
        tracking_uri: where the store is (`None`: MLflow's default, e.g.
            `MLFLOW_TRACKING_URI`).
        experiment: the experiment's name.
        run_name: the run's name (MLflow picks one by default).
        params: hyperparameters to log once (values become strings).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "flax_loop",
        run_name: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(experiment, str) or not experiment:
            raise ConfigError(f"experiment must be a non-empty name; got {experiment!r}.")
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"params must be a dict of hyperparameters; got {params!r}.")
        _mlflow()
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.params = dict(params or {})
        self.run_id: str | None = None
        r"""the MLflow run's id, once the first summary is written."""

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
        client = self.client()
        if self.run_id is None:
            self.run_id = self._start(client)
        summary = as_summary(checkpoint)
        now = int(time.time() * 1000)
        metrics = [
            _mlflow().entities.Metric(f"{group}/{name}", float(value), now, int(summary.step))
            for group, values in summary.metrics.items()
            for name, value in values.items()
            if math.isfinite(float(value))
        ]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
        return checkpoint

    def close(self) -> None:
        r"""Marks the run finished."""
        if self.run_id is not None and is_main_process():
            self.client().set_terminated(self.run_id, "FINISHED")

    def __enter__(self) -> "MLflowWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
