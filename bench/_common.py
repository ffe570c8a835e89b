"""What the benchmarks share: a throwaway Redis, clean-up on exit or Ctrl-C, Redis
bookkeeping, the report (Markdown table, targets, JSON), and the base of their
Celery apps.

Imported as ``bench._common`` (the repository root on ``sys.path``), by the
benchmark scripts and by the worker apps ``bench/overhead_app.py`` and
``bench/recovery_app.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import redis

from celery_leases.testing import Worker
from celery_leases.testing.servers import RedisServer, wait_for

if TYPE_CHECKING:
    from celery import Celery

ROOT = Path(__file__).resolve().parent.parent


# -- processes ------------------------------------------------------------------

class Cleanup:
    """Everything started, stopped in reverse order on exit, error, Ctrl-C or SIGTERM."""

    def __init__(self) -> None:
        self.actions: list[Callable[[], None]] = []

    def push(self, action: Callable[[], None]) -> None:
        self.actions.append(action)

    def run(self) -> None:
        while self.actions:
            action = self.actions.pop()
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - the other cleanups must still run
                print(f"cleanup: {exc!r}", file=sys.stderr)


def terminate(signum: int, frame: Any) -> None:
    """SIGTERM handler: exit through the ``finally`` blocks (and so the cleanup)."""
    raise SystemExit(128 + signum)


def redis_url(cleanup: Cleanup) -> tuple[str, RedisServer | None]:
    """``$REDIS_URL``, or a throwaway ``redis-server`` (loopback, ``--save ''``,
    ``--appendonly no``) whose clean-up is pushed on ``cleanup``; and that server."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url, None
    server = RedisServer()
    cleanup.push(server.cleanup)
    server.start()
    return server.url, server


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """``celery_leases.testing.wait_for``, failing with RuntimeError (the benchmark failed)."""
    return wait_for(predicate, timeout, what, interval=interval, error=RuntimeError)


def bench_worker(name: str, app: str, env: Mapping[str, str], *, pool: str, concurrency: int,
                 log_dir: Path, loglevel: str = "info") -> Worker:
    """A ``celery worker`` of the benchmark app module ``app`` (``bench.overhead_app``), on the
    pytest plugin's launcher; without Celery's worker heartbeats (events the benchmarks do not
    measure). ``start()`` returns once it consumes."""
    return Worker(app, name=name, env=env, pool=pool, concurrency=concurrency, loglevel=loglevel,
                  args=["--without-heartbeat"], log_dir=log_dir, cwd=ROOT, pythonpath=[str(ROOT)])


# -- redis bookkeeping ----------------------------------------------------------

def command_stats(client: redis.Redis) -> dict[str, dict[str, float]]:
    raw = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): v for name, v in raw.items()}


def stats_delta(before: dict, after: dict, own: Sequence[str] = ("info",),
                own_prefixes: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Calls and usec per command between two snapshots, without the benchmark's own
    bookkeeping (the commands ``own`` names or ``own_prefixes`` begin)."""
    out = {}
    for name, v in after.items():
        if name in own or name.startswith(own_prefixes):
            continue
        calls = v["calls"] - before.get(name, {}).get("calls", 0)
        if calls:
            out[name] = {"calls": calls, "usec": v["usec"] - before.get(name, {}).get("usec", 0)}
    return out


def delete_keys(client: redis.Redis, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        if keys[i:i + 1000]:
            client.unlink(*keys[i:i + 1000])


def delete_pattern(client: redis.Redis, pattern: str) -> None:
    """UNLINK every key matching ``pattern`` (SCAN, batches of 1000)."""
    batch = []
    for key in client.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            client.unlink(*batch)
            batch = []
    if batch:
        client.unlink(*batch)


# -- report ---------------------------------------------------------------------

def fmt_rate(x: float) -> str:
    return f"{x:,.0f}/s"


def git_state() -> dict:
    """The commit measured, and whether the package had uncommitted changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "package_modified": bool(git("status", "--porcelain", "--", "celery_leases"))}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, every column padded to its widest cell."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def report(results: dict, targets: dict[str, dict], table: str, json_path: str, strict: bool) -> int:
    """Print the table and the targets, write the results as JSON; the exit code
    (1 only when ``strict`` and a target was missed)."""
    print()
    print(table)
    print()
    for name, t in targets.items():
        print(f"{t['result']:<4}  {name}: {t['measured']}")
    print(f"\n{results['meta']['seconds']} s; results in {json_path}")
    Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    missed = any(t["result"] == "MISS" for t in targets.values())
    return 1 if (strict and missed) else 0


# -- the worker apps --------------------------------------------------------------

def bench_app(name: str, env: Mapping[str, str], **conf: Any) -> "Celery":
    """The base of the benchmarks' Celery apps, installed.

    Broker and result backend on ``$LEASES_BENCH_BROKER`` (the results on
    ``$LEASES_BENCH_BACKEND`` when set: a RabbitMQ broker), leases there too or
    on ``$LEASES_BENCH_LEASES`` (a server of their own), key prefix and queue
    ``$LEASES_BENCH_PREFIX``, no beat schedule; ``conf`` adds the app's own settings.
    """
    import celery_leases
    from celery import Celery

    prefix = env.get("LEASES_BENCH_PREFIX", "leases-bench")
    broker = env.get("LEASES_BENCH_BROKER", "redis://127.0.0.1:6379/0")
    app = Celery(name, broker=broker, backend=env.get("LEASES_BENCH_BACKEND") or broker)
    app.conf.update(
        task_default_queue=prefix,
        leases_redis_url=env.get("LEASES_BENCH_LEASES") or broker,
        leases_key_prefix=prefix,
        leases_beat_schedule=False,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        **conf,
    )
    celery_leases.install(app)
    return app


_clients: dict = {}


def client_for(url: str) -> redis.Redis:
    """One Redis client per URL and process (the tasks' own connection)."""
    client = _clients.get((url, os.getpid()))
    if client is None:
        client = _clients[(url, os.getpid())] = redis.Redis.from_url(url)
    return client
