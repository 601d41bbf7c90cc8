"""EvalLoop, summaries, SummaryLogger, SummaryWriter and the serial pipeline."""

import dataclasses
import io
import os
import struct
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import redex
from rich.console import Console

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    Summary,
    TrainLoop,
    TrainTask,
    set_console,
)
from flax_loop.errors import DataExhaustedError
from flax_loop.output.console import SummaryLogger
from flax_loop.output.tensorboard import SummaryWriter
from tests.helpers import (
    MLP,
    BatchNormDropoutNet,
    accuracy,
    batches,
    cross_entropy,
    digits_split,
    file_names,
    hand_trained,
    train,
)

X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = digits_split()
MODEL = MLP()


@pytest.fixture(scope="module")
def checkpoint():
    (checkpoint,) = hand_trained(40, 40, model=MODEL)
    return checkpoint


def numpy_logits(params, x):
    hidden = np.maximum(
        x @ np.asarray(params["Dense_0"]["kernel"]) + np.asarray(params["Dense_0"]["bias"]), 0
    )
    return hidden @ np.asarray(params["Dense_1"]["kernel"]) + np.asarray(params["Dense_1"]["bias"])


def ragged_batches(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize("n_devices", [1, 4])
def test_eval_accuracy_equals_numpy_with_ragged_last_batch(checkpoint, n_devices):
    # 300 examples in batches of 27: the last has 3 examples, fewer than the devices.
    data = ragged_batches(X_TEST, Y_TEST, 27)
    assert len(data[-1][0]) == 3
    per_example_loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
        logits, labels
    )
    eval_loop = EvalLoop(
        EvalTask(MODEL.apply, {"accuracy": accuracy, "loss": per_example_loss}, data),
        rnkey=jax.random.key(1),
        n_steps=None,
        devices=jax.devices()[:n_devices],
    )
    summary = eval_loop(checkpoint)
    logits = numpy_logits(checkpoint.model_params, X_TEST)
    expected_accuracy = float(np.mean(np.argmax(logits, -1) == Y_TEST))
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected_loss = float(-np.mean(log_probs[np.arange(300), Y_TEST]))
    assert summary.metrics["eval"]["accuracy"] == pytest.approx(expected_accuracy, abs=1e-6)
    assert summary.metrics["eval"]["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert expected_accuracy > 0.8
    # A second pass over the same list gives the same numbers.
    assert eval_loop(checkpoint).metrics["eval"] == summary.metrics["eval"]


def test_scalar_mean_metric_is_exact_over_examples(checkpoint):
    # cross_entropy returns the batch mean; uneven batches must still give the
    # mean over examples, not the mean of batch means.
    data = ragged_batches(X_TEST, Y_TEST, 128)  # 128, 128, 44
    summary = EvalLoop(
        EvalTask(MODEL.apply, {"loss": cross_entropy}, data), jax.random.key(1), n_steps=None
    )(checkpoint)
    logits = numpy_logits(checkpoint.model_params, X_TEST)
    expected = float(cross_entropy(jnp.asarray(logits), Y_TEST))
    assert summary.metrics["eval"]["loss"] == pytest.approx(expected, rel=1e-5)


def test_eval_data_as_a_function_and_as_a_stream(checkpoint):
    fresh = lambda: iter(ragged_batches(X_TEST, Y_TEST, 100))
    whole = EvalLoop(
        EvalTask(MODEL.apply, {"accuracy": accuracy}, fresh), jax.random.key(1), n_steps=None
    )
    first = whole(checkpoint).metrics["eval"]["accuracy"]
    assert whole(checkpoint).metrics["eval"]["accuracy"] == first

    # A stream: each evaluation takes the next n_steps batches, exactly those.
    def consecutive():
        for start in range(0, 300, 50):
            yield X_TEST[start : start + 50], Y_TEST[start : start + 50]

    stream = EvalLoop(
        EvalTask(MODEL.apply, {"accuracy": accuracy}, consecutive()), jax.random.key(1), n_steps=2
    )
    logits = np.asarray(MODEL.apply({"params": checkpoint.model_params}, X_TEST))
    correct = np.argmax(logits, -1) == Y_TEST
    for start in (0, 100, 200):
        expected = correct[start : start + 100].mean()
        assert stream(checkpoint).metrics["eval"]["accuracy"] == pytest.approx(expected, abs=1e-6)

    once = EvalLoop(
        EvalTask(MODEL.apply, {"accuracy": accuracy}, iter(ragged_batches(X_TEST, Y_TEST, 100))),
        jax.random.key(1),
        n_steps=None,
    )
    assert once(checkpoint).metrics["eval"]["accuracy"] == first
    with pytest.raises(DataExhaustedError, match="fresh iterator"):
        once(checkpoint)


def test_train_statistics_are_global_norms(checkpoint):
    # timings pinned: how long the fixture compiled depends on the worker's cache
    breakdown = {"compile": 0.5, "steps": 1.5}
    checkpoint = dataclasses.replace(checkpoint, elapsed_time=2.0, time_breakdown=breakdown)
    summary = EvalLoop(
        EvalTask(MODEL.apply, {"accuracy": accuracy}, ragged_batches(X_TEST, Y_TEST, 100)),
        jax.random.key(1),
        n_steps=None,
    )(checkpoint)
    train = summary.metrics["train"]
    norm = lambda tree: np.sqrt(
        sum(np.sum(np.asarray(leaf, np.float64) ** 2) for leaf in jax.tree.leaves(tree))
    )
    assert train["gradients_l2norm"] == pytest.approx(norm(checkpoint.grads), rel=1e-5)
    assert train["weights_l2norm"] == pytest.approx(norm(checkpoint.model_params), rel=1e-5)
    assert train["loss"] == pytest.approx(checkpoint.mean_loss)
    assert train["last_loss"] == pytest.approx(checkpoint.loss)
    # the speed leaves the interval's compiling out (this first one compiled)
    assert train["seconds_per_step"] == pytest.approx(1.5 / 40)
    assert train["steps_per_second"] == pytest.approx(40 / 1.5)
    assert summary.step == checkpoint.step and summary.model_params is checkpoint.model_params


def test_chained_eval_loops_merge_their_groups(checkpoint):
    valid = EvalLoop(
        EvalTask(
            MODEL.apply, {"accuracy": accuracy}, ragged_batches(X_TEST[:150], Y_TEST[:150], 50)
        ),
        jax.random.key(1),
        n_steps=None,
        group="valid",
    )
    test = EvalLoop(
        EvalTask(
            MODEL.apply, {"accuracy": accuracy}, ragged_batches(X_TEST[150:], Y_TEST[150:], 50)
        ),
        jax.random.key(1),
        n_steps=None,
        group="test",
    )
    summary = redex.combinator.serial(valid, test)(checkpoint)
    assert set(summary.metrics) == {"train", "valid", "test"}
    both = np.mean([summary.metrics["valid"]["accuracy"], summary.metrics["test"]["accuracy"]])
    whole = EvalLoop(
        EvalTask(MODEL.apply, {"accuracy": accuracy}, ragged_batches(X_TEST, Y_TEST, 50)),
        jax.random.key(1),
        n_steps=None,
    )(checkpoint)
    assert both == pytest.approx(whole.metrics["eval"]["accuracy"], abs=1e-6)
    # Two loops on the same group merge their metrics.
    loss_loop = EvalLoop(
        EvalTask(MODEL.apply, {"loss": cross_entropy}, ragged_batches(X_TEST, Y_TEST, 50)),
        jax.random.key(1),
        n_steps=None,
    )
    merged = loss_loop(whole)
    assert set(merged.metrics["eval"]) == {"accuracy", "loss"}


def test_eval_with_dropout_rng_and_batchnorm_state():
    model = BatchNormDropoutNet()
    (checkpoint,) = train(30, 30, model=model, collections={"apply": ["dropout"]})
    data = ragged_batches(X_TEST, Y_TEST, 64)
    deterministic = EvalLoop(
        EvalTask(partial(model.apply, train=False), {"accuracy": accuracy}, data),
        jax.random.key(1),
        n_steps=None,
    )(checkpoint)
    variables = {"params": checkpoint.model_params, **checkpoint.model_state}
    expected = float(np.mean(np.argmax(model.apply(variables, X_TEST, train=False), -1) == Y_TEST))
    assert deterministic.metrics["eval"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    # Stochastic evaluation (dropout on) draws its keys from the eval rnkey:
    # the same key gives the same mean loss, another key another one.
    per_example_loss = optax.softmax_cross_entropy_with_integer_labels
    stochastic = lambda key: EvalLoop(
        EvalTask(
            lambda v, x, **kw: model.apply(v, x, train=True, mutable=["batch_stats"], **kw)[0],
            {"loss": per_example_loss},
            data,
        ),
        key,
        n_steps=None,
        collections={"apply": ["dropout"]},
    )(checkpoint).metrics["eval"]["loss"]
    assert stochastic(jax.random.key(1)) == stochastic(jax.random.key(1))
    assert stochastic(jax.random.key(1)) != pytest.approx(stochastic(jax.random.key(2)), rel=1e-4)


def render(processor_output_fn):
    buffer = io.StringIO()
    set_console(Console(file=buffer, width=100, highlight=False))
    try:
        processor_output_fn()
    finally:
        set_console(None)
    return buffer.getvalue()


def test_summary_logger_prints_a_table(checkpoint):
    logger = SummaryLogger(verbose=True)
    first = Summary(metrics={"train": {"loss": 0.5}, "eval": {}}, **vars(checkpoint))
    later = Summary(
        metrics={"train": {"loss": 0.25}, "eval": {"accuracy": 0.97, "f1": 1e-7}},
        **vars(checkpoint),
    )
    out = render(lambda: (logger(first), logger(later)))
    assert out.count("Step 40: 40 steps in") == 2
    assert " 0.5\n" in out and " 0.25\n" in out
    assert "accuracy" in out and " 0.97\n" in out and " 1e-07\n" in out
    assert all(line == line.rstrip() for line in out.splitlines())  # a log file: no padding
    assert logger(first) is first


def test_the_compact_summary_logger_prints_one_line_a_checkpoint(checkpoint):
    # the timings are pinned: the fixture's own compile time depends on what
    # the worker compiled before (0.00 s when the program was cached)
    fields = {
        **vars(checkpoint),
        "train_metrics": {"loss": 0.123456, "accuracy": 0.5},
        "elapsed_time": 1.5,
        "time_breakdown": {"compile": 0.75, "steps": 0.75},
    }
    metrics = {
        "train": {"loss": 0.123456, "accuracy": 0.5, "gradients_l2norm": 3.0},
        "eval": {"accuracy": 0.97},
    }
    out = render(lambda: SummaryLogger(compact=True)(Summary(metrics=metrics, **fields)))
    expected = (
        "Step 40: 40 steps in 1.50 s (0.75 s of it compiling)"
        " | train loss 0.12346 accuracy 0.5 | eval accuracy 0.97"
    )
    assert out == expected + "\n"
    fields["time_breakdown"] = {"compile": 0.0, "steps": 1.5}  # a cached program: no note
    out = render(lambda: SummaryLogger(compact=True)(Summary(metrics=metrics, **fields)))
    assert out.startswith("Step 40: 40 steps in 1.50 s | train loss")


def read_events(directory):
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in file_names(directory):
        with open(os.path.join(directory, name), "rb") as stream:
            data = stream.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            record = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_summary_writer_events_read_back(checkpoint, tmp_path):
    writer = SummaryWriter(output_dir=str(tmp_path))
    for step, accuracy_value in [(10, 0.5), (20, 0.75)]:
        fields = {**vars(checkpoint), "step": step}
        summary = Summary(
            metrics={"train": {"loss": 1.0 / step}, "eval": {"accuracy": accuracy_value}}, **fields
        )
        assert writer(summary) is summary
    assert len(os.listdir(tmp_path)) == 1  # one event file kept open
    # Flushed per summary: readable before close.
    scalars = read_events(str(tmp_path))
    assert scalars["eval/accuracy"] == [(10, 0.5), (20, 0.75)]
    assert scalars["train/loss"] == [(10, pytest.approx(0.1)), (20, pytest.approx(0.05))]
    writer.close()


def test_serial_pipeline_of_every_processor(tmp_path):
    model = MLP()
    loop = TrainLoop(
        init=CheckpointFileReader(dir=str(tmp_path / "ckpt"), target=model.init),
        task=TrainTask(model.apply, optax.adam(1e-2), cross_entropy, batches(X_TRAIN, Y_TRAIN, 32)),
        rnkey=jax.random.key(0),
        n_steps=30,
        n_steps_per_checkpoint=10,
        stdout=False,
    )
    with SummaryWriter(str(tmp_path / "tb")) as tensorboard:
        process = redex.combinator.serial(
            EvalLoop(
                EvalTask(model.apply, {"accuracy": accuracy}, ragged_batches(X_TEST, Y_TEST, 100)),
                jax.random.key(1),
                n_steps=None,
                devices=loop.devices,
            ),
            SummaryLogger(stdout=False),
            tensorboard,
            CheckpointFileWriter(output_dir=str(tmp_path / "ckpt"), keep=3),
        )
        summaries = [process(checkpoint) for checkpoint in loop]
    assert [s.step for s in summaries] == [10, 20, 30]
    assert all(isinstance(s, Summary) for s in summaries)
    assert file_names(tmp_path / "ckpt") == [
        "regular.10.ckpt",
        "regular.20.ckpt",
        "regular.30.ckpt",
    ]
    events = read_events(str(tmp_path / "tb"))
    accuracies = [value for _, value in events["eval/accuracy"]]
    assert accuracies == pytest.approx([s.metrics["eval"]["accuracy"] for s in summaries])
    # Every step's loss, at its own step: the training curve.
    losses = np.concatenate([s.losses for s in summaries])
    assert [step for step, _ in events["train/step_loss"]] == list(range(1, 31))
    assert [value for _, value in events["train/step_loss"]] == pytest.approx(losses.tolist())
    raw = CheckpointFileReader(dir=str(tmp_path / "ckpt"), target=None).read_newest()
    assert raw.metrics["eval"]["accuracy"] == pytest.approx(
        summaries[-1].metrics["eval"]["accuracy"]
    )


def test_json_lines_writer_appends_one_record_per_summary(checkpoint, tmp_path):
    import json

    from flax_loop import JsonLinesWriter

    path = tmp_path / "logs" / "metrics.jsonl"
    summary = Summary(
        metrics={"train": {"loss": 0.5}, "eval": {"accuracy": 0.9, "bad": float("nan")}},
        **vars(checkpoint),
    )
    with JsonLinesWriter(str(path)) as writer:
        assert writer(summary) is summary
        writer(checkpoint)  # a plain checkpoint: its train statistics
    with JsonLinesWriter(str(path)) as again:  # a restart appends
        again(summary)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3
    assert records[0]["step"] == checkpoint.step and records[0]["eval/accuracy"] == 0.9
    assert records[0]["eval/bad"] is None and records[0]["train/loss"] == 0.5
    assert records[1]["train/loss"] == pytest.approx(float(checkpoint.mean_loss))
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_json(path, lines=True)
    assert list(frame["step"]) == [checkpoint.step] * 3


@pytest.mark.parametrize(
    "earlier",
    [b'{"step": 1}\n{"step": 2, "tra', b'{"step": 1}\n\xff\xfe\xc3'],
    ids=["cut", "bytes"],
)
def test_json_lines_after_a_cut_or_undecodable_line_start_a_line_of_their_own(
    checkpoint, tmp_path, earlier
):
    """An earlier writer's last line cut mid-record (no newline), or bytes
    that are no UTF-8: the next record is a whole line of its own, the lines
    before it are kept byte for byte, and the first write says so."""
    import json

    from flax_loop import JsonLinesWriter

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(earlier)
    shown = io.StringIO()
    set_console(Console(file=shown, width=300))
    try:
        with JsonLinesWriter(str(path)) as writer:
            writer(checkpoint)
    finally:
        set_console(None)
    content = path.read_bytes()
    assert content.startswith(earlier + b"\n") and content.endswith(b"\n")
    last = json.loads(content.splitlines()[-1])
    assert last["step"] == checkpoint.step
    said = " ".join(shown.getvalue().split())
    assert "holds 2 lines of an earlier run" in said and "its last line is cut" in said


def test_a_model_evaluated_in_training_mode_is_an_apply_error_with_the_remedy():
    from flax_loop.errors import ApplyError
    from tests.helpers import BatchNormDropoutNet, digits_loop

    model = BatchNormDropoutNet()
    loop = digits_loop(model, n_steps=2, n_devices=1, collections={"apply": ["dropout"]})
    checkpoint = loop.next_checkpoint()
    task = EvalTask(model.apply, {"accuracy": accuracy}, [(X_TEST, Y_TEST)])
    collections = {"apply": ["dropout"]}
    with pytest.raises(
        ApplyError, match="changes its 'batch_stats' while it is evaluated.*train=False"
    ):
        EvalLoop(task, jax.random.key(1), n_steps=None, collections=collections)(checkpoint)
    evaluation = EvalTask(
        partial(model.apply, train=False), {"accuracy": accuracy}, [(X_TEST, Y_TEST)]
    )
    summary = EvalLoop(evaluation, jax.random.key(1), n_steps=None)(checkpoint)
    variables = {"params": checkpoint.model_params, **checkpoint.model_state}
    logits = model.apply(variables, X_TEST, train=False)
    expected = float(np.mean(np.argmax(logits, -1) == Y_TEST))
    assert summary.metrics["eval"]["accuracy"] == pytest.approx(expected, abs=1e-6)
