"""The documentation site builds offline, warnings as errors, and documents every public name."""

import os
import re
import subprocess
import sys

import pytest

import flax_loop
import flax_loop.checkpoint
import flax_loop.step
from tests.helpers import ROOT

pytest.importorskip("myst_nb")

MODULES_NOT_NAMES = {"errors", "random", "__version__"}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "docs",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_the_site_builds_with_every_guide_and_notebook(site):
    for page in ("index", "api", "notebooks/quickstart", "notebooks/nnx"):
        assert (site / f"{page}.html").is_file(), page
    guides = sorted(name for name in os.listdir(site / "guides") if name.endswith(".html"))
    assert guides == sorted(
        f"{name}.html"
        for name in (
            "getting_started", "iterator", "models", "data", "checkpoints", "logging", "recipes",
            "beyond_supervised", "own_step", "whole_batch", "devices", "interruptions", "speed", "time_and_memory",
            "behaviour", "from_nnx_tutorial", "from_train_state", "from_keras", "migrating",
        )
    )  # fmt: skip
    # Notebook pages show their stored outputs (the training table, the plot).
    assert "<img" in (site / "notebooks" / "nnx.html").read_text()
    assert "<img" in (site / "notebooks" / "quickstart.html").read_text()
    # A guide is not an empty shell.
    assert "OrbaxCheckpointWriter" in (site / "guides" / "checkpoints.html").read_text()


def test_every_public_name_is_documented(site):
    html = (site / "api.html").read_text()
    anchors = set(re.findall(r'id="(flax_loop[\w.]*)"', html))
    names = [n for n in flax_loop.__all__ if n not in MODULES_NOT_NAMES]
    names += list(flax_loop.checkpoint.__all__) + list(flax_loop.step.__all__)
    homes = ("flax_loop", "flax_loop.checkpoint", "flax_loop.errors", "flax_loop.step")
    missing = [name for name in names if not any(f"{home}.{name}" in anchors for home in homes)]
    assert not missing, f"public names without an API entry: {missing}"
    for module in (flax_loop, flax_loop.checkpoint, flax_loop.step):
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value) and name not in MODULES_NOT_NAMES:
                assert (value.__doc__ or "").strip(), f"{name} has no docstring"


def test_references_to_jax_flax_and_optax_link_their_published_pages(site):
    # Every {py:...} role of the pages and guides resolves through the
    # inventories kept in docs/_inventories (the site builds offline) to a
    # link to the project's own documentation; the kept files are current.
    import sys

    from sphinx.util.inventory import InventoryFile

    sys.path.insert(0, os.path.join(ROOT, "docs", "_inventories"))
    from make_inventories import PROJECTS, inventory, path

    uris = {}
    for name, (_, base) in PROJECTS.items():
        with open(path(name), "rb") as file:
            assert file.read() == inventory(name), f"rerun make_inventories.py ({name})"
        for items in InventoryFile.loads(inventory(name), uri=base).data.values():
            uris.update({target: item.uri for target, item in items.items()})
    pages = [os.path.join(ROOT, "docs", "index.md"), os.path.join(ROOT, "docs", "api.md")]
    guides = os.path.join(ROOT, "docs", "guides")
    pages += [os.path.join(guides, name) for name in sorted(os.listdir(guides))]
    html = "".join(path.read_text() for path in site.rglob("*.html"))
    targets = set()
    for page in pages:
        text = open(page).read()
        targets |= set(re.findall(r"\{py:(?:func|class)\}`(?:[^`<]*<)?~?([\w.]+)>?`", text))
    assert len(targets) >= 10, targets
    for target in sorted(targets):
        assert target in uris, f"{target}: not in docs/_inventories (make_inventories.py)"
        assert f'href="{uris[target]}"' in html, f"{target}: no link to {uris[target]}"


def test_every_type_field_of_the_api_page_is_a_type(site):
    # napoleon takes an attribute docstring's first line "words: text" as a
    # type; the API page shows prose there unless the docstrings avoid it
    html = (site / "api.html").read_text()
    fields = re.findall(
        r">Type<span class=\"colon\">:</span></dt>\s*<dd[^>]*>(.*?)</dd>", html, re.S
    )
    types = [re.sub(r"<[^>]+>", "", field).strip() for field in fields]
    prose = [
        text
        for text in types
        if not re.fullmatch(r"[\w.\[\], |()'\"-]+", text)
        or " " in text.replace(" | ", "|").replace(", ", ",")
    ]
    assert not prose, prose
