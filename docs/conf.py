"""Sphinx configuration of fastattn's documentation site (`make docs`).

The pages are Markdown (MyST); the API reference is autodoc over the docstrings, which are
Google style (napoleon). fastattn is imported from this checkout: its Python parts import
without the compiled extension, so the site builds before (or without) a build of the kernels.
Nothing is mocked. The pages' Python examples run as tests (tests/test_docs.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "fastattn"
author = "the fastattn authors"
copyright = "the fastattn authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# `name` in a docstring is code, as in the Markdown pages.
default_role = "code"

# Headings get anchors, so that pages link to sections (guides/attention.md#paged-kv-cache).
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
# The modules subclass torch.nn classes; their inherited members are torch's and documented
# there (a docstring of torch's would also bring its own reST warnings into this build).
autodoc_inherit_docstrings = False

html_theme = "furo"
html_title = "fastattn"
html_static_path = ["_static"]
