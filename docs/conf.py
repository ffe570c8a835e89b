"""Sphinx configuration of the celery-leases documentation.

The pages are the Markdown files of this directory, read by MyST as they are
(they also render on GitHub); api.md pulls the reference from the docstrings
with autodoc. Build with ``make docs`` (``sphinx-build -W``: any warning fails).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# autodoc imports the package from this checkout, installed or not.
sys.path.insert(0, str(ROOT))

import celery_leases  # noqa: E402

project = "celery-leases"
author = "the celery-leases authors"
copyright = "celery-leases authors, BSD-3-Clause"
release = celery_leases.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

root_doc = "index"
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Links such as [design.md](design.md#the-fencing-token) use GitHub's heading
# slugs; MyST makes the same anchors for headings down to ####.
myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}

html_theme = "alabaster"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_title = f"celery-leases {release}"
html_theme_options = {
    "description": "Leases with fencing tokens for Celery tasks",
    "fixed_sidebar": True,
    "page_width": "1160px",
}


# A page may link to a file of the repository outside docs/ (an example's
# README): on GitHub that works; here it would be an unknown document. Such
# links become the link text plus the file's path; links between pages stay
# links, and a broken one still fails the build.
_OUTSIDE_LINK = re.compile(r"\[([^\]]+)\]\(\.\./([^)#\s]+)(?:#[^)\s]*)?\)")


def _outside_links(app, docname, source):
    source[0] = _OUTSIDE_LINK.sub(r"\1 (repository file `\2`)", source[0])


def setup(app):
    app.connect("source-read", _outside_links)
