"""The lease store: every ownership change of a task is one atomic Lua script.

Knows nothing of Celery. The Celery wiring hands it opaque message bodies and
envelopes to keep for recovery, and a ``publish`` callable to put them back.
``LeaseStore`` holds the transitions and the reads; the script runner is
calls.py, the recovery pass recovery.py, the operators' tools admin.py, the
values it returns records.py.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import redis

from .. import defaults
from ..exceptions import CorruptRecord, LeaseError, LeaseLost
from . import admin, recovery, renewals
from .calls import ScriptCalls, compact_json, ms, raise_unless_ok
from .wire import segments
from .codes import OUTCOMES, Code
from .connection import connect, describe
from .keys import Keys, usable_id
from .records import (Acquisition, Claim, LeaseRecord, Parked, RecoveryReport, acquisition_of,
                      raise_if_corrupt)
from .scripts import Script, scripts

__all__ = ["LeaseStore", "PARKED_RETENTION", "PARKED_CAP"]

logger = logging.getLogger("celery_leases.store")

#: Parked entries are kept this long (seconds) and at most this many: an operator
#: has a week to look, and a flood of bad deliveries cannot fill the server.
PARKED_RETENTION = 7 * 86400.0
PARKED_CAP = 10_000

#: Keys and arguments of one acquire (acquire.lua's header): acquire_many takes them in blocks.
ACQUIRE_KEYS, ACQUIRE_ARGS = 6, 15


def one_task(task_id: Any) -> str:
    """``task_id``, or TypeError naming it when no record can have it (not a non-empty UTF-8
    str). Checked where a caller names one task; ids read back from the store's own indexes
    are not (a corrupt member is the scripts' to report, and must not stop a recovery pass)."""
    if not usable_id(task_id):
        raise TypeError(f"task id {task_id!r}: not a non-empty UTF-8 str; no lease record can have it")
    return task_id


class LeaseStore:
    """Leases of one key prefix on one Redis (a server, or a Redis Cluster).

    ``ttl``, ``retention`` and ``publish_grace`` are seconds. ``publish`` and
    ``on_dead`` are what a recovery pass does with a claimed lease; the Celery
    wiring provides them. ``shards`` (leases_shards) spreads the records and
    deadline indexes over that many hash tags (see keys.py): operations on many
    tasks make one script call per shard, and operations over the whole store
    (recovery, stats, listings) visit every shard.
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
                 on_corrupt: Callable[[Claim], None] | None = None) -> None:
        self.client = client
        self.keys = Keys(prefix, shards)
        self.shards = self.keys.shards
        # With one sequence per shard, tokens of different shards are ordered by
        # the clock; on a cluster, a failover that loses the last INCR of a
        # sequence then cannot hand out a token again (docs/cluster.md).
        self._clock_tokens = 1 if self.shards > 1 or hasattr(client, "get_node_from_key") else 0
        self.ttl, self.retention = ttl, retention
        self.max_recoveries, self.publish_grace = max_recoveries, publish_grace
        self.recover_batch = recover_batch
        self.publish, self.on_dead = publish, on_dead
        #: What a recovery pass does with a claim whose record is corrupt (park it).
        self.on_corrupt = on_corrupt
        self.parked_retention, self.parked_cap = parked_retention, parked_cap
        self.description = description or describe(client)
        #: More steps of every recovery pass, each returning a RecoveryReport (the Celery
        #: wiring adds the re-publish of undelivered tasks, queued.py, when tracking is on).
        self.recovery_steps: list[Callable[[], RecoveryReport]] = []
        #: Seconds of leases_delivery_timeout when publish tracking is on for this store (set by
        #: queued.QueuedTasks), else 0: a confirmed re-publish and a retry hand-over then wait in
        #: the queued index, so a copy the broker loses is re-published (mark_published.lua,
        #: hand_over.lua).
        self.delivery_timeout: float = 0.0
        #: Every script call and read goes through this runner (calls.py).
        self.calls = ScriptCalls(client, self.description)

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
        call: dict[str, Any] = dict(ttl=ttl, generation=generation, attempt=attempt, max_recoveries=max_recoveries,
                    progress_timeout=progress_timeout, name=name, body=body, envelope=envelope,
                    reassert=reassert, publish=publish, recorded=recorded, shared=shared)
        script, keys, args = self._acquire_call(task_id, owner, **call)
        raw = self.calls.run(script, keys, args, f"task {task_id}, key {keys[0]}")
        return self.acquire_reply(raw, task_id=task_id, owner=owner, **call)

    def acquire_reply(self, raw: Any, **call: Any) -> Acquisition:
        """The Acquisition in ``raw``, the reply read for ``acquire(**call)``'s script call.

        An error reply raises as ``acquire`` would (NOSCRIPT: the call is made
        again here, which loads the script); CORRUPT raises CorruptRecord.
        """
        task_id = call.get("task_id")
        if isinstance(raw, Exception):
            script, keys, args = self._acquire_call(**call)
            raw = self.calls.reply(script, keys, args, raw, f"task {task_id}, key {keys[0]}")
        raise_if_corrupt(raw, f"task {task_id}")
        acq = acquisition_of(raw)
        if acq.code is Code.NO_MESSAGE:  # the message left out after all: now with it, waiting
            return self.acquire(**{**call, "recorded": False})
        return acq

    def acquire_many(self, calls: Sequence[Mapping[str, Any]], *, owner: str = "",
                     starts: Mapping[str, int] | None = None) -> tuple[list, int]:
        """Several acquires in one call (acquire_many.lua), with start marks riding along.

        ``calls``: each acquire's keyword arguments (``task_id`` and ``owner``
        included); ``starts``: leases of ``owner`` whose bodies started
        (``mark_started``). Returns each acquire's Acquisition, or the
        LeaseError it alone met, in order, and the number of leases marked.
        An error of the whole call raises. On a cluster, whose keys cannot
        share a call, the acquires are made one by one.
        """
        if self.calls.cluster:
            results: list = []
            for call in calls:
                try:
                    results.append(self.acquire(**call))
                except LeaseError as exc:
                    results.append(exc)
            return results, self.mark_started(owner, starts) if starts else 0
        keys, args = self._acquire_many_call(calls, owner, starts)
        raw = self.calls.run(scripts.acquire_many, keys, args, f"{len(calls)} acquire(s)")
        return self.acquire_many_reply(raw, calls, owner=owner, starts=starts)

    def acquire_parts(self, **call: Any) -> tuple[bytes, bytes]:
        """``acquire(**call)``'s keys and arguments, packed, for ``acquire_many_command``
        (a caller that writes its own socket packs each acquire as it comes)."""
        keys, args = self._shared_acquire(call)
        return segments(keys), segments(args)

    def acquire_many_command(self, parts: Sequence[tuple[bytes, bytes]], owner: str = "",
                             starts: Mapping[str, int] | None = None) -> bytes:
        """The EVALSHA of acquire_many for acquires packed by ``acquire_parts``, and marks."""
        mark_keys, head = self._many_frame(len(parts), owner, starts)
        n_keys = ACQUIRE_KEYS * len(parts) + len(mark_keys)
        n_args = len(head) + ACQUIRE_ARGS * len(parts)
        return b"".join([b"*%d\r\n" % (3 + n_keys + n_args),
                         segments(("EVALSHA", scripts.acquire_many.sha, n_keys)),
                         *(keys for keys, _ in parts), segments(mark_keys), segments(head),
                         *(args for _, args in parts)])

    def acquire_many_reply(self, raw: Any, calls: Sequence[Mapping[str, Any]], *, owner: str = "",
                           starts: Mapping[str, int] | None = None) -> tuple[list, int]:
        """``acquire_many``'s answer from ``raw``, the reply read for its command.

        NOSCRIPT runs the call again here (which loads the script); any other
        error of the whole call raises. An acquire's own error reply becomes
        its LeaseError, as ``acquire`` would raise it.
        """
        if isinstance(raw, Exception):
            keys, args = self._acquire_many_call(calls, owner, starts)
            raw = self.calls.reply(scripts.acquire_many, keys, args, raw, f"{len(calls)} acquire(s)")
        if not isinstance(raw, list) or len(raw) != len(calls) + 1 or type(raw[-1]) is not int:
            raise LeaseError(f"acquire_many on {self.description}: {len(calls)} acquire(s) answered "
                             f"{raw!r}")
        results: list = []
        for item, call in zip(raw, calls):
            try:
                results.append(self.acquire_reply(item, **call))
            except LeaseError as exc:
                results.append(exc)
        return results, raw[-1]

    def _acquire_many_call(self, calls: Sequence[Mapping[str, Any]], owner: str,
                           starts: Mapping[str, int] | None) -> tuple[list, list]:
        keys: list = []
        args: list = []
        for call in calls:
            one_keys, one_args = self._shared_acquire(call)
            keys += one_keys
            args += one_args
        mark_keys, head = self._many_frame(len(calls), owner, starts)
        return keys + mark_keys, head + args

    def _shared_acquire(self, call: Mapping[str, Any]) -> tuple[list, list]:
        """One acquire's keys and arguments as acquire_many takes them (acquire.lua's)."""
        script, keys, args = self._acquire_call(**call)
        if script is not scripts.acquire:
            raise ValueError(f"task {call.get('task_id')!r}: a re-assert cannot share an acquire_many call")
        return keys, args

    def _many_frame(self, n: int, owner: str, starts: Mapping[str, int] | None) -> tuple[list, list]:
        """acquire_many's keys after the acquires' (the marks': their shard's stats hash, then
        each record) and its arguments before theirs (n, m, owner, the m tokens): its header's
        layout, in this one place."""
        if not starts:
            return [], [n, 0, ""]
        first = next(iter(starts))
        tokens = [int(token) for token in starts.values()]
        return ([self.keys.shard_for(first).stats, *(self.keys.record(t) for t in starts)],
                [n, len(tokens), owner, *tokens])

    def _acquire_call(self, task_id: str, owner: str, *, ttl: float | None = None,
                      generation: int = 0, attempt: int = 0, max_recoveries: int | None = None,
                      progress_timeout: float = 0, name: str = "", body: bytes = b"",
                      envelope: Mapping | None = None, reassert: int = 0,
                      publish: str = "", recorded: bool = False,
                      shared: bool = False) -> tuple[Script, list, list]:
        """The script, KEYS and ARGV of an acquire: acquire.lua, or reassert.lua for ``reassert``."""
        # (The wire would carry 1.5 as "1.5": a wrong id, not a task's.)
        key, shard = self.keys.record(one_task(task_id)), self.keys.shard_for(task_id)
        keys = [key, shard.deadlines, shard.sequence, shard.stats, self.keys.message(task_id)]
        if not reassert:
            keys.append(shard.queued)  # a record queued at publish leaves this index (acquire.lua)
        # A recorded message is left out (acquire.lua ARGV[14]); a re-assert always sends it.
        omit = bool(recorded and publish and not reassert)
        args = [task_id, owner, ms(self.ttl if ttl is None else ttl), int(generation), int(attempt),
                self.max_recoveries if max_recoveries is None else int(max_recoveries),
                ms(progress_timeout), name, b"" if omit else body,
                "" if omit or envelope is None else compact_json(envelope)]
        if reassert:
            return scripts.reassert, keys, [*args, int(reassert)]
        return scripts.acquire, keys, [*args, ms(self.retention), self._clock_tokens, publish or "",
                                       1 if omit else 0, 1 if shared else 0]

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
        if outcome not in OUTCOMES:
            raise ValueError(f"finish: unknown outcome {outcome!r} for task {task_id}; "
                             f"expected one of {OUTCOMES}")
        key, shard = self.keys.record(one_task(task_id)), self.keys.shard_for(task_id)
        if outcome == "retry":  # the hand-over to the next attempt (hand_over.lua)
            if write is not None:
                raise ValueError(f"finish: task {task_id}: a retry hand-over writes no result")
            script = scripts.hand_over
            keys = [key, shard.deadlines, shard.stats, shard.sequence, shard.queued]
            wait = self.publish_grace if retry_grace is None else retry_grace
            # With publish tracking the next attempt is due at its countdown (retry_grace is the
            # countdown plus publish_grace) and waits the delivery timeout from then.
            args = [task_id, owner, int(token), int(next_attempt), ms(wait), int(not_after),
                    ms(max(0.0, wait - self.publish_grace)), ms(self.delivery_timeout or 0)]
        else:
            script = scripts.finish
            if write is not None and kept is not None:
                raise ValueError(f"finish: task {task_id}: a result written by the finish is not kept too")
            keys = [key, shard.deadlines, shard.stats, self.keys.message(task_id), shard.sequence,
                    shard.unwritten, shard.unwritten_results]
            args = [task_id, owner, int(token), outcome, ms(self.retention), int(not_after)]
            if write is not None:
                keys.append(write[0])
                args += [write[1], int(write[2] or 0)]
            else:
                args += ["", 0]
            args += [kept or "", ms(kept_due), *written]
        reply = self.calls.run(script, keys, args, f"task {task_id}, key {key}")
        raise_if_corrupt(reply, f"finish of task {task_id}")
        code, current, state = reply
        raise_unless_ok(Code(code), task_id, token, state.decode())

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
            [task_id, 1 if expired else 0, ms(self.retention), owner, int(token or 0), name],
            f"task {task_id}, key {key}")
        raise_if_corrupt(reply, f"revoke of task {task_id}")
        return Code(reply[0])

    def renew_many(self, owner: str, leases: Mapping[str, int], *, ttl: float | None = None,
                   check_progress: bool = False) -> dict[str, Code]:
        """Renew leases ``owner`` holds in one call per shard; the ones not renewed, with why (renewals.py)."""
        return renewals.renew_many(self, owner, leases, ttl=ttl, check_progress=check_progress)

    def release(self, owner: str, leases: Mapping[str, int], *, unstarted: bool = False) -> int:
        """Make these leases due now, for recovery without waiting out the ttl (renewals.py)."""
        return renewals.release(self, owner, leases, unstarted=unstarted)

    def mark_started(self, owner: str, leases: Mapping[str, int], *, alone: bool = False) -> int:
        """Record that the bodies of these leases started running (renewals.py); ``alone``:
        each runs with nothing beside it in its process, so its owner's death is its own."""
        return renewals.mark_started(self, owner, leases, alone=alone)

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
        """Run one recovery pass: claim expired leases, re-publish them, confirm (recovery.recover)."""
        return recovery.recover(self, publish, on_dead, limit, on_corrupt)

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
             ms(self.parked_retention), int(self.parked_cap)),
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
                           self.parked_cap, self.parked_retention)

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

    def completed_steps(self, task_id: str) -> dict[str, int]:
        """Once-only steps recorded for ``task_id``: step name -> token of the owner that recorded it."""
        key = self.keys.record(one_task(task_id))
        raw = self.calls.read(lambda: self.client.hgetall(key), f"reading {key} of task {task_id}")
        try:
            return {k.decode()[5:]: int(v) for k, v in raw.items() if k.startswith(b"step:")}
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"steps of task {task_id} in {key} are corrupt: {exc!r}") from None

    # -- reads ---------------------------------------------------------------

    def get(self, task_id: str) -> LeaseRecord | None:
        """The lease record of ``task_id``, or None when there is none; TypeError for an
        id no record can have (not a non-empty UTF-8 str), as for every call about one task."""
        key = self.keys.record(one_task(task_id))

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.zscore(self.keys.shard_for(task_id).deadlines, task_id)
            pipe.exists(self.keys.message(task_id))
            return pipe.execute()

        raw, deadline, has_message = self.calls.read(read, f"reading {key} of task {task_id}")
        if not raw:
            return None
        return LeaseRecord.parse(task_id, key, raw, int(deadline or 0), bool(has_message))

    def check(self, task_id: str, owner: str, token: int) -> None:
        """Raise LeaseLost unless ``owner`` with ``token`` still holds ``task_id``'s lease."""
        key = self.keys.record(one_task(task_id))
        state, current, current_owner = self.calls.read(
            lambda: self.client.hmget(key, "state", "token", "owner"),
            f"reading {key} of task {task_id}")
        if state is None:
            raise LeaseLost(task_id, token, "missing")
        try:
            current = int(current)
        except (TypeError, ValueError):
            raise CorruptRecord(f"lease record {key} of task {task_id}: field token is not a "
                                f"number: {current!r}") from None
        if state != b"active" or current != int(token) or (current_owner or b"").decode() != owner:
            raise LeaseLost(task_id, token, "lost" if state in (b"active", b"recovering") else "finished")

    def active(self, limit: int = 1000) -> list[tuple[str, int]]:
        """(task id, deadline ms) of leases in the deadline indexes, soonest first."""
        shards = self.keys.all_shards()

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            for shard in shards:
                pipe.zrange(shard.deadlines, 0, limit - 1, withscores=True)
            return pipe.execute()

        found = self.calls.read(read, f"reading {shards[0].deadlines}" + (
            f" and {len(shards) - 1} more deadline indexes" if len(shards) > 1 else ""))
        rows = sorted(((int(s), t.decode()) for rows in found for t, s in rows))[:limit]
        return [(t, s) for s, t in rows]

    def expired(self, limit: int = 1000) -> list[str]:
        """Task ids whose deadline passed, by the server clock (up to ``limit``, of any shards)."""
        out: list[str] = []
        for ids in self.expired_by_shard(range(self.shards), limit).values():
            out += ids
        return out[:limit]

    def expired_by_shard(self, shards: Iterable[int], limit: int) -> dict[int, list[str]]:
        """Up to ``limit`` expired task ids of each of ``shards`` (each by its own master's clock)."""
        shards = list(shards)
        calls = [((self.keys.shard(i).deadlines,), (int(limit),)) for i in shards]
        results = self.calls.run_many(scripts.expired, calls, "listing expired leases")
        out: dict[int, list[str]] = {}
        for i, rows in zip(shards, results):
            if rows and rows[0] == Code.CORRUPT:
                # This shard's deadline index is not a sorted set: logged, the other shards go on.
                logger.error("listing expired leases: %s field %s %s", *(v.decode() for v in rows[1:4]))
                rows = [0]
            out[i] = [t.decode() for t in rows[1:]]
        return out

    def server_time_ms(self, key: str | None = None) -> int:
        """The server clock in ms; on a cluster, of the master holding ``key`` (else any node)."""
        def read() -> Any:
            if key is not None and hasattr(self.client, "get_node_from_key"):
                return self.client.time(target_nodes=self.client.get_node_from_key(key))
            return self.client.time()
        seconds, micros = self.calls.read(read, "reading the server clock")
        return int(seconds) * 1000 + int(micros) // 1000

    def held_for(self, task_id: str) -> float | None:
        """Seconds since the current or last owner of ``task_id`` acquired it, by the server clock.

        None when there is no record (or it was never acquired).
        """
        key = self.keys.record(one_task(task_id))
        acquired_at = self.calls.read(lambda: self.client.hget(key, "acquired_at"),
                                 f"reading {key} of task {task_id}")
        if not acquired_at:
            return None
        return max(0.0, (self.server_time_ms(key) - int(acquired_at)) / 1000.0)

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
