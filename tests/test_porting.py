"""Programs users already have, ported as the guides port them: Flax's NNX
tutorial loop (nnx.Optimizer, nnx.jit, nnx.MultiMetric) against flax_loop
on the guide's model and data, bit for bit on one device; a Keras `fit`
script against its port (the guide asserts the numbers agree), in a fresh
process with Keras's JAX backend. (The TrainState guide asserts its own
equality; tests/test_docs.py runs it.)"""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from flax_loop import TrainLoop, TrainTask
from tests.flags import xla_flags
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("one_device")


def the_guides_program_up_to_its_loop():
    text = open(os.path.join(ROOT, "docs", "guides", "from_nnx_tutorial.md")).read()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace = {"__name__": "guide"}
    exec(block[: block.index("model = CNN(")], namespace)
    return namespace


def test_the_nnx_tutorial_loop_and_flax_loop_train_the_same_bits():
    guide = the_guides_program_up_to_its_loop()
    cnn, batches, loss_fn = guide["CNN"], guide["train"], guide["loss_fn"]
    n_steps = 12

    # the tutorial's loop, as it writes it
    model = cnn(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    def tutorial_loss(model, batch):
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):
        (loss, logits), grads = nnx.value_and_grad(tutorial_loss, has_aux=True)(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    for batch in batches[:n_steps]:
        train_step(model, optimizer, metrics, batch)
    by_hand = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tutorial_metrics = metrics.compute()

    # the port: the guide's loss (metrics by name), the same model and optimizer
    ported = cnn(rngs=nnx.Rngs(0))
    loop = TrainLoop(
        init=ported,
        task=TrainTask(ported, optax.adamw(0.005, 0.9), data=batches, compute_loss=loss_fn),
        rnkey=jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=n_steps,
        stdout=False,
    )
    checkpoint = loop.next_checkpoint()
    assert jax.tree.structure(checkpoint.model_params) == jax.tree.structure(by_hand)
    jax.tree.map(np.testing.assert_array_equal, checkpoint.model_params, by_hand)
    assert checkpoint.mean_loss == pytest.approx(float(tutorial_metrics["loss"]), rel=1e-6)
    accuracy = checkpoint.train_metrics["accuracy"]
    assert accuracy == pytest.approx(float(tutorial_metrics["accuracy"]), rel=1e-6)


def test_the_keras_fit_guide_agrees_with_keras(tmp_path):
    import importlib.util

    if importlib.util.find_spec("keras") is None:  # imported in the guide's own process
        pytest.skip("keras is not installed (the test extra installs it)")
    text = open(os.path.join(ROOT, "docs", "guides", "from_keras.md")).read()
    (tmp_path / "guide.py").write_text("\n".join(re.findall(r"```python\n(.*?)```", text, re.S)))
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one device, the suite's compile flags
    env.update(JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    result = subprocess.run(
        [sys.executable, "guide.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    keras_line, ours = (
        line for line in result.stdout.splitlines() if line.startswith(("keras ", "flax_loop "))
    )
    assert keras_line.split(None, 1)[1] == ours.split(None, 1)[1]  # the epochs' losses
