"""Sphinx configuration of steadfast's documentation site.

Sphinx with MyST (Markdown) as PyTorch and NVIDIA's Resiliency Extension use: autodoc
reads the public API's docstrings, and ``_ext/steadfast_reference.py`` writes the CLI,
event and exit-code references from the code at every build, so they cannot drift.
``make docs`` builds it; ``make test`` builds it with warnings as errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent / "src"))

project = "steadfast"
author = "the steadfast authors"
copyright = "2026, the steadfast authors"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" / "Attributes:" sections
    "steadfast_reference",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]

# MyST: heading anchors for links such as [x](guides/slurm.md#spare-nodes), checked by
# the build; `(label)=` targets and {ref} roles for the generated references.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

html_theme = "furo"
html_title = "steadfast"
html_static_path = ["_static"]
html_css_files = ["steadfast.css"]
html_theme_options = {"navigation_with_keys": True}
# offline: no external link is fetched or checked (`make test` checks internal ones)
linkcheck_ignore = [r"https?://.*"]
