"""The checkpoint reader against random and mutated files.

Over 2,000 cases: any outcome is either a clean read or a flax_loop error,
never another exception, never a hang, never an allocation that a length
field larger than the file asks for.
"""

import io
import os
import signal
import struct
import tracemalloc
import zlib

import jax
import msgpack
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from flax_loop import (
    CheckpointFile,
    CheckpointFileReader,
    CheckpointFileWriter,
    TrainLoop,
    TrainTask,
    console,
)
from flax_loop.checkpoint import _format
from flax_loop.errors import CheckpointError
from tests.helpers import MLP, batches, cross_entropy, digits_split


def fuzz(max_examples):
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid checkpoint file (bytes) and the initializer it restores into."""
    x, y, _, _ = digits_split()
    model = MLP(features=(8,))
    loop = TrainLoop(
        init=model.init,
        task=TrainTask(model.apply, optax.adam(1e-2), cross_entropy, batches(x, y, 32)),
        rnkey=jax.random.key(0),
        n_steps=2,
        n_steps_per_checkpoint=2,
        stdout=False,
    )
    directory = tmp_path_factory.mktemp("valid")
    (checkpoint,) = list(loop)
    CheckpointFileWriter(output_dir=str(directory))(checkpoint)
    data = (directory / "regular.2.ckpt").read_bytes()
    initializer = CheckpointFile(
        model_params=checkpoint.model_params,
        model_state={},
        optimizer_state=checkpoint.optimizer_state,
        step=0,
    )
    return data, initializer


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    console._console = Console(file=io.StringIO())
    yield str(directory)
    console._console = None


@pytest.fixture(autouse=True)
def no_hang():
    def hang(*args):
        raise TimeoutError("the reader hung")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def read(directory, data, initializer):
    """Reads `data` as the only checkpoint file; a clean read or a flax_loop error."""
    with open(os.path.join(directory, "regular.7.ckpt"), "wb") as handle:
        handle.write(data)
    try:
        CheckpointFileReader(dir=directory, target=None)(initializer)
    except CheckpointError:
        pass


@fuzz(500)
@given(data=st.binary(max_size=4096))
def test_random_bytes(place, valid, data):
    read(place, data, valid[1])


@fuzz(1000)
@given(
    mutations=st.lists(
        st.tuples(
            st.sampled_from(["flip", "set", "cut", "insert", "delete"]),
            st.integers(0, 2**31),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_files(place, valid, mutations):
    data = bytearray(valid[0])
    for kind, where, value in mutations:
        if not data:
            break
        where %= len(data)
        if kind == "flip":
            data[where] ^= 1 << (value % 8)
        elif kind == "set":
            data[where] = value
        elif kind == "cut":
            del data[where:]
        elif kind == "insert":
            data[where:where] = bytes([value]) * (value % 7 + 1)
        elif kind == "delete":
            del data[where : where + value % 7 + 1]
    read(place, bytes(data), valid[1])


def rebuild(arrays_blob, footer):
    """A file with a valid frame and checksum around any footer."""
    packed = msgpack.packb(footer, use_bin_type=True)
    return (
        _format._HEAD.pack(_format.MAGIC, _format.FORMAT_VERSION)
        + arrays_blob
        + packed
        + _format._TAIL.pack(len(packed), zlib.crc32(packed), _format.END_MAGIC)
    )


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
)
values = st.recursive(
    st.one_of(scalars, st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=5))),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(
            ["float32", "int32", "bool", "bfloat16", "object", "float128", "<f4"]
        ),
        "shape": st.lists(st.integers(-5, 2**40), max_size=4),
        "offset": st.integers(-10, 2**40),
        "nbytes": st.integers(-10, 2**42),
        "crc32": st.integers(0, 2**32 - 1),
    }
)


@fuzz(600)
@given(
    arrays=st.lists(entries, max_size=4),
    tree=values,
    step=st.one_of(st.integers(-3, 2**64 - 1), values),
    extra=st.dictionaries(
        st.sampled_from(["metrics", "rnkey", "data_state", "format", "version"]), values
    ),
)
def test_structured_footers_with_valid_checksums(place, valid, arrays, tree, step, extra):
    footer = {
        "format": _format.FORMAT_NAME,
        "version": _format.FORMAT_VERSION,
        "arrays": arrays,
        "tree": tree,
        "step": step,
        **extra,
    }
    read(place, rebuild(bytes(64), footer), valid[1])


def test_length_fields_larger_than_the_file_allocate_nothing(place, valid):
    huge = [
        {"dtype": "float32", "shape": [2**30], "offset": 12, "nbytes": 2**32, "crc32": 0},
        {"dtype": "float64", "shape": [2**20, 2**20], "offset": 12, "nbytes": 2**43, "crc32": 0},
    ]
    ref = msgpack.ExtType(1, struct.pack("<I", 0))
    footers = [
        {
            "format": _format.FORMAT_NAME,
            "version": 1,
            "arrays": [entry],
            "tree": {"model_params": ref},
            "step": 1,
        }
        for entry in huge
    ]
    # A msgpack array header that claims 2**31 elements in a few bytes.
    bogus_footer = b"\xdd\x80\x00\x00\x00"
    bogus = (
        _format._HEAD.pack(_format.MAGIC, 1)
        + bogus_footer
        + _format._TAIL.pack(len(bogus_footer), zlib.crc32(bogus_footer), _format.END_MAGIC)
    )
    tracemalloc.start()
    try:
        for data in [rebuild(bytes(64), footer) for footer in footers] + [bogus]:
            with pytest.raises(CheckpointError):
                path = os.path.join(place, "regular.7.ckpt")
                with open(path, "wb") as handle:
                    handle.write(data)
                _format.read(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes"


def test_a_valid_file_still_reads(place, valid):
    with open(os.path.join(place, "regular.7.ckpt"), "wb") as handle:
        handle.write(valid[0])
    restored = CheckpointFileReader(dir=place, target=None)(valid[1])
    assert restored.step == 2
    np.testing.assert_array_equal(
        np.asarray(restored.model_params["Dense_0"]["kernel"]),
        np.asarray(valid[1].model_params["Dense_0"]["kernel"]),
    )
