"""A quick sample of Celery's own integration tests, plain and leased (``make celery-suite`` runs all).

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

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_no_test_of_the_sample_fails_only_when_leased():
    proc = subprocess.run([sys.executable, "-m", "tests.celery_suite.run", "--sample"], cwd=ROOT,
                          capture_output=True, text=True, timeout=880)
    out = proc.stdout + proc.stderr
    tail = out[-6000:]
    assert "no test fails only when leased" in out, tail
    assert proc.returncode == 0, tail
    # Both runs really ran tests of each kind (a sample that selects nothing proves nothing).
    for mode in ("plain", "leased"):
        line = next(l for l in out.splitlines() if f" {mode}: " in l and l.startswith("celery "))
        passed = int(line.split(f"{mode}: ")[1].split(" passed")[0])
        assert passed >= 20, line
