"""The task overhead benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_overhead_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server and a scratch place for the JSON results
    results = tmp_path / "results-overhead.json"
    env = {**os.environ, "REDIS_URL": redis_server_url}

    # When the benchmark runs in quick mode (it starts two real workers)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "overhead.py"), "--quick", "--json", str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )

    # Then it succeeds and prints the table with its three targets
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| measurement" in out and "| result" in out
    for target in ("leased/plain throughput >= 0.90", "<= 2 extra round trips per task",
                   "1 renew call per heartbeat tick (1, 10, 100 leases)"):
        assert target in out
    # And the JSON holds both kinds, the command counts and the three heartbeat sizes
    data = json.loads(results.read_text())
    assert data["meta"]["quick"] is True
    throughput = data["throughput"]
    assert throughput["plain"]["median_per_s"] > 0 and throughput["leased"]["median_per_s"] > 0
    # Counted by the server, not timed: a leased no-op adds exactly acquire + finish.
    assert data["commands"]["leased_scripts_per_task"] == 2.0
    assert data["commands"]["plain_scripts_per_task"] == 0.0
    assert [row["leases"] for row in data["heartbeat"]] == [1, 10, 100]
    assert data["targets"]["1 renew call per heartbeat tick (1, 10, 100 leases)"]["result"] == "PASS"
