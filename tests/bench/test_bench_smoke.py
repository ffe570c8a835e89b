"""The store benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

from pathlib import Path

from tests.support.bench_runner import run_quick_bench


def test_store_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server and a scratch place for the JSON results,
    # when the benchmark runs in quick mode,
    # then it succeeds, prints the table (asserted by run_quick_bench) with its
    # three targets, and writes the JSON
    out, data = run_quick_bench("store.py", redis_server_url, tmp_path, timeout=60)

    for target in ("one round trip per transition", "renew_many of 10,000 < 50 ms",
                   "recovery of 10,000 < 2 s"):
        assert target in out
    assert data["targets"]["one round trip per transition"]["result"] == "PASS"
    assert data["meta"]["quick"] is True
