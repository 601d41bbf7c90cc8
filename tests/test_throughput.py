"""Throughput in every checkpoint: examples, tokens and FLOPs a second, MFU."""

import json
import time
from types import SimpleNamespace

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from flax_loop import JsonLinesWriter, TrainLoop, TrainTask
from flax_loop.errors import ConfigError
from flax_loop.run.throughput import PEAK_FLOPS, device_peak
from tests.helpers import cross_entropy

WIDTHS = (64, 512, 512, 10)
BATCH = 128


class Dense3(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in WIDTHS[1:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(WIDTHS[-1])(x)


def dense_batches():
    rows = np.random.default_rng(0)
    x = rows.normal(size=(BATCH, WIDTHS[0])).astype(np.float32)
    y = rows.integers(0, 10, BATCH).astype(np.int32)
    return [(x, y)] * 100


def by_hand():
    """A dense layer's forward pass is 2 * batch * fan_in * fan_out FLOPs;
    its backward pass twice that (the gradients of its weights and of its
    inputs): 6 * batch * weights for a step, the optimizer's elementwise work
    aside (it is 0.1% of it here)."""
    weights = sum(a * b for a, b in zip(WIDTHS, WIDTHS[1:]))
    return 6 * BATCH * weights


def run(n_devices=1, n_steps=20, every=10, data=None, peak_flops=None, **options):
    model = Dense3()
    loop = TrainLoop(
        model.init,
        TrainTask(model.apply, optax.adam(1e-3), cross_entropy, data or dense_batches(), **options),
        jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        devices=jax.devices()[:n_devices],
        stdout=False,
    )
    if peak_flops is not None:
        loop.peak_flops = peak_flops
    return list(loop)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_a_dense_steps_flops_match_the_count_by_hand(n_devices):
    checkpoints = run(n_devices, peak_flops=1e12)
    for checkpoint in checkpoints:
        rates = checkpoint.throughput
        # XLA counts the whole step (4 devices: each its quarter of the batch)
        assert rates["flops_per_step"] == pytest.approx(by_hand(), rel=0.10)
        seconds = checkpoint.elapsed_time
        assert rates["examples_per_second"] == pytest.approx(BATCH * 10 / seconds)
        per_device = rates["flops_per_step"] * 10 / seconds / n_devices
        assert rates["flops_per_second_per_device"] == pytest.approx(per_device)
        assert rates["mfu"] == pytest.approx(per_device / 1e12)
        assert "tokens_per_second" not in rates  # float inputs are no tokens


def test_elapsed_time_counts_the_devices_work_on_an_intervals_last_steps():
    # Dispatch runs up to 16 steps ahead of the devices, more than an
    # interval of 10 here: an interval's time must run until its statistics
    # arrive, so it is nearly the whole call that waited for them (it was
    # the dispatches' time alone, about a tenth of the call).
    model = Dense3()
    loop = TrainLoop(
        model.init,
        TrainTask(model.apply, optax.adam(1e-3), cross_entropy, dense_batches()),
        jax.random.key(0),
        n_steps=40,
        n_steps_per_checkpoint=10,
        devices=jax.devices()[:1],
        stdout=False,
    )
    loop.next_checkpoint()  # compiles
    for _ in range(3):
        started = time.perf_counter()
        checkpoint = loop.next_checkpoint()
        call = time.perf_counter() - started
        assert 0.7 * call < checkpoint.elapsed_time <= call


def test_tokens_are_counted_for_token_ids_or_as_told():
    tokens = np.random.default_rng(0).integers(0, 50, (16, 12)).astype(np.int32)

    class Embedder(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(50)(nn.Embed(50, 8)(ids))

    def loss(logits, targets):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def rates(**options):
        model = Embedder()
        loop = TrainLoop(
            model.init,
            TrainTask(model.apply, optax.sgd(0.1), loss, [(tokens, tokens)] * 10, **options),
            jax.random.key(0),
            n_steps=4,
            n_steps_per_checkpoint=4,
            stdout=False,
            devices=jax.devices()[:1],
        )
        (checkpoint,) = list(loop)
        return checkpoint.throughput, checkpoint.elapsed_time

    default, seconds = rates()
    assert default["tokens_per_second"] == pytest.approx(16 * 12 * 4 / seconds)
    told, seconds = rates(tokens=lambda batch: int((batch[0] > 0).sum()))
    assert told["tokens_per_second"] == pytest.approx(int((tokens > 0).sum()) * 4 / seconds)
    assert "mfu" not in told  # a CPU's peak is not listed


def test_throughput_reaches_the_writers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonLinesWriter(str(path)) as writer:
        for checkpoint in run(n_steps=10, every=10, peak_flops=1e12):
            writer(checkpoint)
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    for name in ("examples_per_second", "flops_per_step", "flops_per_second_per_device", "mfu"):
        assert record[f"train/{name}"] > 0


def test_peaks_are_looked_up_by_device_kind():
    def kind(name):
        return device_peak(SimpleNamespace(device_kind=name))

    assert kind("NVIDIA H100 80GB HBM3") == 989e12
    assert kind("NVIDIA H100 PCIe") == 756e12
    assert kind("NVIDIA A100-SXM4-40GB") == 312e12
    assert kind("TPU v5 lite") == 197e12
    assert kind("TPU v4") == 275e12
    assert kind("cpu") is None
    assert all(peak > 1e14 for _, peak in PEAK_FLOPS)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"peak_flops": 0}, "peak_flops must be"),
        ({"peak_flops": "989e12"}, "peak_flops must be"),
        ({"tokens": lambda batch: batch["ids"]}, r"tokens\(batch\) raised"),
        ({"tokens": lambda batch: 1.5}, "whole number"),
    ],
    ids=["zero-peak", "text-peak", "failing-tokens", "fractional-tokens"],
)
def test_bad_throughput_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        run(n_steps=1, every=1, **options)


@pytest.mark.parametrize("every", [8, 4], ids=["8-of-4", "4-of-4"])
def test_flops_are_read_from_several_steps_a_dispatch_too(every):
    """A checkpoint every 8 steps at 4 a dispatch compiles the groups of
    four; every 4 at 4 only the interval's closing group (a scan of three
    and the last step alone): its FLOPs are two steps'."""
    model = Dense3()
    loop = TrainLoop(
        model.init,
        TrainTask(model.apply, optax.adam(1e-3), cross_entropy, dense_batches()),
        jax.random.key(0),
        n_steps=16,
        n_steps_per_checkpoint=every,
        steps_per_dispatch=4,
        devices=jax.devices()[:1],
        stdout=False,
    )
    for checkpoint in loop:  # no single step compiles
        assert checkpoint.throughput["flops_per_step"] == pytest.approx(by_hand(), rel=0.10)
    assert loop.compiled.status()["one"] == "on first call"
