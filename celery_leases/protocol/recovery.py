"""The recovery pass over the store: claim expired leases, re-publish them, confirm.

Celery-free: the wiring hands in ``publish`` / ``on_dead`` / ``on_corrupt``
callables (celery_leases/recovery.py re-publishes through the app). The
claims themselves are single scripts (claim_expired.lua, mark_published.lua),
so a pass is safe to run concurrently and to crash at any point: each task is
either recovered once or left for the next pass. ``LeaseStore.recover`` (what
``celery_leases.store(app).recover()`` calls) runs ``recover`` here.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Sequence

from ..exceptions import CorruptRecord, LeaseError
from .calls import ms
from .codes import Code
from .core import StoreCore
from .records import Claim, RecoveryReport
from .scripts import scripts

__all__ = ["claim_expired", "mark_published", "recover"]

logger = logging.getLogger("celery_leases.store")


def claim_expired(core: StoreCore, limit: int | None = None, ids: Sequence[str] | None = None) -> list[Claim]:
    """Claim up to ``limit`` leases whose deadline passed (see claim_expired.lua).

    ``ids`` (of any shards) are claimed with one script call per shard.
    """
    if ids is None:
        ids = core.expired(limit or core.settings.recover_batch)
    if not ids:
        return []
    calls = []
    for index, task_ids in core.keys.by_shard(ids).items():
        shard = core.keys.shard(index)
        keys = [shard.deadlines, shard.stats]
        for t in task_ids:
            keys += [core.keys.record(t), core.keys.message(t)]
        calls.append((keys, [core.settings.max_recoveries, ms(core.settings.publish_grace), *task_ids]))
    rows = []
    for result in core.calls.run_many(scripts.claim_expired, calls, f"{len(ids)} expired leases"):
        if result and result[0] == Code.CORRUPT:
            # This shard's deadline index: logged, the other shards' claims go on.
            logger.error("recovery: %s field %s %s; its leases cannot be claimed",
                         *(v.decode() for v in result[1:4]))
            continue
        rows += result
    claims = []
    for task_id, code, gen, recoveries, name, body, envelope in rows:
        task_id, code = task_id.decode(), Code(code)
        error = None
        if code is Code.CORRUPT:
            # gen is the corrupt key, recoveries "field detail": this task alone, to park.
            key, (fld, _, detail) = gen.decode(), recoveries.decode().partition(" ")
            error = CorruptRecord(f"lease of task {task_id}: {key} field {fld} {detail}", key, fld)
            gen = recoveries = 0
        try:
            env = json.loads(envelope) if envelope else {}
        except ValueError:
            # Reported by the recovery pass; the rest of the batch goes on.
            env = {}
            error = error or CorruptRecord(
                f"message {core.keys.message(task_id)} of task {task_id} holds an envelope "
                f"that is not JSON", core.keys.message(task_id), "envelope")
        if not isinstance(env, dict):
            env = {}
        claims.append(Claim(task_id, code, int(gen), int(recoveries),
                            name.decode("utf-8", "replace"), body, env, error))
    return claims


def mark_published(core: StoreCore, claims: Iterable[Claim]) -> int:
    """Confirm re-published claims: the broker holds them from now on (with publish tracking,
    ``core.settings.delivery_timeout`` > 0, they wait in the queued index for their delivery)."""
    claims = list(claims)
    if not claims:
        return 0
    by_id = {c.task_id: c for c in claims}
    calls = []
    for index, task_ids in core.keys.by_shard(c.task_id for c in claims).items():
        shard = core.keys.shard(index)
        # With publish tracking on, the confirmed copy waits in the queued index: if the
        # broker loses it too, claim_undelivered re-publishes it (mark_published.lua).
        keys = [shard.deadlines, shard.queued]
        args: list[Any] = [ms(core.settings.retention), ms(core.settings.delivery_timeout or 0)]
        for t in task_ids:
            keys += [core.keys.record(t), core.keys.message(t)]
            args += [t, by_id[t].generation]
        calls.append((keys, args))
    confirmed = 0
    for reply in core.calls.run_many(scripts.mark_published, calls, f"{len(claims)} claims"):
        if isinstance(reply, list):  # CORRUPT: an index; claimed again, reported then
            logger.error("recovery: confirming claims: %s field %s %s", *(v.decode() for v in reply[1:4]))
            continue
        confirmed += int(reply)
    return confirmed


def recover(core: StoreCore, publish: Callable[[Claim], None] | None,
            on_dead: Callable[[Claim], None] | None = None,
            limit: int | None = None,
            on_corrupt: Callable[[Claim], None] | None = None, *,
            steps: Iterable[Callable[[], RecoveryReport]] = (),
            claimer: Callable[[Sequence[str]], list[Claim]] | None = None,
            confirmer: Callable[[Iterable[Claim]], int] | None = None) -> RecoveryReport:
    """Run one recovery pass: claim expired leases, re-publish them, confirm, then ``steps``.

    A publish that raises leaves its claim unconfirmed; the next pass after
    ``publish_grace`` claims it again. Stops after ``limit`` claims (default:
    until nothing is due). A corrupt record affects its own task only: the
    script took it out of the deadline index, and ``on_corrupt`` (the Celery
    side parks it) gets the claim, with the stored message if it was readable.
    ``claimer`` and ``confirmer`` default to ``claim_expired`` and ``mark_published``
    here (the store passes its own methods, so a wrapped one sees its phase);
    ``steps`` are more steps of the pass, each returning a RecoveryReport.
    """
    claim_ids = claimer or (lambda ids: claim_expired(core, ids=ids))
    confirm = confirmer or (lambda claims: mark_published(core, claims))
    if publish is None:
        raise LeaseError("recover() needs a publish callable (celery_leases.store(app) provides one)")
    report = RecoveryReport()
    remaining = limit
    # Every round lists, claims and confirms on all shards with work left,
    # each step one pipelined round trip: with many shards a pass costs
    # about as many round trips as with one.
    pending = list(range(core.shards))
    while pending and (remaining is None or remaining > 0):
        batch = core.settings.recover_batch if remaining is None else min(remaining, core.settings.recover_batch)
        found = core.expired_by_shard(pending, batch)
        pending = [index for index, found_ids in found.items() if len(found_ids) >= batch]
        ids = [t for found_ids in found.values() for t in found_ids]
        if remaining is not None:
            ids = ids[:remaining]
        if not ids:
            break
        claims = claim_ids(ids)
        published = []
        for claim in claims:
            if claim.code is Code.CORRUPT:
                report.corrupt += 1
                _corrupt_claim(claim, on_corrupt)
                continue
            if claim.error is not None and claim.code is Code.RECOVERED and on_corrupt is not None:
                # Claimed, but its stored message cannot be re-published (an envelope
                # that is not JSON): as permanent as a corrupt record, so parked and
                # confirmed (out of the index) instead of failing every publish grace.
                report.corrupt += 1
                _corrupt_claim(claim, on_corrupt)
                published.append(claim)
                continue
            try:
                if claim.error is not None and claim.code is not Code.DEAD:
                    raise claim.error
                if claim.code is Code.DEAD:
                    # Confirmed only once the notice is out; else handed out again.
                    if on_dead is not None:
                        on_dead(claim)
                    published.append(claim)
                    report.dead += 1
                else:
                    publish(claim)
                    published.append(claim)
                    report.recovered += 1
            except Exception as exc:  # noqa: BLE001 - reported, and retried after the grace period
                report.publish_failed += 1
                report.errors.append((claim.task_id, exc))
                logger.error("recovery of task %s (generation %s) failed, it will be "
                             "claimed again after %ss: %r", claim.task_id, claim.generation,
                             core.settings.publish_grace, exc, exc_info=True)
        confirm(published)
        if remaining is not None:
            remaining -= len(ids)
    for step in steps:
        report += step()
    return report


def _corrupt_claim(claim: Claim, on_corrupt: Callable[[Claim], None] | None) -> None:
    """A claim whose record is corrupt: out of the index already; hand it to ``on_corrupt``."""
    if on_corrupt is None:
        logger.error("recovery: task %s not recovered, its lease record is corrupt: %s; it left "
                     "the deadline index (no on_corrupt handler to park it)", claim.task_id, claim.error)
        return
    try:
        on_corrupt(claim)
    except Exception as exc:  # noqa: BLE001 - one task's parking must not stop the pass
        logger.error("recovery: parking task %s (corrupt lease record: %s) failed: %r",
                     claim.task_id, claim.error, exc, exc_info=True)
