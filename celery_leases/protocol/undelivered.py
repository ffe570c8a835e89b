"""Publish tracking, the recovery side: queued tasks no worker acquired in time.

A task recorded at publish (queued.py) that no worker acquired within the
delivery timeout after it became due is claimed here (claim_undelivered.lua):
re-published with generation + 1, or, past its ``expires``, revoked. A copy the
broker holds for a ``recovering`` record (a confirmed recovery re-publish, a
retry hand-over) waits in the same index and is claimed the same way. A task
that stays undelivered waits twice as long before each further copy, up to
``backoff_cap`` timeouts. ``QueuedTasks.recover`` runs a pass; the Celery wiring
(tracking.py) adds it to every recovery pass of the store.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..exceptions import CorruptRecord
from .codes import Code
from .core import StoreCore
from .records import RecoveryReport
from .scripts import scripts

__all__ = ["Undelivered", "overdue", "claim", "recover"]

logger = logging.getLogger("celery_leases.recovery")


@dataclass
class Undelivered:
    """A queued task claimed by a recovery pass (claim_undelivered.lua)."""

    task_id: str
    #: RECOVERED: re-publish with ``generation``; FINISHED: expired, now revoked; CORRUPT.
    code: Code
    generation: int
    name: str
    body: bytes
    envelope: dict
    error: Exception | None = None


def overdue(core: StoreCore, limit: int = 1000) -> dict[int, list[str]]:
    """Up to ``limit`` ids per shard whose wait for a delivery is over (server clock)."""
    keys = core.keys
    shards = list(range(core.shards))
    calls = [((keys.shard(i).queued,), (int(limit),)) for i in shards]
    out: dict[int, list[str]] = {}
    for i, rows in zip(shards, core.calls.run_many(scripts.expired, calls, "listing undelivered tasks")):
        if rows and rows[0] == Code.CORRUPT:
            logger.error("listing undelivered tasks: %s field %s %s", *(v.decode() for v in rows[1:4]))
            rows = [0]
        out[i] = [t.decode() for t in rows[1:]]
    return out

def claim(core: StoreCore, ids: Iterable[str], timeout_ms: int, backoff_cap: int) -> list[Undelivered]:
    """Claim these overdue ids (claim_undelivered.lua), one call per shard, pipelined;
    ``timeout_ms`` and ``backoff_cap`` as in QueuedTasks (queued.py)."""
    keys = core.keys
    calls = []
    for index, task_ids in keys.by_shard(ids).items():
        shard = keys.shard(index)
        call_keys = [shard.queued, shard.stats]
        for t in task_ids:
            call_keys += [keys.record(t), keys.message(t)]
        calls.append((call_keys, [timeout_ms, int(round(core.settings.retention * 1000)),
                                  int(backoff_cap), *task_ids]))
    if not calls:
        return []
    out = []
    for rows in core.calls.run_many(scripts.claim_undelivered, calls, "claiming undelivered tasks"):
        if rows and not isinstance(rows[0], list):  # CORRUPT: the shard's queued index
            logger.error("recovery: %s field %s %s; its queued tasks cannot be claimed",
                         *(v.decode() for v in rows[1:4]))
            continue
        for task_id, code, gen, name, body, envelope, detail in rows:
            task_id, code = task_id.decode(), Code(code)
            error = None
            env: Any = {}
            if code is Code.CORRUPT:
                error = CorruptRecord(f"queued task {task_id}: {detail.decode('utf-8', 'replace')}")
            else:
                try:
                    env = json.loads(envelope) if envelope else {}
                except ValueError:
                    error = CorruptRecord(f"message {keys.message(task_id)} of queued task {task_id} "
                                          f"holds an envelope that is not JSON",
                                          keys.message(task_id), "envelope")
            out.append(Undelivered(task_id, code, int(gen), name.decode("utf-8", "replace"), body,
                                   env if isinstance(env, dict) else {}, error))
    return out

def recover(core: StoreCore, publish: Callable[[Undelivered], None],
            on_expired: Callable[[Undelivered], None] | None, batch: int | None, *,
            lister: Callable[[int], dict[int, list[str]]],
            claimer: Callable[[list[str]], list[Undelivered]],
            delivery_timeout: float) -> RecoveryReport:
    """One pass over the overdue queued tasks: re-publish each, or revoke the expired.

    Costs O(overdue). A publish that raises is reported; the task is due
    again after its next wait (its generation already grew, so no copy of
    the failed attempt can run). ``lister`` and ``claimer`` are ``overdue`` and
    ``claim`` as the caller's QueuedTasks makes them.
    """
    report = RecoveryReport(tracked=True)
    batch = batch or core.settings.recover_batch
    pending = True
    while pending:
        found = lister(batch)
        ids = [t for shard_ids in found.values() for t in shard_ids]
        pending = any(len(shard_ids) >= batch for shard_ids in found.values())
        if not ids:
            break
        claimed = claimer(ids)
        for item in claimed:
            try:
                if item.error is not None:
                    report.corrupt += 1
                    logger.error("recovery: %s; it is no longer tracked", item.error)
                elif item.code is Code.FINISHED:
                    report.undelivered_expired += 1
                    if on_expired is not None:
                        on_expired(item)
                else:
                    publish(item)
                    report.undelivered += 1
            except Exception as exc:  # noqa: BLE001 - reported; due again after the timeout
                report.publish_failed += 1
                report.errors.append((item.task_id, exc))
                logger.error("re-publishing undelivered task %s (generation %d) failed; tried "
                             "again after its next wait (%ss or more): %r", item.task_id,
                             item.generation, delivery_timeout, exc, exc_info=True)
        if not claimed:
            break
    return report

