"""Bad input: a flax_loop error that names the bad value; nothing written is touched.

Every case runs against a checkpoint directory holding a valid file of step 5;
after the error, the directory holds exactly the same bytes.
"""

import itertools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_loop import (
    CheckpointFileReader,
    CheckpointFileWriter,
    EvalLoop,
    EvalTask,
    HighestCheckpointFileWriter,
    Summary,
    SummaryLogger,
    TrainLoop,
    TrainTask,
)
from flax_loop.checkpoint import format
from flax_loop.errors import (
    ApplyError,
    BatchError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    ConfigError,
    DataExhaustedError,
    FlaxLoopError,
    InitError,
    LossError,
    MetricError,
    NonFiniteError,
)
from tests.helpers import (
    MLP,
    BatchNormDropoutNet,
    accuracy,
    batches,
    cross_entropy,
    digits_split,
    directory_bytes,
    hand_trained,
)

X, Y, X_TEST, Y_TEST = digits_split()
MODEL = MLP()


def stream(batch_size=32):
    return batches(X, Y, batch_size)


def train(directory, data=None, loss=cross_entropy, model=MODEL, **options):
    """Resumes from `directory` (step 5), trains to 10, writes each checkpoint there."""
    task = TrainTask(
        apply=options.pop("apply", model.apply),
        optimizer=options.pop("optimizer", optax.adam(1e-2)),
        loss=loss,
        data=stream() if data is None else data,
    )
    loop = TrainLoop(
        init=options.pop("init", CheckpointFileReader(dir=str(directory), target=model.init)),
        task=task,
        rnkey=options.pop("rnkey", jax.random.key(0)),
        n_steps=options.pop("n_steps", 10),
        n_steps_per_checkpoint=options.pop("n_steps_per_checkpoint", 5),
        stdout=False,
        **options,
    )
    writer = CheckpointFileWriter(output_dir=str(directory))
    for checkpoint in loop:
        writer(checkpoint)


def changing(first, then, at=2):
    return itertools.chain(itertools.islice(first, at), then)


def cast(data, dtype):
    return ((x.astype(dtype), y) for x, y in data)


def nan_at(index):
    for i, (x, y) in enumerate(stream()):
        yield (x * np.nan if i == index else x), y


def damage(directory, how):
    path = os.path.join(directory, "regular.5.ckpt")
    with open(path, "r+b") as handle:
        if how == "truncate":
            handle.truncate(os.path.getsize(path) - 100)
        elif how == "flip":
            handle.seek(format.HEAD.size + 77)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 1]))
        elif how == "version":
            handle.seek(8)
            handle.write((format.FORMAT_VERSION + 1).to_bytes(4, "little"))


def into_file(directory):
    path = os.path.join(directory, "regular.5.ckpt")
    CheckpointFileWriter(output_dir=path)(summary_of(directory))


def checkpoint_of(directory):
    from flax_loop import Checkpoint

    raw = CheckpointFileReader(dir=str(directory), target=None).read_newest()
    return Checkpoint(raw.model_params, {}, {}, {}, 0.0, 1, 0.0, 6)


def summary_of(directory):
    return Summary(metrics={"eval": {"loss": 0.1}}, **vars(checkpoint_of(directory)))


def summary_with_metric(directory, value):
    return Summary(metrics={"eval": {"accuracy": value}}, **vars(checkpoint_of(directory)))


def best_writer_given(value):
    from flax_loop import HighestCheckpointFileWriter

    def case(directory):
        writer = HighestCheckpointFileWriter(
            output_dir=str(directory), metric="accuracy", stdout=False
        )
        writer(summary_with_metric(directory, value))

    return case


def object_array_at_step(step):
    def data():
        for index, batch in enumerate(stream()):
            yield (np.array([object()] * 32), batch[1]) if index == step - 1 else batch

    return data()


def bfloat16_init(*args, **kwargs):
    import jax.numpy as jnp

    variables = MODEL.init(*args, **kwargs)
    return jax.tree.map(lambda v: v.astype(jnp.bfloat16), variables)


def plain_apply(variables, x):
    return MODEL.apply(variables, x)


