"""A quick sample of Celery's own integration tests, leased, and plain for what fails leased.

Retries, replace, chains, groups and chords of Celery 5.x's
``t/integration/test_tasks.py`` and ``test_canvas.py``, unchanged, on Celery's
in-process test worker: every test that passes plain must pass with every task
leased. tests/celery_suite/run.py fetches the sdist of the installed Celery,
starts its own redis-server and prints both summaries.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# A long form (make long): about 100 s of a make test already at its 10-minute limit;
# make celery-suite runs the whole suite.
pytestmark = pytest.mark.long


@pytest.mark.timeout(900)
def test_no_test_of_the_sample_fails_only_when_leased():
    # The leased run, then plain Celery only for what failed leased (--mode leased-first).
    proc = subprocess.run([sys.executable, "-m", "tests.celery_suite.run", "--sample", "--mode", "leased-first"],
                          cwd=ROOT, capture_output=True, text=True, timeout=880)
    out = proc.stdout + proc.stderr
    tail = out[-6000:]
    assert "no test fails only when leased" in out, tail
    assert proc.returncode == 0, tail
    # The leased run really ran tests of each kind (a sample that selects nothing proves nothing).
    line = next(x for x in out.splitlines() if " leased: " in x and x.startswith("celery "))
    passed = int(line.split("leased: ")[1].split(" passed")[0])
    assert passed >= 20, line
