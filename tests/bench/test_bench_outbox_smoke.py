"""The outbox benchmark runs end to end (small sizes; a smoke test, not a timed test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runner import run_quick_bench
from tests.support.services import skip_or_fail


@pytest.mark.slow
def test_outbox_benchmark_quick_run_prints_its_table(redis_server_url: str, tmp_path: Path) -> None:
    # Given PostgreSQL (the bench makes a database of its own there) and the session's Redis,
    import os

    import psycopg
    url = os.environ.get("LEASES_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    try:
        psycopg.connect(url, connect_timeout=3).close()
    except Exception as exc:  # noqa: BLE001 - not there: skip (locally) or fail (CI)
        skip_or_fail(f"PostgreSQL not reachable at {url.split('@')[-1]} (set LEASES_BENCH_PG_URL): {exc!r}")
    # when the benchmark runs in quick mode (three prefork workers in turn, one relay process pair),
    # then it succeeds and prints the table with its two targets
    out, data = run_quick_bench("outbox.py", redis_server_url, tmp_path, timeout=240)
    for target in ("relay >= 2,000 tasks/s on PostgreSQL", "commit-to-start p50 <= 20 ms on PostgreSQL"):
        assert target in out
    assert data["meta"]["quick"] is True
    assert set(data["latency_ms"]) == {"postgresql", "sqlite", "delay"}
    assert all(len(v) == 20 for v in data["latency_ms"].values())
    assert min(data["median"].values()) > 0
