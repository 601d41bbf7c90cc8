"""Sphinx configuration: API reference from the docstrings, guides in MyST, notebooks as pages.

Built offline by the suite (tests/test_docs_site.py) with warnings as errors:
    python -m sphinx -W -b html docs docs/_build/html
"""

import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The notebooks live in notebooks/ (the suite executes them there); the site
# renders copies of them with their stored outputs.
os.makedirs(os.path.join(ROOT, "docs", "notebooks"), exist_ok=True)
# Only the notebooks themselves: an executed copy (`jupyter nbconvert --execute`
# writes `NAME.nbconvert.ipynb` beside it) is no page of the site.
for name in sorted(os.listdir(os.path.join(ROOT, "notebooks"))):
    if name.endswith(".ipynb") and not name.endswith(".nbconvert.ipynb"):
        shutil.copy(
            os.path.join(ROOT, "notebooks", name), os.path.join(ROOT, "docs", "notebooks", name)
        )

project = "flax_loop"
author = "the flax_loop authors"
copyright = "the flax_loop authors"  # noqa: A001 - Sphinx's name
# Docstrings write names in single backquotes: shown as code, never as <cite>.
default_role = "code"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.intersphinx", "sphinx.ext.napoleon"]
nb_execution_mode = "off"  # the suite runs them; pages show their stored outputs
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {
    "members": True,
    "inherited-members": True,
    "special-members": "__call__",  # EvalLoop, the writers and loggers are called
}
napoleon_google_docstring = True
# Links into JAX's, Flax's and Optax's documentation, from inventories kept
# here (docs/_inventories/make_inventories.py) so that the site builds
# offline; the links go to the published pages.
sys.path.insert(0, os.path.join(ROOT, "docs", "_inventories"))
import make_inventories  # noqa: E402

intersphinx_mapping = {
    name: (url, make_inventories.path(name)) for name, (_, url) in make_inventories.PROJECTS.items()
}
html_theme = "furo" if __import__("importlib").util.find_spec("furo") else "alabaster"
html_title = "flax_loop"
exclude_patterns = ["_build"]
suppress_warnings = ["myst.header"]  # README fragments start below their own heading
