"""The lease store: every ownership change of a task is one atomic Lua script.

Knows nothing of Celery. The Celery wiring hands it opaque message bodies and
envelopes to keep for recovery, and a ``publish`` callable to put them back.
``LeaseStore`` holds the transitions and composes the rest, each of which takes
the store's core (core.py: client, keys, script runner, settings, plain reads)
and never this module: the inputs of acquire and finish (transitions.py), the
heartbeat's batch transitions (renewals.py), the recovery pass (recovery.py),
the operators' tools (admin.py). The values it returns are records.py's.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import redis

from .. import defaults
from ..exceptions import LeaseError
from . import admin, recovery, renewals
from .calls import compact_json, ms, raise_unless_ok
from .codes import Code
from .connection import connect
from .core import PARKED_CAP, PARKED_RETENTION, StoreCore, StoreSettings, one_task
from .records import Acquisition, Claim, LeaseRecord, Parked, RecoveryReport, acquisition_of, raise_if_corrupt
from .scripts import scripts
from .transitions import (ACQUIRE_ARGS, ACQUIRE_KEYS, AcquireLike, AcquireRequest, FinishRequest,
                          acquire_call, acquire_many_call, acquire_request, finish_call)
from .transitions import acquire_many_command as _acquire_many_command
from .transitions import acquire_parts as _acquire_parts

__all__ = ["LeaseStore", "StoreSettings", "AcquireRequest", "FinishRequest", "PARKED_RETENTION",
           "PARKED_CAP", "ACQUIRE_KEYS", "ACQUIRE_ARGS", "one_task"]

logger = logging.getLogger("celery_leases.store")

#: LeaseStore's keyword settings: StoreSettings' fields, and their defaults as the keywords give them.
_KEYWORD_SETTINGS = {"ttl": defaults.TTL, "retention": defaults.RETENTION,
                     "max_recoveries": defaults.MAX_RECOVERIES, "publish_grace": defaults.PUBLISH_GRACE,
                     "recover_batch": defaults.RECOVER_BATCH, "shards": 1,
                     "parked_retention": PARKED_RETENTION, "parked_cap": PARKED_CAP}


class LeaseStore(StoreCore):
    """Leases of one key prefix on one Redis (a server, or a Redis Cluster).

    ``settings`` (StoreSettings) or the keywords of the same names give the numbers:
    ``ttl``, ``retention`` and ``publish_grace`` are seconds; a keyword given a value
    other than its default wins over ``settings``. ``publish`` and ``on_dead`` are
    what a recovery pass does with a claimed lease; the Celery wiring provides them.
    ``shards`` (leases_shards) spreads the records and deadline indexes over that
    many hash tags (see keys.py): operations on many tasks make one script call per
    shard, and operations over the whole store (recovery, stats, listings) visit
    every shard.
    """

    def __init__(self, client: redis.Redis, prefix: str = defaults.KEY_PREFIX, *,
                 ttl: float = defaults.TTL, retention: float = defaults.RETENTION,
                 max_recoveries: int = defaults.MAX_RECOVERIES,
                 publish_grace: float = defaults.PUBLISH_GRACE,
                 recover_batch: int = defaults.RECOVER_BATCH,
                 publish: Callable[[Claim], None] | None = None,
                 on_dead: Callable[[Claim], None] | None = None,
                 description: str | None = None, shards: int = 1,
                 parked_retention: float = PARKED_RETENTION, parked_cap: int = PARKED_CAP,
                 on_corrupt: Callable[[Claim], None] | None = None,
                 settings: StoreSettings | None = None) -> None:
        given: dict[str, Any] = dict(ttl=ttl, retention=retention, max_recoveries=max_recoveries,
                     publish_grace=publish_grace, recover_batch=recover_batch, shards=shards,
                     parked_retention=parked_retention, parked_cap=parked_cap)
        if settings is None:
            settings = StoreSettings(**given)
        else:
            changed = {k: v for k, v in given.items() if v != _KEYWORD_SETTINGS[k]}
            if changed:
                settings = dataclasses.replace(settings, **changed)
        super().__init__(client, prefix, settings, description)
        self.publish, self.on_dead = publish, on_dead
        #: What a recovery pass does with a claim whose record is corrupt (park it).
        self.on_corrupt = on_corrupt
        #: More steps of every recovery pass, each returning a RecoveryReport (the Celery
        #: wiring adds the re-publish of undelivered tasks, queued/, when tracking is on).
        self.recovery_steps: list[Callable[[], RecoveryReport]] = []

    @classmethod
    def from_url(cls, url: str, *, transport_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> "LeaseStore":
        """A store on ``url`` (any form ``leases_redis_url`` takes; ``transport_options``
        as ``leases_redis_transport_options``, e.g. Sentinel's ``master_name``)."""
        return cls(connect(url, transport_options=transport_options), **kwargs)

    # -- transitions ---------------------------------------------------------

    def acquire(self, task_id: str, owner: str, *, ttl: float | None = None,
                generation: int = 0, attempt: int = 0, max_recoveries: int | None = None,
                progress_timeout: float = 0, name: str = "", body: bytes = b"",
                envelope: Mapping | None = None, reassert: int = 0, publish: str = "",
                recorded: bool = False, shared: bool = False) -> Acquisition:
        """Try to become the owner of ``task_id``'s lease for one delivery of its message.

        ``reassert``: the token of a lease the caller holds but whose record has
        vanished (a failover lost the write that created it): the record is
        re-created with that token, or LOST comes back if another record exists.
        ``publish``: the message's publish id (publish.py): a new one runs a
        finished (succeeded or failed) task again; a copy of an earlier one is STALE.
        ``recorded``: the publisher recorded this message (enqueue): ``body`` and
        ``envelope`` are sent only if the store does not hold this publish's
        message after all (a second round trip, then).
        ``shared``: the caller's pool runs several tasks in one process (threads,
        gevent, eventlet), so its death is not charged to this task unless it ran
        alone (``Acquisition.isolate``, ``mark_started(alone=True)``).
        """
        return self.acquire_request(AcquireRequest(
            task_id, owner, ttl=ttl, generation=generation, attempt=attempt, max_recoveries=max_recoveries,
            progress_timeout=progress_timeout, name=name, body=body, envelope=envelope,
            reassert=reassert, publish=publish, recorded=recorded, shared=shared))

    def acquire_request(self, req: AcquireRequest) -> Acquisition:
        """``acquire`` for the AcquireRequest ``req``."""
        script, keys, args = acquire_call(self, req)
        raw = self.calls.run(script, keys, args, f"task {req.task_id}, key {keys[0]}")
        return self._acquired(raw, req)

    def acquire_reply(self, raw: Any, request: AcquireRequest | None = None, **call: Any) -> Acquisition:
        """The Acquisition in ``raw``, the reply read for ``acquire(**call)``'s script call
        (or for ``request``'s).

        An error reply raises as ``acquire`` would (NOSCRIPT: the call is made
        again here, which loads the script); CORRUPT raises CorruptRecord.
        """
        return self._acquired(raw, request if request is not None else AcquireRequest(**call))

    def _acquired(self, raw: Any, req: AcquireRequest) -> Acquisition:
        if isinstance(raw, Exception):
            script, keys, args = acquire_call(self, req)
            raw = self.calls.reply(script, keys, args, raw, f"task {req.task_id}, key {keys[0]}")
        raise_if_corrupt(raw, f"task {req.task_id}")
        acq = acquisition_of(raw)
        if acq.code is Code.NO_MESSAGE:  # the message left out after all: now with it, waiting
            return self.acquire(**{f.name: getattr(req, f.name) for f in dataclasses.fields(req)
                                   if f.name != "recorded"})
        return acq

    def acquire_many(self, calls: Sequence[AcquireLike], *, owner: str = "",
                     starts: Mapping[str, int] | None = None) -> tuple[list, int]:
        """Several acquires in one call (acquire_many.lua), with start marks riding along.

        ``calls``: each acquire as an AcquireRequest, or its keyword arguments
        (``task_id`` and ``owner`` included); ``starts``: leases of ``owner`` whose
        bodies started (``mark_started``). Returns each acquire's Acquisition, or the
        LeaseError it alone met, in order, and the number of leases marked.
        An error of the whole call raises. On a cluster, whose keys cannot
        share a call, the acquires are made one by one.
        """
        reqs = [acquire_request(call) for call in calls]
        if self.calls.cluster:
            results: list = []
            for req in reqs:
                try:
                    results.append(self.acquire_request(req))
                except LeaseError as exc:
                    results.append(exc)
            return results, self.mark_started(owner, starts) if starts else 0
        keys, args = acquire_many_call(self, reqs, owner, starts)
        raw = self.calls.run(scripts.acquire_many, keys, args, f"{len(reqs)} acquire(s)")
        return self.acquire_many_reply(raw, reqs, owner=owner, starts=starts)

    def acquire_parts(self, request: AcquireRequest | None = None, **call: Any) -> tuple[bytes, bytes]:
        """``acquire(**call)``'s (or ``request``'s) keys and arguments, packed, for
        ``acquire_many_command`` (a caller that writes its own socket packs each acquire
        as it comes)."""
        return _acquire_parts(self, request if request is not None else AcquireRequest(**call))

    def acquire_many_command(self, parts: Sequence[tuple[bytes, bytes]], owner: str = "",
                             starts: Mapping[str, int] | None = None) -> bytes:
        """The EVALSHA of acquire_many for acquires packed by ``acquire_parts``, and marks."""
        return _acquire_many_command(self, parts, owner, starts)

    def acquire_many_reply(self, raw: Any, calls: Sequence[AcquireLike], *, owner: str = "",
                           starts: Mapping[str, int] | None = None) -> tuple[list, int]:
        """``acquire_many``'s answer from ``raw``, the reply read for its command.

        NOSCRIPT runs the call again here (which loads the script); any other
        error of the whole call raises. An acquire's own error reply becomes
        its LeaseError, as ``acquire`` would raise it.
        """
        reqs = [acquire_request(call) for call in calls]
        if isinstance(raw, Exception):
            keys, args = acquire_many_call(self, reqs, owner, starts)
            raw = self.calls.reply(scripts.acquire_many, keys, args, raw, f"{len(reqs)} acquire(s)")
        if not isinstance(raw, list) or len(raw) != len(reqs) + 1 or type(raw[-1]) is not int:
            raise LeaseError(f"acquire_many on {self.description}: {len(reqs)} acquire(s) answered "
                             f"{raw!r}")
        results: list = []
        for item, req in zip(raw, reqs):
            try:
                results.append(self._acquired(item, req))
            except LeaseError as exc:
                results.append(exc)
        return results, raw[-1]

    def finish(self, task_id: str, owner: str, token: int, outcome: str,
               *, next_attempt: int = 0, retry_grace: float | None = None,
               write: tuple[str, bytes | str, int] | None = None, not_after: int = 0,
               kept: bytes | None = None, kept_due: float = 0.0,
               written: Sequence[str] = ()) -> None:
        """Record the owner's outcome; raises LeaseLost when the caller is not the owner.

        ``retry`` hands the lease to attempt ``next_attempt``, which must acquire
        within ``retry_grace`` seconds (default: publish_grace; its countdown plus
        publish_grace) or be recovered; with publish tracking (``delivery_timeout``),
        within its countdown plus the delivery timeout.
        ``write`` = (key, value, expires seconds or 0), with a terminal outcome:
        also SET ``key`` and PUBLISH ``value`` on the channel ``key`` in the same
        script, so an accepted outcome and its result record land together and
        a refused one writes neither (``key`` must live on the same server).
        ``kept`` (unwritten.pack), with an accepted terminal outcome whose result
        the caller writes afterwards: kept in the store until confirmed, and
        written by recovery ``kept_due`` seconds on if never confirmed.
        ``written``: ids of this task's shard whose kept results were written
        since (unwritten.riding); they are confirmed whatever the answer.

        Safe to send again when its reply was lost: the same finish of the same
        owner and token answers OK once applied. ``not_after`` (server-clock
        ms, 0: none): a copy reaching the server later changes nothing and
        raises LeaseLost with reason "late" (settle.py). A holder whose record
        is gone re-creates it under its token (finish.lua, hand_over.lua).
        """
        self.finish_request(FinishRequest(
            task_id, owner, token, outcome, next_attempt=next_attempt, retry_grace=retry_grace,
            write=write, not_after=not_after, kept=kept, kept_due=kept_due, written=written))

    def finish_request(self, req: FinishRequest) -> None:
        """``finish`` for the FinishRequest ``req``."""
        script, keys, args = finish_call(self, req)
        reply = self.calls.run(script, keys, args, f"task {req.task_id}, key {keys[0]}")
        raise_if_corrupt(reply, f"finish of task {req.task_id}")
        code, current, state = reply
        raise_unless_ok(Code(code), req.task_id, req.token, state.decode())

    def revoke(self, task_id: str, *, expired: bool = False, owner: str = "", token: int = 0,
               name: str = "") -> Code:
        """Celery revoked ``task_id`` (or, ``expired``, its message passed ``expires``).

        OK: the task is revoked (now or before; a task never seen gets a terminal
        revoked record, so a later delivery is refused): REVOKED may be stored.
        FINISHED: it finished otherwise; its stored result must stay. BUSY: another
        owner holds a live lease and its outcome stands; a plain revoke is
        remembered so nobody runs the task after that owner (revoke.lua).
        ``owner``/``token``: the caller's own lease, whose execution is being
        discarded or terminated; it is revoked even though it is live.
        """
        key, shard = self.keys.record(one_task(task_id)), self.keys.shard_for(task_id)
        reply = self.calls.run(
            scripts.revoke, [key, shard.deadlines, shard.stats, self.keys.message(task_id)],
            [task_id, 1 if expired else 0, ms(self.settings.retention), owner, int(token or 0), name],
            f"task {task_id}, key {key}")
        raise_if_corrupt(reply, f"revoke of task {task_id}")
        return Code(reply[0])

    # -- the heartbeat's batch transitions (renewals.py) ----------------------

    def renew_many(self, owner: str, leases: Mapping[str, int], *, ttl: float | None = None,
                   check_progress: bool = False) -> dict[str, Code]:
        """Renew leases ``owner`` holds in one call per shard; the ones not renewed, with why (renewals.py)."""
        return renewals.renew_many(self, owner, leases, ttl=ttl, check_progress=check_progress)

    def release(self, owner: str, leases: Mapping[str, int], *, started: Collection[str] = (),
                hand_back: bool = False) -> int:
        """Make these leases due now, for recovery without waiting out the ttl; the record
        decides whether that costs a recovery (renewals.py, release.lua)."""
        return renewals.release(self, owner, leases, started=started, hand_back=hand_back)

    def mark_started(self, owner: str, leases: Mapping[str, int], *, alone: bool = False) -> int:
        """Record that the bodies of these leases started running (renewals.py); ``alone``:
        each runs with nothing beside it in its process, so its owner's death is its own."""
        return renewals.mark_started(self, owner, leases, alone=alone)

    def finish_many(self, reqs: Sequence[FinishRequest]) -> list[LeaseError | None]:
        """Several terminal finishes in one round trip; None or why not, each (renewals.py)."""
        return renewals.finish_many(self, reqs)

    def acquire_with_finishes(self, req: AcquireRequest, finishes: Sequence[FinishRequest]) -> tuple[Any, Any]:
        """``acquire_request(req)`` with ``finishes`` in its write; each answer a value (renewals.py)."""
        return renewals.acquire_with_finishes(self, req, finishes, self._acquired)

    def progress(self, task_id: str, owner: str, token: int) -> None:
        """Report progress of the running body; raises LeaseLost when no longer the owner."""
        key = self.keys.record(one_task(task_id))
        reply = self.calls.run(scripts.progress, (key, self.keys.shard_for(task_id).deadlines),
                          (task_id, owner, int(token)), f"task {task_id}, key {key}")
        raise_if_corrupt(reply, f"progress of task {task_id}")
        raise_unless_ok(Code(reply[0]), task_id, token)

    # -- the recovery pass (recovery.py) -----------------------------------

    def claim_expired(self, limit: int | None = None, ids: Sequence[str] | None = None) -> list[Claim]:
        """Claim up to ``limit`` leases whose deadline passed (``ids``: these): recovery.claim_expired."""
        return recovery.claim_expired(self, limit, ids)

    def mark_published(self, claims: Iterable[Claim]) -> int:
        """Confirm re-published claims: the broker holds them from now on (recovery.mark_published)."""
        return recovery.mark_published(self, claims)

    def recover(self, publish: Callable[[Claim], None] | None = None,
                on_dead: Callable[[Claim], None] | None = None, limit: int | None = None,
                on_corrupt: Callable[[Claim], None] | None = None) -> RecoveryReport:
        """Run one recovery pass: claim expired leases, re-publish them, confirm (recovery.recover);
        then every step of ``recovery_steps``. Each callable defaults to the store's own."""
        return recovery.recover(self, publish or self.publish, on_dead or self.on_dead, limit,
                                on_corrupt or self.on_corrupt, steps=self.recovery_steps,
                                claimer=lambda ids: self.claim_expired(ids=ids),
                                confirmer=self.mark_published)

    # -- parking and once-only steps -----------------------------------------

    def park(self, task_id: str, reason: str, *, name: str = "", body: bytes = b"",
             envelope: Mapping | None = None, key: str = "", field: str = "") -> None:
        """Keep a delivery that must not run (see park.lua), and take it out of publish tracking
        (its queued index); the lease record is not touched.

        ``key`` and ``field`` name what was corrupt, when the cause is a key.
        """
        keys = self.keys
        reply = self.calls.run(
            scripts.park, (keys.parked, keys.parked_meta, keys.parked_body),
            (task_id, reason, name, body, compact_json(dict(envelope)) if envelope else "", key, field,
             ms(self.settings.parked_retention), int(self.settings.parked_cap)),
            f"parking task {task_id}")
        raise_if_corrupt(reply, f"parking task {task_id}")
        # A parked delivery leaves publish tracking: recovery must not re-publish, from the
        # record taken at publish, a task parked so as not to run. A command of its own,
        # since the task's queued index lives in its shard's slot, not the parking keys' one.
        queued = keys.shard_for(task_id).queued
        self.calls.read(lambda: self.client.zrem(queued, task_id), f"dropping task {task_id} from {queued}")
        if int(reply[1]):
            logger.warning("parking task %s dropped %d older parked deliveries of %s "
                           "(kept: %d at most, for %ss)", task_id, int(reply[1]), keys.parked,
                           self.settings.parked_cap, self.settings.parked_retention)

    def try_recovery_turn(self, owner: str, interval: float) -> bool:
        """True for one caller per ``interval`` across all workers (the fallback recoverer's guard)."""
        return bool(self.calls.read(
            lambda: self.client.set(self.keys.recovery_guard, owner, nx=True, px=ms(interval)),
            f"setting {self.keys.recovery_guard}"))

    def complete_step(self, task_id: str, owner: str, token: int, step: str) -> bool:
        """Record once-only ``step`` of ``task_id`` as done under the caller's lease.

        True when recorded now; False when it was already recorded (by this or
        an earlier owner). Raises LeaseLost when the caller no longer owns the
        lease, so a stale owner never marks a step done for its successor.
        """
        key = self.keys.record(one_task(task_id))
        reply = self.calls.run(
            scripts.complete_step, (key,), (owner, int(token), step),
            f"task {task_id}, step {step!r}, key {key}")
        raise_if_corrupt(reply, f"step {step!r} of task {task_id}")
        code = reply[0]
        if Code(code) is Code.STEP_DONE:
            return False
        raise_unless_ok(Code(code), task_id, token)
        return True

    # -- operators' reads and repairs (admin.py; named in docs/operations.md) --

    def records(self, task_ids: Iterable[str], *, skip_corrupt: bool = False) -> list[LeaseRecord]:
        """The records of ``task_ids`` in that order (admin.records)."""
        return admin.records(self, task_ids, skip_corrupt=skip_corrupt)

    def scan(self, state: str | None = None, count: int = 500, limit: int | None = None) -> list[LeaseRecord]:
        """Lease records of this prefix, by SCAN: for operators (admin.scan)."""
        return admin.scan(self, state, count, limit)

    def purge(self, older_than: float = 0.0, *, dry_run: bool = False, count: int = 500) -> int:
        """Delete finished records at least ``older_than`` seconds old (admin.purge)."""
        return admin.purge(self, older_than, dry_run=dry_run, count=count)

    def stats(self) -> dict[str, int]:
        """Lifetime counters plus the leases indexed, summed over shards (admin.stats)."""
        return admin.stats(self)

    def parked(self, limit: int = 100) -> list[Parked]:
        """Parked deliveries, oldest first, without bodies (admin.parked)."""
        return admin.parked(self, limit)

    def parked_entry(self, task_id: str) -> Parked | None:
        """``task_id``'s parked delivery without its body, or None (admin.parked_entry)."""
        return admin.parked_entry(self, task_id)

    def unpark(self, task_id: str) -> Parked | None:
        """Remove ``task_id``'s parked delivery and return it with its body (admin.unpark)."""
        return admin.unpark(self, task_id)

    def reset_record(self, task_id: str) -> bool:
        """Delete ``task_id``'s record, message and deadline entry (admin.reset_record)."""
        return admin.reset_record(self, one_task(task_id))
