"""A program written for flax-extra 0.0.2 runs with only its imports changed."""

import os
import re

from tests.helpers import ROOT, file_names


def guide_program() -> str:
    """The flax-extra program of docs/guides/migrating.md, its imports changed."""
    text = open(os.path.join(ROOT, "docs", "guides", "migrating.md")).read()
    (program,) = re.findall(r"```python\n(.*?)```", text, re.S)
    return program


def with_imports_changed(program: str) -> str:
    return re.sub(r"^(from|import) flax_extra", r"\1 flax_loop", program, flags=re.MULTILINE)


def test_flax_extra_program_runs_with_imports_changed(tmp_path, monkeypatch, one_device):
    program = guide_program()
    original = re.sub(r"^(from|import) flax_loop", r"\1 flax_extra", program, flags=re.MULTILINE)
    assert "flax_loop" not in original and original.count("flax_extra") == 4
    assert with_imports_changed(original) == program  # nothing but the imports differs
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "flax_extra_program"}
    exec(compile(program, "flax_extra_program.py", "exec"), namespace)
    summary = namespace["summary"]
    assert summary.step == 200
    assert summary.metrics["eval"]["lnpp"] < 0.6
    assert set(summary.metrics["train"]) >= {"loss", "seconds_per_step", "gradients_l2norm"}
    names = file_names(tmp_path / "checkpoints")
    assert "regular.200.ckpt" in names
    assert any(name.startswith("lowest.eval.lnpp.") for name in names)
    assert os.listdir(tmp_path / "tensorboard")

    # Running the same program again resumes: the loop is already at step 200.
    exec(compile(program, "flax_extra_program.py", "exec"), namespace)
    assert namespace["train_loop"].step == 200
