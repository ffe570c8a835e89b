"""The recovery benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

from pathlib import Path

from tests.support.bench_runner import run_quick_bench


def test_recovery_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server and a scratch place for the JSON results,
    # when the benchmark runs in quick mode (it starts and SIGKILLs real workers),
    # then it succeeds and prints the table (asserted by run_quick_bench) with its two targets
    out, data = run_quick_bench("recovery.py", redis_server_url, tmp_path, timeout=240)

    for target in ("worst SIGKILL-to-rerun <= ttl + interval + 1 s = 4 s",
                   "re-publish >= 0.8 x send_task throughput"):
        assert target in out
    # And the JSON holds every trial (each re-run by the surviving worker) and both throughputs
    assert data["meta"]["quick"] is True
    trials = data["rerun"]["trials"]
    assert len(trials) == 3 and all(t["delay_s"] > 0 for t in trials)
    assert all(t["second_generation"] == 1 for t in trials)
    assert data["rerun"]["reran_on_survivor"] == 3
    republish = data["republish"]
    assert republish["n"] == 1_000
    assert republish["recover_median_per_s"] > 0 and republish["send_task_median_per_s"] > 0
