"""The task overhead benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

from pathlib import Path

from tests.bench_runner import run_quick_bench


def test_overhead_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server and a scratch place for the JSON results,
    # when the benchmark runs in quick mode (it starts two real workers),
    # then it succeeds and prints the table (asserted by run_quick_bench) with its three targets
    out, data = run_quick_bench("overhead.py", redis_server_url, tmp_path, timeout=90)

    for target in ("leased/plain throughput >= 0.90", "<= 2 extra round trips per task",
                   "1 renew call per heartbeat tick (1, 10, 100 leases)"):
        assert target in out
    # And the JSON holds both kinds, the command counts and the three heartbeat sizes
    assert data["meta"]["quick"] is True
    throughput = data["throughput"]
    assert throughput["plain"]["median_per_s"] > 0 and throughput["leased"]["median_per_s"] > 0
    # Counted by the server, not timed.
    # acquire and finish; start marks are batched and sent only for tasks still running
    # 25 ms after they started: a few hundredths on a quiet machine, more under load,
    # never one per task
    assert 2.0 <= data["commands"]["leased_scripts_per_task"] <= 2.2
    assert data["commands"]["plain_scripts_per_task"] == 0.0
    assert [row["leases"] for row in data["heartbeat"]] == [1, 10, 100]
    assert data["targets"]["1 renew call per heartbeat tick (1, 10, 100 leases)"]["result"] == "PASS"
