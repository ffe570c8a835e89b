"""The documentation site (docs/, Sphinx + MyST).

Every page is reachable from the toctree of docs/index.md, every public name
is in the API reference, the lifecycle picture is there, and, when Sphinx is
installed (``make docs`` installs ``.[docs]``; ``make test`` does not), the
site builds with warnings as errors.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import celery_leases

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def pages() -> list[str]:
    return sorted(p.stem for p in DOCS.glob("*.md") if p.stem != "index")


def toctree_entries(text: str) -> list[str]:
    """Document names listed in the ```{toctree} blocks of a MyST page."""
    entries = []
    for block in re.findall(r"```\{toctree\}[^\n]*\n(.*?)```", text, flags=re.DOTALL):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            titled = re.fullmatch(r".*<([^>]+)>", line)  # "Title <page>"
            entries.append((titled.group(1) if titled else line).removesuffix(".md"))
    return entries


def test_every_page_is_in_the_toctree_of_the_index():
    index = (DOCS / "index.md").read_text()
    entries = toctree_entries(index)
    missing = [page for page in pages() if page not in entries]
    assert not missing, (f"docs/index.md: add {missing} to the toctree block (and a line to the "
                         "list of pages above it)")
    unknown = [entry for entry in entries if not (DOCS / f"{entry}.md").exists()]
    assert not unknown, f"docs/index.md: the toctree names pages that do not exist: {unknown}"


def test_every_page_is_linked_from_the_index_list():
    # The toctree is hidden; the list is what a reader of index.md (on GitHub too) sees.
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+)\.md\)", index))
    missing = [page for page in pages() if page not in linked]
    assert not missing, f"docs/index.md: add a line linking {missing} to the list of pages"


def test_every_public_name_is_in_the_api_reference():
    api = (DOCS / "api.md").read_text()
    documented = {name.rsplit(".", 1)[-1]
                  for name in re.findall(r"^\.\. auto\w+:: ([\w.]+)", api, flags=re.MULTILINE)}
    missing = [name for name in celery_leases.__all__ if name not in documented]
    assert not missing, f"docs/api.md: document {missing} (public names of celery_leases.__all__)"


def test_the_lifecycle_picture_is_a_committed_svg_the_concepts_page_shows():
    svg = DOCS / "_static" / "lifecycle.svg"
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for state in ("active", "recovering", "succeeded", "dead"):
        assert state in texts
    assert "](_static/lifecycle.svg)" in (DOCS / "concepts.md").read_text()


def test_sphinx_build_passes_with_warnings_as_errors(tmp_path):
    missing = [name for name in ("sphinx", "myst_parser") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed, the Sphinx build was not checked "
                    "(make docs installs .[docs])")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert result.returncode == 0, f"sphinx-build -W failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "html" / "api.html").exists()
