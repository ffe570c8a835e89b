"""The task overhead benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

from pathlib import Path

from celery_leases.worker.heartbeat import START_MARK_DELAY
from tests.support.bench_runner import run_quick_bench


def test_overhead_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given the session's Redis server as broker and a scratch place for the JSON results,
    # when the benchmark runs in quick mode (a prefork worker, results ignored, the default; a
    # heartbeat worker, and a lease store of its own),
    # then it succeeds and prints the table (asserted by run_quick_bench) with its targets
    out, data = run_quick_bench("overhead.py", redis_server_url, tmp_path, timeout=240)

    for target in ("publisher-bound: leased/plain >= 0.95", "backlog drain: leased/plain >= 0.95",
                   "<= 2 lease-store round trips per task in the worker",
                   "<= 1 lease-store round trip per published task",
                   "1 renew call per heartbeat tick (1, 10, 100 leases)"):
        assert target in out
    assert data["meta"]["quick"] is True
    assert data["meta"]["results"] == ["ignored"]
    assert "prefork -c 2, results ignored, backlog drain" in out
    assert list(data["pools"]["prefork"]) == ["ignored"]
    prefork = data["pools"]["prefork"]["ignored"]
    for case in ("publisher-bound", "backlog drain"):
        for kind in ("plain", "leased", "leased, untracked"):
            assert prefork[case][kind]["per_s"] > 0
    # Counted by the lease store's own server, not timed: a tracked publish records the task
    # (one call); the worker acquires and finishes (at most one call each per task: several
    # share one when they come together, and prefork's main process carries the finishes of
    # unread successes in its acquires' writes), plus start marks the heartbeat sends (only
    # for tasks still running 25 ms after they started, at most one call per
    # START_MARK_DELAY): those scale with the seconds the drain took, which a loaded host
    # stretches, never with the number of tasks.
    drain = prefork["backlog drain"]
    assert drain["leased"]["publish_lease_calls"] == 1.0
    assert drain["leased, untracked"]["publish_lease_calls"] == 0.0
    n = data["meta"]["n"]
    for kind in ("leased", "leased, untracked"):
        for run in drain["rounds"][kind]:
            periodic = run["window_s"] / START_MARK_DELAY + 1
            assert 0 < run["worker_lease_calls"], run
            assert run["worker_lease_calls"] * n <= 2 * n + periodic, run
    assert drain["plain"]["lease_calls"] == 0.0
    assert [row["leases"] for row in data["heartbeat"]] == [1, 10, 100]
    assert data["targets"]["1 renew call per heartbeat tick (1, 10, 100 leases)"]["result"] == "PASS"


def test_the_shared_layout_counts_the_script_calls_on_the_one_server(redis_server_url: str,
                                                                   tmp_path: Path) -> None:
    # When the lease store is on the broker's server (--layout shared), on a solo worker,
    # with results stored and ignored
    out, data = run_quick_bench("overhead.py", redis_server_url, tmp_path, timeout=240,
                                args=("--layout", "shared", "--no-heartbeat", "--pools", "solo",
                                      "--results", "stored,ignored"))
    assert data["meta"]["layout"] == "shared"
    assert data["meta"]["pools"] == {"solo": 1}
    assert data["meta"]["results"] == ["stored", "ignored"]
    n = data["meta"]["n"]
    for results in ("stored", "ignored"):
        # Then each results variant has its rows and its ratios leased / plain
        for case in ("publisher-bound", "backlog drain"):
            assert f"solo -c 1, results {results}, {case}" in out
            cell = data["pools"]["solo"][results][case]
            for kind in ("plain", "leased", "leased, untracked"):
                assert cell[kind]["per_s"] > 0
            assert cell["ratio leased"]["median"] > 0
        # And the lease-store round trips are the script calls alone, as on a server of its own
        drain = data["pools"]["solo"][results]["backlog drain"]
        assert drain["leased"]["publish_lease_calls"] == 1.0
        assert drain["plain"]["lease_calls"] == 0.0
        # And solo has no pool processes: its tasks' CPU is the main process's
        assert not drain["plain"]["cpu_us"].get("pool processes")
        for run in drain["rounds"]["leased"]:
            assert 1.0 <= run["worker_lease_calls"] <= 2 + (run["window_s"] / START_MARK_DELAY + 1) / n, run
