"""The relay: publishes the committed rows of ``leases_outbox_url``'s outbox, then deletes them.

Runs in every worker whose app sets ``leases_outbox_url`` (``OutboxStep``, one thread),
and alone as ``celery -A proj leases outbox relay``. Each round drains the outbox in
batches (claims.py) until a batch comes back short, then waits:

- PostgreSQL: on ``LISTEN`` (``send`` notifies inside the caller's transaction, so the
  relay wakes at COMMIT and only then), at most ``leases_outbox_poll_interval`` seconds;
- SQLite and MySQL: ``leases_outbox_poll_interval`` seconds.

Relays share the outbox without blocking each other (SKIP LOCKED, or SQLite's claims).
Before each round the relay asks the lease store for its time: while the store or the
broker is away, rows wait in the database, where a crash cannot lose them. An unreachable
database, store or broker is logged once when it starts and once when it ends, and the
relay retries after a delay that doubles from ``RETRY_DELAY`` up to ``RETRY_MAX_DELAY``.
Every ``STATUS_INTERVAL`` seconds it reads the outbox's depth and its oldest row's age
(the ``outbox_status`` signal: the Prometheus gauges, ops/metrics.py).
"""
from __future__ import annotations

import logging
import select
import threading
import time
from typing import Any, Callable

from ..runtime import get_store
from ..signals import outbox_status
from ..outage import Outage
from .claims import Batch, claim, publish_batch
from .database import Database, Executor
from .sql import INIT_COMMAND, missing_table

__all__ = ["Relay", "Status"]

logger = logging.getLogger("celery_leases.outbox")


class Status:
    """The outbox as one read sees it."""

    def __init__(self, depth: int, oldest_age: float | None, parked: int) -> None:
        self.depth, self.oldest_age, self.parked = depth, oldest_age, parked

    def as_dict(self) -> dict:
        return {"depth": self.depth, "oldest_age_seconds": self.oldest_age, "parked": self.parked}


def read_status(ex: Executor, database: Database) -> Status:
    db, table = ex.dialect, database.table
    (depth, age), = ex.fetch(db.status(table))
    (parked,), = ex.fetch(db.parked_count(table))
    ex.commit()
    return Status(int(depth), None if age is None else max(0.0, float(age)), int(parked))


