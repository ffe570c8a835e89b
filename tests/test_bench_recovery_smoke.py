"""The recovery benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_recovery_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server and a scratch place for the JSON results
    results = tmp_path / "results-recovery.json"
    env = {**os.environ, "REDIS_URL": redis_server_url}

    # When the benchmark runs in quick mode (it starts and SIGKILLs real workers)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recovery.py"), "--quick", "--json", str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )

    # Then it succeeds and prints the table with its two targets
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| measurement" in out and "| result" in out
    for target in ("worst SIGKILL-to-rerun <= ttl + interval + 1 s = 4 s",
                   "re-publish >= 0.8 x send_task throughput"):
        assert target in out
    # And the JSON holds every trial (each re-run by the surviving worker) and both throughputs
    data = json.loads(results.read_text())
    assert data["meta"]["quick"] is True
    trials = data["rerun"]["trials"]
    assert len(trials) == 3 and all(t["delay_s"] > 0 for t in trials)
    assert all(t["second_generation"] == 1 for t in trials)
    assert data["rerun"]["reran_on_survivor"] == 3
    republish = data["republish"]
    assert republish["n"] == 1_000
    assert republish["recover_median_per_s"] > 0 and republish["send_task_median_per_s"] > 0
