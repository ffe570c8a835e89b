"""Claim rows, publish them, delete them: the one algorithm of the relay and the commit hooks.

A batch goes:

1. **claim** up to N rows, oldest first, that no other relay holds:
   PostgreSQL and MySQL 8, ``SELECT ... FOR UPDATE SKIP LOCKED`` in a transaction that
   stays open to step 3 (another relay skips the locked rows, never waits for them);
   SQLite (no row locks, one writer), ``UPDATE ... SET claimed_at = now ... RETURNING`` in a
   short write transaction of its own, so that no writer waits for a publish;
2. **publish** each row with its own task id and publish id (``publish.publishing_as``),
   the records pipelined on the lease store (``tracking.batched``);
3. **delete** the published rows by id, and commit (SQLite: release the unpublished ones).

A crash between 2 and 3 leaves the rows: they are claimed and published again, with the
same ids, and the lease store refuses the second copy at receipt (one run). A row that
cannot be decoded, or that Celery refuses to publish, is **parked**: moved to the parked
table with its error, logged, never tried again. A publish that fails because the broker
or the lease store is away ends the batch: the rows published so far are deleted, the rest
stay for the next batch.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Sequence

from celery.canvas import Signature, signature
from kombu.exceptions import OperationalError
from kombu.utils.json import loads
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..exceptions import LeaseUnavailable
from ..publishing.publish_id import publishing_as
from ..publishing.batches import batched
from .database import Executor
from .sql import Table

__all__ = ["Row", "Batch", "claim", "publish_batch", "Undecodable", "TRANSIENT"]

logger = logging.getLogger("celery_leases.outbox")

#: Publish errors that say "the broker or the lease store is away": the row waits.
TRANSIENT = (OperationalError, ConnectionError, TimeoutError, OSError, RedisConnectionError,
             RedisTimeoutError, LeaseUnavailable)


#: Most broker commands kombu buffers before it sends them (a flush mid-batch is allowed:
#: a row whose message went out and that is published again is refused at receipt).
BROKER_BATCH = 2000


class Undecodable(ValueError):
    """A row whose payload is not a signature this relay can publish."""


@dataclass
class Row:
    id: int
    task_id: str
    publish_id: str
    name: str
    payload: Any


@dataclass
class Batch:
    """What one batch did."""

    claimed: int = 0
    published: list = field(default_factory=list)
    parked: list = field(default_factory=list)
    #: The error that ended the batch early (the broker or lease store away), if any.
    error: BaseException | None = None


def claim(ex: Executor, table: Table, limit: int, ids: Sequence[int] = ()) -> list[Row]:
    """Claim up to ``limit`` rows (only among ``ids`` when given)."""
    db = ex.dialect
    if db.skip_locked:
        rows = ex.fetch(db.claim(table, limit, len(ids)), list(ids))
    else:
        select = db.claim(table, limit, len(ids))
        # A read first: an empty outbox (most polls) costs no write transaction, no fsync.
        if not ex.fetch(f"SELECT 1 FROM ({select}) AS free LIMIT 1", list(ids)):
            ex.rollback()
            return []
        sql = (f"UPDATE {db.ident(table)} SET claimed_at = {db.now} WHERE id IN "
               f"(SELECT id FROM ({select}) AS free) RETURNING id, task_id, publish_id, name, payload")
        rows = ex.fetch(sql, list(ids))
        ex.commit()
        rows.sort(key=lambda r: r[0])
    return [Row(int(r[0]), str(r[1]), str(r[2]), str(r[3]), r[4]) for r in rows]


def decode(app: Any, payload: Any) -> Signature:
    """The signature a row holds; Undecodable saying why not."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        payload = bytes(payload).decode("utf-8", "replace")
    try:
        data = loads(payload)
    except Exception as exc:  # noqa: BLE001 - whatever the JSON decoder says
        raise Undecodable(f"the payload is not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("task"), str) or not data["task"]:
        raise Undecodable("the payload is not a Celery signature (a JSON object with a 'task' name)")
    try:
        return signature(data, app=app)
    except Exception as exc:  # noqa: BLE001 - a canvas Celery cannot rebuild
        raise Undecodable(f"Celery cannot rebuild the signature: {exc!r}") from None


def publish_batch(app: Any, ex: Executor, table: Table, rows: Sequence[Row]) -> Batch:
    """Publish the claimed ``rows`` (step 2), then delete or park them and commit (step 3)."""
    batch = Batch(claimed=len(rows))
    try:
        with app.producer_or_acquire() as producer, batched():
            try:
                with _broker_batch(producer):
                    _publish_rows(app, producer, rows, batch)
            except TRANSIENT as exc:  # the buffered messages did not all go out: none count
                batch.error = exc
                batch.published.clear()
    finally:
        _settle(ex, table, rows, batch)
    return batch


def _publish_rows(app: Any, producer: Any, rows: Sequence[Row], batch: Batch) -> None:
    for row in rows:
        try:
            sig = decode(app, row.payload)
            with publishing_as(row.publish_id):
                sig.apply_async(producer=producer)
        except TRANSIENT as exc:
            batch.error = exc
            return
        except Exception as exc:  # noqa: BLE001 - this row's own fault: parked, never looped
            batch.parked.append((row, exc))
        else:
            batch.published.append(row)


def _broker_batch(producer: Any) -> Any:
    """kombu's publish batch where the transport has one (kombu 5.7 on Redis: the batch's
    messages go out in one pipeline when the block ends, after their records were written);
    elsewhere each message is published at once."""
    batch = getattr(producer, "batch", None)
    return batch(max_size=BROKER_BATCH) if batch is not None else nullcontext()


def _settle(ex: Executor, table: Table, rows: Sequence[Row], batch: Batch) -> None:
    db = ex.dialect
    for row, exc in batch.parked:
        reason = f"{type(exc).__name__}: {exc}"[:2000]
        ex.run(db.park(table), [reason, row.id])
        logger.error("celery-leases outbox: row %d (task %s[%s]) parked in %s_parked, never "
                     "published: %s", row.id, row.name, row.task_id, table, reason)
    done = [row.id for row in batch.published] + [row.id for row, _ in batch.parked]
    if done:
        ex.run(db.delete(table, len(done)), done)
    if not db.skip_locked:
        left = sorted({row.id for row in rows} - set(done))
        if left:
            ex.run(db.unmark(table, len(left)), left)  # type: ignore[attr-defined]
    ex.commit()
