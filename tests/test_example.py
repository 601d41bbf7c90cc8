"""README's first command: examples/train_digits.py trains, writes checkpoints,
and run again resumes from them where its data stream left off."""

import os
import subprocess
import sys

from tests.flags import xla_flags
from tests.helpers import ROOT


def run_example(output_dir, n_steps):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "train_digits.py"),
            "--output-dir",
            str(output_dir),
            "--n-steps",
            str(n_steps),
            "--n-steps-per-checkpoint",
            "50",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        # one device, as on a laptop; compiled as the suite compiles
        env={**os.environ, "XLA_FLAGS": xla_flags(1), "COLUMNS": "100"},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout + result.stderr


def test_the_example_trains_and_resumes_where_its_data_left_off(tmp_path):
    first = run_example(tmp_path, 100)
    assert "Final test accuracy at step 100: " in first
    checkpoints = tmp_path / "checkpoints"
    assert sorted(name for name in os.listdir(checkpoints) if name.startswith("regular.")) == [
        "regular.100.ckpt",
        "regular.50.ckpt",
    ]
    second = run_example(tmp_path, 200)
    assert "Resumed from step 100" in second
    assert "cannot be repositioned" not in second and "restarts" not in second
    accuracy = float(second.split("Final test accuracy at step 200: ")[1].split()[0])
    assert accuracy > 0.8
