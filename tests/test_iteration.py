"""The loop as an iterator: `next(loop)` keeps one generator, and an
iterator held to interpreter exit ends quietly."""

import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from flax_loop import TrainLoop, TrainTask
from tests.helpers import ROOT, cross_entropy


def test_an_iterator_held_to_interpreter_exit_ends_quietly():
    program = textwrap.dedent(
        """
        import jax, numpy as np, optax, flax.linen as nn
        from flax_loop import TrainLoop, TrainTask
        model = nn.Dense(3)
        def ce(logits, labels):
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        data = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
        task = TrainTask(model.apply, optax.sgd(0.1), ce, data)
        iterator = iter(TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0),
                                  n_steps=4, stdout=False))
        print(next(iterator).step)
        held = TrainLoop(init=model.init, task=task, rnkey=jax.random.key(0), n_steps=4,
                         stdout=False)
        print(next(held).step, next(held).step)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1", "2"]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr


def test_next_goes_on_from_where_it_stopped_and_ends_at_n_steps():
    data = [(np.ones((8, 4), np.float32), np.arange(8) % 3)] * 4
    model = __import__("flax.linen", fromlist=["Dense"]).Dense(3)
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.sgd(0.1), cross_entropy, data),
        rnkey=jax.random.key(0),
        n_steps=3,
        devices=jax.devices()[:1],
        stdout=False,
    )
    assert [next(loop).step for _ in range(3)] == [1, 2, 3]
    with pytest.raises(StopIteration):
        next(loop)
    loop.n_steps = 4  # a raised target: next goes on
    assert next(loop).step == 4
