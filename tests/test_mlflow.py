"""MLflowWriter: summaries and hyperparameters in an MLflow store, read back with its client."""

import importlib.util

import jax
import optax
import pytest

from flax_loop import EvalLoop, EvalTask, MLflowWriter
from flax_loop.errors import ConfigError
from tests.helpers import MLP, accuracy, digits_loop, digits_split, hand_trained

# Found, not imported: collecting the suite does not pay for importing MLflow.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="needs mlflow: pip install flax_loop[mlflow]"
)

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


def test_stores_this_install_cannot_write_to_are_config_errors(tmp_path, monkeypatch):
    (checkpoint,) = hand_trained(2, 2)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # a fresh shell
    writer = MLflowWriter(f"file://{tmp_path}/mlruns", experiment="digits")
    with pytest.raises(ConfigError, match="only with the environment variable MLFLOW_ALLOW_FILE"):
        writer(checkpoint)
    try:
        import alembic  # noqa: F401
    except ImportError:  # the mlflow-skinny client: no database stores
        writer = MLflowWriter(f"sqlite:///{tmp_path}/mlflow.db", experiment="digits")
        with pytest.raises(ConfigError, match="needs the module 'alembic'.*pip install mlflow"):
            writer(checkpoint)


def _history(writer, key):
    return [(m.step, m.value) for m in writer.client().get_metric_history(writer.run_id, key)]


def test_a_store_that_never_answers_costs_a_write_at_most_its_timeout(monkeypatch, capsys):
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    try:
        writer = MLflowWriter(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=1.0)
        (checkpoint,) = hand_trained(1, 1)
        assert writer(checkpoint) is checkpoint  # returns: it waited at most its timeout
        first = " ".join(capsys.readouterr().out.split())
        assert writer(checkpoint) is checkpoint
        second = " ".join(capsys.readouterr().out.split())
        writer.close()
    finally:
        silent.close()
    # said, not timed (a loaded machine stretches any wall-clock bound)
    assert "has not answered in 1 s" in first and "kept and sent again" in first
    assert "has not answered the last write yet" in second  # no second wait for it


def test_metrics_the_store_refused_are_sent_with_the_next_write(tmp_path, capsys):
    from mlflow.exceptions import MlflowException

    from flax_loop import Summary

    loop = hand_trained(3, 1)
    writer = MLflowWriter(f"file://{tmp_path}/mlruns")
    client = writer.client()
    real = client.log_batch
    refusals = [MlflowException("the store is down")]

    def flaky(*args, **kwargs):
        if refusals:
            raise refusals.pop()
        return real(*args, **kwargs)

    client.log_batch = flaky
    writer.client = lambda: client
    for checkpoint in loop:
        writer(
            Summary(
                metrics={"eval": {"top-1 (%)": 90.0 + checkpoint.step, "acc": 0.5}},
                **vars(checkpoint),
            )
        )
    writer.close()
    out = capsys.readouterr().out
    assert "the store is down" in out
    assert "MLflow does not take the metric name 'eval/top-1 (%)'" in out
    # Nothing lost: step 1's metrics went with step 2's; the bad name was renamed.
    assert _history(writer, "eval/top-1 ___") == [(1, 91.0), (2, 92.0), (3, 93.0)]
    assert [step for step, _ in _history(writer, "eval/acc")] == [1, 2, 3]
    assert client.get_run(writer.run_id).info.status == "FINISHED"
