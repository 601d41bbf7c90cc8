"""The release as a user installs it: a wheel built from the source tree,
installed in a fresh place with nothing of the checkout, and what it holds."""

import configparser
import os
import shutil
import subprocess
import sys
import zipfile

import flax_loop
from tests.helpers import ROOT

NOT_SHIPPED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", "runs", "ckpts", ".venv", "venv"
)


def test_a_wheel_builds_and_installs_apart_from_the_checkout(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SHIPPED)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("flax_loop-*.whl")
    assert wheel.name.startswith(f"flax_loop-{flax_loop.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"flax_loop-{flax_loop.__version__}.dist-info/METADATA").decode()
        entry_points = archive.read(
            f"flax_loop-{flax_loop.__version__}.dist-info/entry_points.txt"
        ).decode()
    assert "flax_loop/py.typed" in names and "flax_loop/step/core.py" in names
    assert not any(name.startswith(("tests/", "benchmarks/", "docs/")) for name in names)
    assert "flax-loop = flax_loop.output.cli:run" in entry_points
    # the tested version ranges, as setup.cfg pins them
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    for requirement in setup["options"]["install_requires"].split("\n"):
        if requirement.strip():
            name = requirement.split()[0]
            assert any(
                line.startswith(f"Requires-Dist: {name}") and "<" in line
                for line in metadata.splitlines()
            ), requirement

    # installed where nothing of the checkout (nor its editable install) is seen
    target = tmp_path / "installed"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import flax_loop; "
        "print(flax_loop.__version__, flax_loop.__file__)"
    )
    ran = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(target)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    version, where = ran.stdout.split()
    assert version == flax_loop.__version__ and where.startswith(str(target))
