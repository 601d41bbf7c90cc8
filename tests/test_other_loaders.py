"""Hugging Face datasets and PyTorch DataLoaders as data: these run where the (heavy)
packages are installed; neither is in the test extra."""

import jax
import numpy as np
import optax
import pytest

from flax_loop import CheckpointFileReader, CheckpointFileWriter
from tests.helpers import MLP, digits_loop, digits_split

X, Y, _, _ = digits_split()
N_BATCHES = len(X) // 32  # 46; the partial batch dropped


def numpy_batches():
    return [(X[i * 32 : (i + 1) * 32], Y[i * 32 : (i + 1) * 32]) for i in range(N_BATCHES)]


def final_params(data, n_steps=60, **options):
    loop = digits_loop(optimizer=optax.sgd(0.1), data=data, n_steps=n_steps, n_devices=1, **options)
    loop.n_steps_per_checkpoint = 30
    return list(loop)[-1]


def assert_same(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_a_hugging_face_dataset_trains_and_resumes_as_numpy_batches(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": X, "y": Y}).with_format("numpy")

    class Batches:
        """README's recipe: an epoch of (x, y) batches per iter()."""

        def __iter__(self):
            for batch in table.iter(batch_size=32, drop_last_batch=True):
                yield batch["x"], batch["y"]

    expected = final_params(numpy_batches())
    straight = final_params(Batches())  # 60 steps: into the second epoch
    assert_same(straight.model_params, expected.model_params)
    with CheckpointFileWriter(output_dir=str(tmp_path)) as writer:
        writer(final_params(Batches(), n_steps=30))
    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP().init)
    assert_same(final_params(Batches(), init=reader).model_params, expected.model_params)


def test_a_pytorch_dataloader_trains_and_resumes_as_numpy_batches(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(
        TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)), batch_size=32, drop_last=True
    )
    expected = final_params(numpy_batches())
    straight = final_params(loader)
    assert_same(straight.model_params, expected.model_params)
    with CheckpointFileWriter(output_dir=str(tmp_path)) as writer:
        writer(final_params(loader, n_steps=30))
    reader = CheckpointFileReader(dir=str(tmp_path), target=MLP().init)
    assert_same(final_params(loader, init=reader).model_params, expected.model_params)