class Relay:
    """Publish the outbox's rows: ``run_once`` drains it once; ``start`` runs a thread."""

    RETRY_DELAY = 1.0
    RETRY_MAX_DELAY = 30.0
    STATUS_INTERVAL = 5.0
    BATCH = 500

    def __init__(self, app: Any, url: str, table: str | None = None, poll_interval: float = 1.0, *,
                 batch: int | None = None, retry_max_delay: float | None = None,
                 name: str = "celery-leases-outbox-relay", listen: bool = True) -> None:
        self.app = app
        self.database = Database(url, table)
        self.poll_interval = poll_interval
        self.batch = batch or self.BATCH
        self.retry_max_delay = retry_max_delay or self.RETRY_MAX_DELAY
        self.name = name
        #: PostgreSQL: wait on LISTEN between rounds (False: poll only, as on a gevent or
        #: eventlet worker, where a blocking wait on the socket would stall the event loop).
        self.listen = listen
        #: Rows this relay published and parked, and its rounds, since it started.
        self.published = 0
        self.parked = 0
        self.rounds = 0
        #: The current retry delay (0 while healthy), and every delay waited so far.
        self.delay = 0.0
        self.delays: list[float] = []
        self.outage = Outage(logger, f"celery-leases outbox relay ({self.database})")
        self._ex: Executor | None = None
        self._listener: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status_at = 0.0
        #: Called with each finished Batch (tests, the CLI's counts).
        self.on_batch: Callable[[Batch], None] | None = None

    # -- the thread ---------------------------------------------------------------

    def start(self) -> "Relay":
        self._thread = threading.Thread(target=self.run_forever, name=self.name, daemon=True)
        self._thread.start()
        logger.info("celery-leases: outbox relay started (%s, table %s, poll every %gs%s)", self.database,
                    self.database.table, self.poll_interval,
                    ", woken by NOTIFY" if self.database.kind == "postgresql" and self.listen else "")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the batch under way; wait for it at most ``timeout`` seconds."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.close()

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - logged once per outage, retried after a delay
                self._failed(exc)
                self._stop.wait(self.delay)
                continue
            self._healthy()
            self._wait(self.poll_interval)

    # -- one round ----------------------------------------------------------------

    def run_once(self) -> int:
        """Publish every row that is there now (batch after batch); the rows published.

        Raises when the database, the lease store or the broker is away (rows published
        before that are deleted; the others wait)."""
        self.rounds += 1
        get_store(self.app).server_time_ms()  # the lease store answers: else the rows wait
        ex = self._executor()
        published = 0
        try:
            while not self._stop.is_set():
                rows = claim(ex, self.database.table, self.batch)
                if not rows:
                    ex.rollback()
                    break
                batch = publish_batch(self.app, ex, self.database.table, rows)
                published += len(batch.published)
                self.published += len(batch.published)
                self.parked += len(batch.parked)
                if self.on_batch is not None:
                    self.on_batch(batch)
                if batch.error is not None:
                    raise batch.error
                if len(rows) < self.batch:
                    break
            self._maybe_status(ex)
        except BaseException:
            self._drop()
            raise
        return published

    def status(self) -> "Status":
        ex = self._executor()
        try:
            return read_status(ex, self.database)
        except BaseException:
            self._drop()
            raise

    def _maybe_status(self, ex: Executor) -> None:
        now = time.monotonic()
        if now - self._status_at < self.STATUS_INTERVAL:
            return
        self._status_at = now
        status = read_status(ex, self.database)
        outbox_status.send(sender=self.app, depth=status.depth, oldest_age=status.oldest_age,
                           parked=status.parked)

    # -- connections --------------------------------------------------------------

    def _executor(self) -> Executor:
        if self._ex is None:
            self._ex = self.database.executor()
        return self._ex

    def _drop(self) -> None:
        ex, self._ex = self._ex, None
        if ex is not None:
            ex.rollback()
            ex.close()

    def close(self) -> None:
        self._drop()
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.close()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _listen(self) -> Any:
        if self._listener is None and self.database.kind == "postgresql" and self.listen:
            conn = self.database.connect(autocommit=True)
            cur = conn.cursor()
            cur.execute(self.database.dialect.listen(self.database.table))  # type: ignore[attr-defined]
            cur.close()
            self._listener = conn
        return self._listener

    def _wait(self, timeout: float) -> None:
        """Until a NOTIFY (PostgreSQL), ``timeout`` seconds, or ``stop``."""
        try:
            listener = self._listen()
        except Exception as exc:  # noqa: BLE001 - polling still works: logged with the outage
            self._failed(exc)
            listener = None
        if listener is None:
            self._stop.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        try:
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if _notified(listener, min(left, 0.5)):
                    return
        except Exception as exc:  # noqa: BLE001 - the listening connection broke: opened again next wait
            listener, self._listener = self._listener, None
            try:
                listener.close()
            except Exception:  # noqa: BLE001
                pass
            logger.debug("celery-leases outbox relay: LISTEN connection lost (%r); reopened", exc)

    # -- failures -----------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        self.delay = min(max(self.RETRY_DELAY, self.delay * 2), self.retry_max_delay)
        self.delays.append(self.delay)
        hint = (f"the table {self.database.table} does not exist: create it with `{INIT_COMMAND}`; "
                if missing_table(exc, self.database.table) else "")
        self.outage.failed(exc, f"{hint}next try in {self.delay:g}s, the delay doubling up to "
                                f"{self.retry_max_delay:g}s; the rows wait in the database")

    def _healthy(self) -> None:
        if self.delay:
            self.outage.succeeded(f"{self.published} row(s) published so far")
        self.delay = 0.0


def _notified(conn: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` for a notification on ``conn`` (psycopg 3 or psycopg2)."""
    if hasattr(conn, "notifies") and callable(conn.notifies):  # psycopg 3
        found = any(True for _ in conn.notifies(timeout=timeout, stop_after=1))
        if found:  # drain whatever else arrived (the generator above is closed: it holds a lock)
            for _ in conn.notifies(timeout=0.0):
                pass
        return found
    ready, _, _ = select.select([conn], [], [], timeout)  # psycopg2
    if not ready:
        return False
    conn.poll()
    found = bool(conn.notifies)
    conn.notifies.clear()
    return found
