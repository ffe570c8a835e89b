"""The scale benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scale_benchmark_quick_run_prints_its_table_and_sane_numbers(tmp_path: Path) -> None:
    # Given no $REDIS_URL, so the benchmark starts its own throwaway redis-server
    # (its memory and CPU figures are server-wide, so a shared server would blur them),
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    results = tmp_path / "results-scale.json"

    # when it runs in quick mode (1,000 leases of 10 simulated workers),
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--json", str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )

    # then it succeeds (no target missed) and prints its table with every target named
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "| measurement" in out and "| result" in out
    for target in ("memory per lease without the message < 1,024 B (MEMORY USAGE)",
                   "memory per lease < 1,024 B + the message (used_memory)",
                   "recovery of 10,000 < 2 s",
                   "a tick of all workers fits the default heartbeat interval"):
        assert target in out
    data = json.loads(results.read_text())
    assert data["meta"]["quick"] is True and data["meta"]["throwaway_server"] is True

    # And the measurements are sane: every lease was made, renewed and (10% of them) recovered
    assert data["setup"]["leases"] == 1_000 and data["setup"]["owners"] == 10
    hb = data["heartbeat"]
    assert hb["calls"] == 2 * 10 and hb["leases_per_call"] == 100
    assert 0 < hb["script_per_call_ms"] <= hb["call_max_ms"]
    assert hb["redis_cpu_per_call_ms"] > 0 and hb["ticks_per_s"] > 0
    assert hb["zadd_median_ms"] > 0  # the plain-Redis baseline of the same run
    # a record and the deadline index hold a few hundred bytes per lease, not nothing, not KiBs;
    # the stored message is the real Celery message (body + envelope) and costs more than its bytes
    mem = data["memory"]
    assert 100 < mem["record_mean_b"] < 1024 and 20 < mem["index_share_b"] < 512
    setup = data["setup"]
    assert 500 <= setup["body_bytes"] <= 1024
    assert mem["message_mean_b"] > setup["body_bytes"] + setup["envelope_bytes"]
    # the server-wide delta agrees with the per-key figures within a quarter
    assert abs(mem["used_memory_per_lease_b"] - mem["per_lease_with_message_b"]) \
        < 0.25 * mem["per_lease_with_message_b"]
    rec = data["recovery"]
    assert rec["n"] == 100 and len(rec["runs"]) == 1
    run = rec["runs"][0]
    assert run["live_left"] == 900 and 0 < run["publish_s"] < run["seconds"]
    assert data["targets"]["recovery of 10,000 < 2 s"]["result"] == "SKIP"
