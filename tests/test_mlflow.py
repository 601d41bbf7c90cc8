"""MLflowWriter: summaries and hyperparameters in an MLflow store, read back with its client."""

import jax
import optax
import pytest

from flax_loop import EvalLoop, EvalTask, MLflowWriter
from flax_loop.errors import ConfigError
from tests.helpers import MLP, accuracy, digits_loop, digits_split

pytest.importorskip("mlflow")

_, _, X_TEST, Y_TEST = digits_split()


def test_summaries_and_hyperparameters_reach_the_store(tmp_path):
    schedule = optax.linear_schedule(1e-2, 1e-3, 20)
    loop = digits_loop(
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=schedule),
        n_steps=20,
        n_steps_per_checkpoint=10,
        n_devices=1,
    )
    evaluate = EvalLoop(
        EvalTask(MLP().apply, {"accuracy": accuracy}, [(X_TEST, Y_TEST)]), rnkey=jax.random.key(1)
    )
    uri = f"file://{tmp_path}/mlruns"
    summaries = []
    with MLflowWriter(uri, experiment="digits", run_name="adam", params={"batch": 32}) as writer:
        for checkpoint in loop:
            summaries.append(writer(evaluate(checkpoint)))
    client = writer.client()
    run = client.get_run(writer.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "adam"
    assert run.data.params == {"batch": "32"}
    assert client.get_experiment(run.info.experiment_id).name == "digits"
    for key in ("eval/accuracy", "train/loss", "train/learning_rate"):
        history = client.get_metric_history(writer.run_id, key)
        group, name = key.split("/")
        assert [(m.step, m.value) for m in history] == [
            (s.step, pytest.approx(s.metrics[group][name])) for s in summaries
        ], key
    # The schedule's value at each checkpoint's last step (the optimizer's count).
    rates = [m.value for m in client.get_metric_history(writer.run_id, "train/learning_rate")]
    assert rates == pytest.approx([float(schedule(9)), float(schedule(19))])


def test_a_bad_experiment_is_a_config_error():
    with pytest.raises(ConfigError, match="experiment"):
        MLflowWriter(experiment="")
