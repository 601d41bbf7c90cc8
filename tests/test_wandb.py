"""`WandbWriter` writes a W&B run offline (`WANDB_MODE=offline`, never the
network): its config, each checkpoint's and evaluation's metrics at their
steps in one row a step, the last step in its summary; read back from the
run's own file."""

import glob
import json
import os
import time

import jax
import pytest

from flax_loop import EvalLoop, EvalTask, WandbWriter
from flax_loop.errors import CheckpointError, ConfigError
from tests.helpers import MLP, accuracy, digits_split, hand_trained

wandb_proto = pytest.importorskip("wandb.proto.wandb_internal_pb2")
from google.protobuf.message import DecodeError  # noqa: E402  (W&B's records are protobuf's)


def records(path):
    """The protobuf records of a `.wandb` file (a log of 32 KiB blocks, each
    record a 7-byte header: checksum, length, kind; kinds 1 and 4 end one)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header
            position += 32768 - position % 32768
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_proto.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def finished_records(directory):
    """The records of the one run under `directory` once W&B has written
    them all: `run.finish()` can return before W&B's service has flushed
    the run's log (the file still only its 7-byte header after 3 of 20
    finishes, whole a millisecond later), so this waits, 30 s at most, for
    the record that ends a run ("exit")."""
    (path,) = glob.glob(os.path.join(directory, "wandb", "offline-run-*", "*.wandb"))
    deadline = time.monotonic() + 30
    while True:
        try:
            found = list(records(path))
        except DecodeError:  # a record only partly written yet
            found = []
        if any(record.WhichOneof("record_type") == "exit" for record in found):
            return found
        assert time.monotonic() < deadline, f"{path} holds no exit record after 30 s"
        time.sleep(0.01)


def name(item):
    """An item's key (W&B writes a key holding "/" as its parts)."""
    return item.key or "/".join(item.nested_key)


def test_a_run_holds_the_config_and_the_metrics_at_their_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _, _, x_test, y_test = digits_split()
    model = MLP()
    loop = hand_trained(20, 10, model)
    evaluate = EvalLoop(
        EvalTask(model.apply, {"accuracy": accuracy}, [(x_test, y_test)]),
        rnkey=jax.random.key(1),
        n_steps=None,
    )
    losses, accuracies = [], []
    with WandbWriter(
        project="digits", name="mlp", config={"learning_rate": 1e-2}, dir=str(tmp_path)
    ) as write:
        for checkpoint in loop:
            write(checkpoint)
            summary = write(evaluate(checkpoint))
            losses.append(checkpoint.mean_loss)
            accuracies.append(summary.metrics["eval"]["accuracy"])
    rows, config, summary = [], {}, {}
    for record in finished_records(tmp_path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({name(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            assert record.run.project == "digits" and record.run.display_name == "mlp"
        elif kind == "summary":
            summary.update({name(u): json.loads(u.value_json) for u in record.summary.update})
    assert config["learning_rate"] == 1e-2
    assert [row["_step"] for row in rows] == [10, 20]
    assert [row["train/loss"] for row in rows] == pytest.approx(losses, rel=1e-6)
    assert [row["eval/accuracy"] for row in rows] == pytest.approx(accuracies, rel=1e-6)
    assert summary["step"] == 20


def test_a_run_without_dir_goes_under_the_current_directory(tmp_path, monkeypatch):
    # W&B itself keeps the folder of the first run in the process: a later
    # run without `dir` went there (the suite's guides left runs in the
    # project's folder).
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (checkpoint,) = hand_trained(1, 1)
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir(), later.mkdir()
    with WandbWriter(project="digits", dir=str(first), stdout=False) as write:
        write(checkpoint)
    monkeypatch.chdir(later)
    with WandbWriter(project="digits", stdout=False) as write:
        write(checkpoint)
    assert len(glob.glob(str(first / "wandb" / "offline-run-*"))) == 1
    assert len(glob.glob(str(later / "wandb" / "offline-run-*"))) == 1


def test_bad_arguments_are_named():
    with pytest.raises(ConfigError, match="config must be a dict"):
        WandbWriter(config=[("learning_rate", 1e-2)])


def test_a_folder_it_cannot_write_to_is_named(tmp_path, monkeypatch):
    """W&B put such a run in its temporary folder without a word. (Root
    writes anywhere: a folder without write permission is simulated.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    (checkpoint,) = hand_trained(1, 1)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match="cannot make dir=.*a-file/run"):
        WandbWriter(project="digits", dir=str(tmp_path / "a-file" / "run"), stdout=False)(
            checkpoint
        )
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(CheckpointError, match="cannot write under dir=.*no write permission"):
        WandbWriter(project="digits", dir=str(tmp_path), stdout=False)(checkpoint)
