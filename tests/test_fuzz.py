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

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from flax_loop import (
    CheckpointFile,
    CheckpointFileReader,
    CheckpointFileWriter,
    set_console,
)
from flax_loop.checkpoint import format, parse
from flax_loop.errors import CheckpointError
from tests.helpers import MLP, SLOW, hand_trained

SCALE = 1 if SLOW else 4


def fuzz(max_examples):
    """Hypothesis settings: `max_examples` with FLAX_LOOP_SLOW=1, a quarter of them by default."""
    return settings(
        max_examples=max_examples // SCALE,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid checkpoint file (bytes) and the initializer it restores into."""
    directory = tmp_path_factory.mktemp("valid")
    (checkpoint,) = hand_trained(2, 2, MLP(features=(8,)))
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
    set_console(Console(file=io.StringIO()))
    yield str(directory)
    set_console(None)


@pytest.fixture(autouse=True)
def no_hang():
    def hang(*args):
        raise TimeoutError("the reader hung")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def read(directory, data, initializer, step=2):
    """Reads `data` as the only checkpoint file, named for `step`: whether it
    was accepted (any failure must be a flax_loop `CheckpointError`)."""
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    with open(os.path.join(directory, f"regular.{step}.ckpt"), "wb") as handle:
        handle.write(data)
    try:
        restored = CheckpointFileReader(dir=directory, target=None)(initializer)
    except CheckpointError:
        return False
    assert restored.step == step
    return True


def parts(data):
    """The arrays (bytes) and the footer (a dict) of a valid file."""
    footer_size, _, _ = format.TAIL.unpack(data[-format.TAIL.size :])
    data_end = len(data) - format.TAIL.size - footer_size
    footer = msgpack.unpackb(data[data_end : data_end + footer_size], raw=False)
    return data[format.HEAD.size : data_end], footer


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


def test_the_fuzz_reader_accepts_the_valid_file(place, valid):
    assert read(place, valid[0], valid[1])
    assert read(place, rebuild(*parts(valid[0])), valid[1])  # rebuilt: the same file


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.text(max_size=8)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


@fuzz(200)
@given(
    metrics=st.dictionaries(
        st.text(max_size=6),
        st.dictionaries(st.text(max_size=6), st.floats(allow_nan=False), max_size=3),
        max_size=3,
    ),
    data_state=msgpack_values,
)
def test_valid_files_with_any_metrics_and_data_state_are_accepted(
    place, valid, metrics, data_state
):
    blob, footer = parts(valid[0])
    footer = {**footer, "metrics": metrics, "data_state": data_state}
    assert read(place, rebuild(blob, footer), valid[1])


def _nested(depth):
    tree = {}
    for _ in range(depth):
        tree = {"a": tree}
    return tree


def _with_leaf(footer, value):
    tree = json_copy(footer["tree"])
    tree["model_params"]["Dense_0"]["kernel"] = value
    return {**footer, "tree": tree}


def json_copy(tree):
    if isinstance(tree, dict):
        return {key: json_copy(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [json_copy(value) for value in tree]
    return tree


def _count_as_float(footer):
    table = [dict(entry) for entry in footer["arrays"]]
    for entry in table:
        if entry["dtype"] == "int32" and entry["shape"] == []:
            entry["dtype"] = "float32"  # same bytes, same checksum: a float count
    return {**footer, "arrays": table}


HOSTILE = {
    "990-deep-tree": (
        lambda f: {**f, "tree": {**f["tree"], "model_state": _nested(990)}},
        2,
        "deeper than",
    ),
    "step-2**40": (lambda f: {**f, "step": 2**40}, 2**40, "invalid step"),
    "leaf-is-a-string": (lambda f: _with_leaf(f, "kernel"), 2, "holds a str .*Dense_0/kernel"),
    "leaf-is-none": (lambda f: _with_leaf(f, None), 2, "holds a NoneType .*Dense_0/kernel"),
    "float-count": (_count_as_float, 2, "count: model int32\\[\\], file float32\\[\\]"),
    "name-disagrees": (lambda f: f, 1000, "its name says step 1000, its contents step 2"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hand_made_files_with_valid_checksums_are_refused(place, valid, name):
    change, step, message = HOSTILE[name]
    blob, footer = parts(valid[0])
    for entry in os.listdir(place):
        os.remove(os.path.join(place, entry))
    with open(os.path.join(place, f"regular.{step}.ckpt"), "wb") as handle:
        handle.write(rebuild(blob, change(footer)))
    with pytest.raises(CheckpointError, match=message) as error:
        CheckpointFileReader(dir=place, target=None)(valid[1])
    assert type(error.value).__name__ in ("CheckpointCorruptError", "CheckpointMismatchError")


def test_a_renamed_copy_does_not_outrank_the_real_newest_file(place, valid):
    for entry in os.listdir(place):
        os.remove(os.path.join(place, entry))
    for name in ("regular.2.ckpt", "regular.1000.ckpt"):
        with open(os.path.join(place, name), "wb") as handle:
            handle.write(valid[0])
    assert CheckpointFileReader(dir=place, target=None)(valid[1]).step == 2


def rebuild(arrays_blob, footer):
    """A file with a valid frame and checksum around any footer."""
    packed = msgpack.packb(footer, use_bin_type=True)
    return (
        format.HEAD.pack(format.MAGIC, format.FORMAT_VERSION)
        + arrays_blob
        + packed
        + format.TAIL.pack(len(packed), zlib.crc32(packed), format.END_MAGIC)
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
        "format": format.FORMAT_NAME,
        "version": format.FORMAT_VERSION,
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
            "format": format.FORMAT_NAME,
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
        format.HEAD.pack(format.MAGIC, 1)
        + bogus_footer
        + format.TAIL.pack(len(bogus_footer), zlib.crc32(bogus_footer), format.END_MAGIC)
    )
    tracemalloc.start()
    try:
        for data in [rebuild(bytes(64), footer) for footer in footers] + [bogus]:
            with pytest.raises(CheckpointError):
                path = os.path.join(place, "regular.1.ckpt")
                with open(path, "wb") as handle:
                    handle.write(data)
                parse.read(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes"


def test_a_valid_file_still_reads(place, valid):
    for entry in os.listdir(place):
        os.remove(os.path.join(place, entry))
    with open(os.path.join(place, "regular.2.ckpt"), "wb") as handle:
        handle.write(valid[0])
    restored = CheckpointFileReader(dir=place, target=None)(valid[1])
    assert restored.step == 2
    np.testing.assert_array_equal(
        np.asarray(restored.model_params["Dense_0"]["kernel"]),
        np.asarray(valid[1].model_params["Dense_0"]["kernel"]),
    )