def apply_without_state(variables, x, rngs=None, mutable=False):
    return MODEL.apply(variables, x)


DROPOUT_MODEL = BatchNormDropoutNet()


class NoisyMLP(MLP):
    """An MLP that draws from an RNG stream named "z"."""

    def __call__(self, x):
        noise = jax.random.normal(self.make_rng("z"), (self.n_classes,))
        return super().__call__(x) + 0 * noise


def consumed_generator():
    batches_once = (batch for _, batch in zip(range(2), stream()))
    list(batches_once)
    return batches_once


def raising_init(*args, **kwargs):
    raise ValueError("boom: the model cannot take these inputs")


CASES = {
    "batch-not-a-tuple": (
        lambda d: train(d, data=(x for x, _ in stream())),
        BatchError,
        r"pair .*got a ndarray",
    ),
    "wrong-nesting": (
        lambda d: train(d, data=((x, y, y) for x, y in stream())),
        BatchError,
        "tuple of length 3",
    ),
    "not-divisible": (
        lambda d: train(d, data=stream(30), devices=jax.devices()),
        BatchError,
        "size 30 does not split evenly across 4 devices",
    ),
    "rank-change": (
        lambda d: train(
            d, data=changing(stream(), ((x.reshape(-1, 8, 8), y) for x, y in stream()))
        ),
        BatchError,
        r"at step 8 differs .* in its leaf 0.*\(32, 8, 8\).*arrays, dtypes and ranks",
    ),
    "dtype-change": (
        lambda d: train(d, data=changing(stream(), cast(stream(), np.float16))),
        BatchError,
        r"at step 8.*float16",
    ),
    "empty-stream": (lambda d: train(d, data=[]), DataExhaustedError, "no batch"),
    "loss-not-scalar": (
        lambda d: train(d, loss=lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y)),
        LossError,
        r"shape \(32,\) and dtype",
    ),
    "loss-int": (
        lambda d: train(d, loss=lambda o, y: jnp.sum(jnp.argmax(o, -1) == y)),
        LossError,
        "dtype int32",
    ),
    "n-steps-negative": (
        lambda d: train(d, n_steps=-1),
        ConfigError,
        "n_steps must be >= 0; got -1",
    ),
    "checkpoint-every-zero": (
        lambda d: train(d, n_steps_per_checkpoint=0),
        ConfigError,
        "n_steps_per_checkpoint must be >= 1; got 0",
    ),
    "no-devices": (lambda d: train(d, devices=[]), ConfigError, "devices is empty"),
    "optimizer-not-optax": (
        lambda d: train(d, optimizer="adam"),
        ConfigError,
        "got 'adam' of type str",
    ),
    "init-raises": (
        lambda d: train(d, init=raising_init),
        InitError,
        "init raised ValueError: boom",
    ),
    "rnkey-not-a-key": (lambda d: train(d, rnkey=42), ConfigError, "got int"),
    "collections-not-a-list": (
        lambda d: train(d, collections={"apply": "dropout"}),
        ConfigError,
        "got 'dropout'",
    ),
    "data-not-iterable": (lambda d: train(d, data=5), ConfigError, "got int"),
    "nonfinite-mode": (lambda d: train(d, nonfinite="ignore"), ConfigError, "got 'ignore'"),
    "nan-loss": (
        lambda d: train(d, data=nan_at(2)),
        NonFiniteError,
        r"first at step 8 .*detected at step 10",
    ),
    "directory-is-a-file": (into_file, CheckpointError, "regular.5.ckpt' is a file"),
    "reader-directory-is-a-file": (
        lambda d: train(os.path.join(d, "regular.5.ckpt")),
        CheckpointError,
        "is a file",
    ),
    "unwritable-directory": (
        lambda d: CheckpointFileWriter(output_dir="/proc/flax_loop")(summary_of(d)),
        CheckpointError,
        "'/proc/flax_loop'",
    ),
    "keep-zero": (
        lambda d: CheckpointFileWriter(output_dir=str(d), keep=0),
        ConfigError,
        "keep must be >= 1; got 0",
    ),
    "another-model": (
        lambda d: train(d, model=MLP(features=(32,))),
        CheckpointMismatchError,
        r"model float32\[64, 32\], file float32\[64, 64\]",
    ),
    "truncated-file": (train, CheckpointCorruptError, "regular.5.ckpt is truncated"),
    "flipped-byte": (train, CheckpointCorruptError, "fails its checksum"),
    "newer-version": (train, CheckpointVersionError, "format version 2"),
    "metric-missing": (
        lambda d: HighestCheckpointFileWriter(output_dir=str(d), metric="accuracy", stdout=False)(
            summary_of(d)
        ),
        MetricError,
        r"eval/accuracy .*\['loss'\]",
    ),
    "logger-given-a-dict": (
        lambda d: SummaryLogger()({"step": 6, "loss": 0.5}),
        ConfigError,
        "SummaryLogger needs a Checkpoint or a Summary; got dict",
    ),
    "writer-given-a-dict": (
        lambda d: CheckpointFileWriter(output_dir=str(d))({"step": 6}),
        ConfigError,
        "CheckpointFileWriter needs a Checkpoint .*got dict",
    ),
    "n-steps-beyond-int32": (
        lambda d: train(d, n_steps=10**12),
        ConfigError,
        "n_steps must be <= 2,147,483,647; got 1,000,000,000,000",
    ),
    "best-metric-a-vector": (
        best_writer_given(np.array([0.5, 0.6])),
        MetricError,
        "eval/accuracy must be one real number; got array",
    ),
    "best-metric-none": (best_writer_given(None), MetricError, "one real number; got None"),
    "best-metric-a-string": (best_writer_given("0.9"), MetricError, "one real number; got '0.9'"),
    "object-array-mid-run": (
        lambda d: train(d, data=object_array_at_step(3), init=MODEL.init, n_steps=5),
        BatchError,
        "(?s)The batch for step 3: inputs .*converts to an object array",
    ),
    "float32-file-into-bfloat16-model": (
        lambda d: train(d, init=CheckpointFileReader(dir=str(d), target=bfloat16_init)),
        CheckpointMismatchError,
        r"regular.5.ckpt holds another model or optimizer.*Dense_0/bias: model bfloat16\[64\], "
        r"file float32\[64\]",
    ),
    "adam-file-into-adamw-run": (
        lambda d: train(d, optimizer=optax.adamw(1e-2)),
        CheckpointMismatchError,
        r"regular.5.ckpt holds another model or optimizer.*/optimizer_state/2: model empty, "
        "file absent",
    ),
    "apply-without-keywords": (
        lambda d: train(d, init=MODEL.init, apply=plain_apply),
        ApplyError,
        "task.apply must accept the keywords rngs= and mutable=.*unexpected keyword",
    ),
    "apply-without-mutated-state": (
        lambda d: train(d, init=MODEL.init, apply=apply_without_state),
        ApplyError,
        "must return \\(outputs, mutated variables\\).*returned an array of shape \\(\\d+, 10\\)"
        ".*mutable_collections=False",
    ),
    "jitted-apply": (
        lambda d: train(d, init=MODEL.init, apply=jax.jit(MODEL.apply)),
        ConfigError,
        "task.apply is compiled with jax.jit: pass the un-jitted model.apply",
    ),
    "rng-stream-without-collections": (
        lambda d: train(d, init=NoisyMLP().init, model=NoisyMLP()),
        ApplyError,
        "the RNG stream 'z'.*collections=\\{'apply': \\[.*'z'\\]\\}",
    ),
    "exhausted-generator": (
        lambda d: train(d, data=consumed_generator()),
        DataExhaustedError,
        "a generator that has already run to its end.*Make a new generator",
    ),
    "dict-batches": (
        lambda d: train(d, data=({"image": x, "label": y} for x, y in stream())),
        BatchError,
        "got a dict.*yield \\(batch\\['image'\\], batch\\['label'\\]\\).*compute_loss",
    ),
    "dropout-without-collections": (
        lambda d: train(d, init=DROPOUT_MODEL.init, model=DROPOUT_MODEL),
        ApplyError,
        "RNG stream 'dropout'.*collections=\\{'apply': \\['dropout'\\]\\}",
    ),
    "eval-metric-not-a-number": (
        lambda d: EvalLoop(
            EvalTask(MODEL.apply, {"grade": lambda logits, labels: "good"}, [(X_TEST, Y_TEST)]),
            jax.random.key(0),
        )(hand_trained(5, 5)[-1]),
        ConfigError,
        "metric 'grade' returned 'good' \\(str\\); return a number",
    ),
    "eval-n-steps-zero": (
        lambda d: EvalLoop(
            EvalTask(MODEL.apply, {"accuracy": accuracy}, []), jax.random.key(0), n_steps=0
        ),
        ConfigError,
        "n_steps must be >= 1; got 0",
    ),
}
DAMAGE = {"truncated-file": "truncate", "flipped-byte": "flip", "newer-version": "version"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pristine")
    loop = TrainLoop(
        init=MODEL.init,
        task=TrainTask(MODEL.apply, optax.adam(1e-2), cross_entropy, stream()),
        rnkey=jax.random.key(0),
        n_steps=5,
        n_steps_per_checkpoint=5,
        stdout=False,
    )
    writer = CheckpointFileWriter(output_dir=str(directory))
    for checkpoint in loop:
        writer(checkpoint)
    return directory


snapshot = directory_bytes


def test_every_case_names_its_value():
    # A case must check a message, not only an exception type.
    assert len(CASES) >= 35
    assert all(len(message) >= 6 for _, _, message in CASES.values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, pristine, tmp_path):
    case, error_type, message = CASES[name]
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    if name in DAMAGE:
        damage(str(directory), DAMAGE[name])
    before = snapshot(directory)
    with pytest.raises(error_type, match=message) as raised:
        case(str(directory))
    assert isinstance(raised.value, FlaxLoopError)
    assert snapshot(directory) == before


def test_an_error_raised_while_tracing_the_step_names_the_first_batch(tmp_path):
    def one_hot_loss(logits, labels):  # a loss written for one-hot labels, given class numbers
        return optax.softmax_cross_entropy(logits, labels).mean()

    with pytest.raises(ValueError) as raised:
        train(tmp_path, loss=one_hot_loss, init=MODEL.init)
    assert any(
        "tracing the training step" in note and "targets (32,) int32" in note
        for note in raised.value.__notes__
    )


def test_an_error_raised_while_evaluating_names_the_eval_batch():
    narrow = (X_TEST[:8, :10], Y_TEST[:8])  # inputs of another width than the model's
    evaluate = EvalLoop(EvalTask(MODEL.apply, {"accuracy": accuracy}, [narrow]), jax.random.key(0))
    with pytest.raises(Exception) as raised:
        evaluate(hand_trained(5, 5)[-1])
    assert any(
        "while evaluating" in note and "eval batch 0: inputs (8, 10) float32" in note
        for note in raised.value.__notes__
    )


LOSS_WITH_LOGITS = """
import jax, numpy as np, optax
import flax.linen as nn
from flax_loop import TrainLoop, TrainTask

model = nn.Dense(3)


def loss(logits, labels):  # returns the logits too
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits


batch = (np.ones((8, 4), np.float32), np.zeros(8, np.int32))
TrainLoop(init=model.init, task=TrainTask(model.apply, optax.sgd(0.1), loss, [batch]),
          rnkey=jax.random.key(0), n_steps=2, progress=False)
"""


def test_a_mistake_found_while_tracing_is_the_last_thing_printed():
    """The error a user needs ends the output (no note of JAX's after it, no
    traceback through the tracing internals), and names arrays by dtype and
    shape, never by JAX's tracer types."""
    import subprocess
    import sys

    from tests.flags import xla_flags
    from tests.helpers import ROOT

    result = subprocess.run(
        [sys.executable, "-c", LOSS_WITH_LOGITS], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)}, timeout=120,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) < 25, result.stderr
    assert lines[-1].startswith("flax_loop.errors.LossError: The loss function returned a tuple")
    assert "(float32[], float32[8, 3])" in lines[-1] and "Tracer" not in result.stderr
