"""examples/outbox/run.py, run as a user would (non-TTY), against the session's Redis."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_outbox_example_runs_each_committed_task_once_on_sqlite(redis_server_url, tmp_path):
    env = {**os.environ, "REDIS_URL": redis_server_url}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "outbox" / "run.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rows waiting in the outbox, nothing published yet: 6" in out
    for check in ("every committed task ran exactly once", "the killed sender's tasks ran",
                  "the rolled-back task never ran", "the outbox is empty"):
        assert f"[ok] {check}" in out, out
    assert "FAILED" not in out and "stopped every process this example started" in out
