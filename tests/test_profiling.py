"""A window of steps traced with jax.profiler."""

import glob
import os

import pytest

from flax_loop import ProfileSteps
from flax_loop.errors import ConfigError
from tests.helpers import digits_loop


@pytest.mark.parametrize("steps_per_dispatch", [1, 4])
def test_the_requested_steps_are_traced_into_the_log_dir(tmp_path, steps_per_dispatch):
    profile = ProfileSteps(start=5, n=6, log_dir=str(tmp_path / "trace"))
    loop = digits_loop(
        n_steps=16,
        n_steps_per_checkpoint=8,
        n_devices=1,
        profile=profile,
        steps_per_dispatch=steps_per_dispatch,
    )
    checkpoints = list(loop)
    assert [checkpoint.step for checkpoint in checkpoints] == [8, 16]  # across a checkpoint
    assert profile.traced_steps == list(range(5, 11))
    traces = glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000
    assert b"train" in open(traces[0], "rb").read()  # the step annotations


def test_a_run_that_stops_inside_the_window_stops_the_trace(tmp_path):
    profile = ProfileSteps(start=3, n=100, log_dir=str(tmp_path / "trace"))
    loop = digits_loop(n_steps=6, n_steps_per_checkpoint=6, n_devices=1, profile=profile)
    list(loop)
    assert profile.traced_steps == [3, 4, 5, 6]
    assert glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    # The profiler is free again: another trace can start.
    import jax

    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"start": 0}, "start"),
        ({"start": 1, "n": 0}, "n"),
        ({"start": 1, "log_dir": ""}, "log_dir"),
    ],
)
def test_bad_windows_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        ProfileSteps(**options)
    with pytest.raises(ConfigError, match="ProfileSteps"):
        digits_loop(n_steps=1, profile="steps 1-10")
