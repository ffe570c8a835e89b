"""The store benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_store_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server and a scratch place for the JSON results
    results = tmp_path / "results-store.json"
    env = {**os.environ, "REDIS_URL": redis_server_url}

    # When the benchmark runs in quick mode
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "store.py"), "--quick", "--json", str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )

    # Then it succeeds, prints the table with its three targets, and writes the JSON
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| measurement" in out and "| result" in out
    for target in ("one round trip per transition", "renew_many of 10,000 < 50 ms",
                   "recovery of 10,000 < 2 s"):
        assert target in out
    data = json.loads(results.read_text())
    assert data["targets"]["one round trip per transition"]["result"] == "PASS"
    assert data["meta"]["quick"] is True
