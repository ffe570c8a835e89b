"""Parsing the package's own source in tests that read it (layers, entry points, shapes).

CPython 3.11 before 3.11.8 keeps the AST constructor's recursion depth in state shared
by all threads (python/cpython#106905, fixed by #113035): an ``ast.parse`` in the test's
thread while another thread of the same pytest process builds an AST too (3.11's
traceback module parses source lines to place its carets, so any thread logging an
exception does) can fail with a spurious ``SystemError: AST constructor recursion depth
mismatch``. The source did not change: parsing it again gives its tree.
"""
from __future__ import annotations

import ast
from pathlib import Path

#: Attempts before a SystemError is taken for real.
ATTEMPTS = 5


def parse(path: Path) -> ast.Module:
    """The tree of the Python file ``path``."""
    text = path.read_text("utf-8")
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(text, str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
