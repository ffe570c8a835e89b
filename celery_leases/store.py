"""The lease store: every ownership change of a task is one atomic Lua script.

Knows nothing of Celery. The Celery wiring hands it opaque message bodies and
envelopes to keep for recovery, and a ``publish`` callable to put them back.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import redis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from .codes import OUTCOMES, STATES, TERMINAL_STATES, Code
from .connection import connect, describe
from .direct import BUSY, DirectCaller
from .direct import supported as direct_supported
from .errors import lease_error
from .exceptions import CorruptRecord, LeaseError, LeaseLost
from .keys import Keys, ShardKeys
from .scripts import Script, scripts

__all__ = ["LeaseStore", "LeaseRecord", "Acquisition", "Claim", "RecoveryReport", "Parked"]

logger = logging.getLogger("celery_leases.store")

_INT_FIELDS = ("token", "ttl", "generation", "recoveries", "attempt",
               "progress_timeout", "progress_deadline", "acquired_at", "finished_at",
               "revoke_requested", "unstarted_recoveries")


@dataclass(frozen=True)
class LeaseRecord:
    """A snapshot of one task's lease. Times are server-clock milliseconds."""

    task_id: str
    state: str
    token: int
    owner: str
    #: Server-clock ms when the lease is due for recovery (0: not in the deadline index).
    deadline: int
    recoveries: int
    generation: int = 0
    attempt: int = 0
    ttl: int = 0
    name: str = ""
    acquired_at: int = 0
    finished_at: int = 0
    progress_timeout: int = 0
    progress_deadline: int = 0
    #: Server-clock ms of a revoke that came while an owner ran the task (0: none).
    revoke_requested: int = 0
    #: (token, owner, acquired_at) of the last owners, oldest first.
    history: tuple = ()
    has_message: bool = False
    #: False while the owner has not reported that the body started (mark_started):
    #: its death then counts no recovery, only an unstarted one.
    started: bool = True
    #: Recoveries of the lease while it was never marked started (bounded separately).
    unstarted_recoveries: int = 0

    @classmethod
    def parse(cls, task_id: str, key: str, raw: Mapping[bytes, bytes], deadline: int = 0,
              has_message: bool = False) -> "LeaseRecord":
        data = {k.decode(): v for k, v in raw.items()}
        values: dict[str, Any] = {}
        for name in _INT_FIELDS:
            try:
                values[name] = int(data.get(name, b"0") or 0)
            except ValueError:
                raise CorruptRecord(f"lease record {key} of task {task_id}: field {name} is not a "
                                    f"number: {data[name]!r}", key, name) from None
        try:
            state = data["state"].decode()
        except (KeyError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"lease record {key} of task {task_id}: field state is "
                                f"missing or unreadable: {exc!r}", key, "state") from None
        if state not in STATES:  # as the scripts' validation: one of the six, or corrupt
            raise CorruptRecord(f"lease record {key} of task {task_id}: field state is {state!r}, "
                                f"not a known state", key, "state")
        history = []
        try:
            for name, entry in data.items():
                if name.startswith("h:"):
                    token, rest = entry.decode().split("@", 1)
                    owner, at = rest.rsplit("@", 1)
                    history.append((int(token), owner, int(at)))
        except ValueError:
            raise CorruptRecord(f"lease record {key} of task {task_id}: a history field is corrupt") from None
        history.sort()
        return cls(task_id=task_id, state=state, owner=(data.get("owner") or b"").decode(),
                   deadline=deadline,
                   name=(data.get("name") or b"").decode(), history=tuple(history),
                   has_message=has_message, started=data.get("started") != b"0", **values)


@dataclass(frozen=True)
class Acquisition:
    """What ``acquire`` decided for one delivery."""

    code: Code
    token: int
    generation: int
    recoveries: int
    state: str

    @property
    def owned(self) -> bool:
        """True when the caller now owns the lease and may run the task."""
        return self.code in (Code.ACQUIRED, Code.TAKEN_OVER)


@dataclass
class Claim:
    """A lease claimed by a recovery pass: its message must be re-published."""

    task_id: str
    code: Code
    generation: int
    recoveries: int
    name: str
    body: bytes
    envelope: dict
    #: Set when the stored message cannot be used (e.g. a corrupt envelope).
    error: Exception | None = None


@dataclass
class RecoveryReport:
    """Counts of one recovery pass."""

    recovered: int = 0
    dead: int = 0
    publish_failed: int = 0
    #: Claims whose record (or message hash) was corrupt: taken out of the index and parked.
    corrupt: int = 0
    errors: list = field(default_factory=list)

    def __iadd__(self, other: "RecoveryReport") -> "RecoveryReport":
        self.recovered += other.recovered
        self.dead += other.dead
        self.publish_failed += other.publish_failed
        self.corrupt += other.corrupt
        self.errors.extend(other.errors)
        return self

    def as_dict(self) -> dict:
        return {"recovered": self.recovered, "dead": self.dead,
                "publish_failed": self.publish_failed, "corrupt": self.corrupt}


@dataclass(frozen=True)
class Parked:
    """A delivery parked instead of run (``LeaseStore.park``), kept for an operator."""

    task_id: str
    reason: str
    #: Server-clock ms of the (last) parking.
    parked_at: int
    name: str = ""
    #: The key and field that were corrupt ('' when the cause was not a key).
    key: str = ""
    field: str = ""
    #: Times this task id was parked (a replayed delivery that is parked again counts on).
    count: int = 1
    #: The message: empty in ``parked()`` listings (see body_size), filled by ``unpark``.
    body: bytes = b""
    envelope: dict = dataclasses.field(default_factory=dict)
    body_size: int = 0

    @classmethod
    def parse(cls, task_id: str, meta: bytes, body: bytes = b"") -> "Parked":
        try:
            data = json.loads(meta.decode("utf-8", "surrogateescape"))
            envelope = json.loads(data.get("envelope") or "{}")
        except ValueError as exc:
            raise CorruptRecord(f"parked entry of task {task_id} is not JSON: {exc}") from None
        return cls(task_id=task_id, reason=str(data.get("reason", "")),
                   parked_at=int(data.get("parked_at") or 0), name=str(data.get("name", "")),
                   key=str(data.get("key", "")), field=str(data.get("field", "")),
                   count=int(data.get("count") or 1), body=body,
                   envelope=envelope if isinstance(envelope, dict) else {},
                   body_size=int(data.get("body_size") or len(body)))


#: Parked entries are kept this long (seconds) and at most this many: an operator
#: has a week to look, and a flood of bad deliveries cannot fill the server.
PARKED_RETENTION = 7 * 86400.0
PARKED_CAP = 10_000


def _ms(seconds: float) -> int:
    return max(0, int(round(seconds * 1000)))


class LeaseStore:
    """Leases of one key prefix on one Redis (a server, or a Redis Cluster).

    ``ttl``, ``retention`` and ``publish_grace`` are seconds. ``publish`` and
    ``on_dead`` are what a recovery pass does with a claimed lease; the Celery
    wiring provides them. ``shards`` (leases_shards) spreads the records and
    deadline indexes over that many hash tags (see keys.py): operations on many
    tasks make one script call per shard, and operations over the whole store
    (recovery, stats, listings) visit every shard.
    """

    def __init__(self, client: redis.Redis, prefix: str = "leases", *,
                 ttl: float = 30.0, retention: float = 86400.0,
                 max_recoveries: int = 3, publish_grace: float = 60.0,
                 recover_batch: int = 500,
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
        #: Single-script calls skip redis-py's per-call work where that is safe (direct.py).
        self._direct = DirectCaller(client) if direct_supported(client) else None

    @classmethod
    def from_url(cls, url: str, *, transport_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> "LeaseStore":
        """A store on ``url`` (any form ``leases_redis_url`` takes; ``transport_options``
        as ``leases_redis_transport_options``, e.g. Sentinel's ``master_name``)."""
        return cls(connect(url, transport_options=transport_options), **kwargs)

    # -- calls ---------------------------------------------------------------

    def _run(self, script: Script, keys: Sequence[str], args: Sequence[Any], what: str) -> Any:
        """Run a script, turning Redis errors into LeaseErrors that name what failed."""
        try:
            direct = self._direct
            if direct is not None:
                try:
                    reply = direct.call(script.sha, keys, args)
                except NoScriptError:
                    # The server lost its scripts: the source, sent once, loads it again.
                    return self.client.eval(script.source, len(keys), *keys, *args)
                if reply is not BUSY:
                    return reply
            return script(self.client, keys, args)
        except Exception as exc:
            error = self.script_error(script, exc, what)
            if error is exc:
                raise
            raise error from exc

    def script_error(self, script: Script, exc: BaseException, what: str) -> BaseException:
        """The LeaseError a Redis error of ``script`` becomes (anything else unchanged): errors.py."""
        return lease_error(exc, f"{script.name} ({what})", self.description)

    def _run_many(self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
                  what: str) -> list:
        """Run ``script`` once per (keys, args), pipelined into one round trip per server.

        Each call touches one shard, so each is legal on a cluster; a cluster
        pipeline sends each node its calls together. A call that finds its
        script not cached (NOSCRIPT) is repeated alone, which loads it.
        """
        if len(calls) == 1:
            keys, args = calls[0]
            return [self._run(script, keys, args, what)]
        if hasattr(self.client, "get_node_from_key"):
            return self._run_many_cluster(script, calls, what)

        def send() -> list:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return pipe.execute(raise_on_error=False)

        try:
            results = send()
        except Exception as exc:
            error = self.script_error(script, exc, what)
            if error is exc:
                raise
            raise error from exc
        out = []
        for (keys, args), result in zip(calls, results):
            if isinstance(result, NoScriptError):
                result = self._run(script, keys, args, what)
            elif isinstance(result, Exception):
                raise self.script_error(script, result, what) from result
            out.append(result)
        return out

    def _run_many_cluster(self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
                          what: str) -> list:
        """``_run_many`` on a cluster: one pipeline per master, on its own connection.

        redis-py's cluster pipeline refuses EVALSHA, so the calls are grouped
        by the master that serves their slot (as the client last saw the
        slot map). A call that meets a redirection (MOVED, ASK, a failover
        under way) or an error of its node's connection is repeated alone
        through the cluster client, which follows the new map and retries.
        Every master gets its calls even when one fails; then the first
        error is raised.
        """
        cluster: Any = self.client
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, (keys, _) in enumerate(calls):
            try:
                node = cluster.get_node_from_key(keys[0])
            except Exception:  # noqa: BLE001 - slot not covered now: the lone call reports it
                node = None
            name = getattr(node, "name", "")
            nodes[name] = node
            by_node.setdefault(name, []).append(i)
        out: list[Any] = [None] * len(calls)
        first_error: LeaseError | None = None
        for name, indexes in by_node.items():
            results: list[Any] = [None] * len(indexes)
            node = nodes[name]
            if node is not None:
                try:
                    pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
                    for i in indexes:
                        keys, args = calls[i]
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    results = pipe.execute(raise_on_error=False)
                except Exception:  # noqa: BLE001 - each call is repeated alone below
                    results = [None] * len(indexes)
            for i, result in zip(indexes, results):
                try:
                    if result is None or isinstance(result, (NoScriptError, RedisConnectionError)) or (
                            isinstance(result, ResponseError) and _redirected(result)):
                        keys, args = calls[i]
                        result = self._run(script, keys, args, what)
                    elif isinstance(result, Exception):
                        raise self.script_error(script, result, what) from result
                except LeaseError as exc:
                    # The other masters' calls still run (a heartbeat still
                    # renews the shards that answer); the first error is raised.
                    first_error = first_error or exc
                out[i] = result
        if first_error is not None:
            raise first_error
        return out

    def _by_shard(self, task_ids: Iterable[str]) -> dict[int, list[str]]:
        """``task_ids`` grouped by shard, in their order within each shard."""
        groups: dict[int, list[str]] = {}
        shard_of = self.keys.shard_of
        for task_id in task_ids:
            groups.setdefault(shard_of(task_id), []).append(task_id)
        return groups

    def _read(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except Exception as exc:
            error = lease_error(exc, what, self.description)
            if error is exc:
                raise
            raise error from exc

    # -- transitions ---------------------------------------------------------

    def acquire(self, task_id: str, owner: str, *, ttl: float | None = None,
                generation: int = 0, attempt: int = 0, max_recoveries: int | None = None,
                progress_timeout: float = 0, name: str = "", body: bytes = b"",
                envelope: Mapping | None = None, reassert: int = 0, publish: str = "") -> Acquisition:
        """Try to become the owner of ``task_id``'s lease for one delivery of its message.

        ``reassert``: the token of a lease the caller holds but whose record has
        vanished (a failover lost the write that created it): the record is
        re-created with that token, or LOST comes back if another record exists.
        ``publish``: the message's publish id (publish.py): a new one runs a
        finished (succeeded or failed) task again; a copy of an earlier one is STALE.
        """
        keys, args = self.acquire_args(
            task_id, owner, ttl=ttl, generation=generation, attempt=attempt,
            max_recoveries=max_recoveries, progress_timeout=progress_timeout, name=name,
            body=body, envelope=envelope, reassert=reassert, publish=publish)
        return acquisition_of(self._run(scripts.acquire, keys, args, f"task {task_id}, key {keys[0]}"))

    def acquire_args(self, task_id: str, owner: str, *, ttl: float | None = None,
                      generation: int = 0, attempt: int = 0, max_recoveries: int | None = None,
                      progress_timeout: float = 0, name: str = "", body: bytes = b"",
                      envelope: Mapping | None = None, reassert: int = 0,
                      publish: str = "") -> tuple[list, list]:
        """KEYS and ARGV of acquire.lua (for a caller that sends the script itself: the worker's acquirer)."""
        key, shard = self.keys.record(task_id), self.keys.shard_for(task_id)
        return ([key, shard.deadlines, shard.sequence, shard.stats, self.keys.message(task_id)],
                [task_id, owner, _ms(self.ttl if ttl is None else ttl), int(generation), int(attempt),
                 self.max_recoveries if max_recoveries is None else int(max_recoveries),
                 _ms(progress_timeout), name, body,
                 _compact_json(envelope) if envelope is not None else "",
                 _ms(self.retention), self._clock_tokens, int(reassert), publish or ""])

    def finish(self, task_id: str, owner: str, token: int, outcome: str,
               *, next_attempt: int = 0, retry_grace: float | None = None,
               write: tuple[str, bytes | str, int] | None = None, not_after: int = 0) -> None:
        """Record the owner's outcome; raises LeaseLost when the caller is not the owner.

        ``retry`` hands the lease to attempt ``next_attempt``, which must acquire
        within ``retry_grace`` seconds (default: publish_grace) or be recovered.
        ``write`` = (key, value, expires seconds or 0), with a terminal outcome:
        also SET ``key`` and PUBLISH ``value`` on the channel ``key`` in the same
        script, so an accepted outcome and its result record land together and
        a refused one writes neither (``key`` must live on the same server).

        Safe to send again when its reply was lost: the same finish of the same
        owner and token answers OK once applied. ``not_after`` (server-clock
        ms, 0: none): a copy reaching the server later changes nothing and
        raises LeaseLost with reason "late" (settle.py). A holder whose record
        is gone re-creates it under its token (finish.lua).
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"finish: unknown outcome {outcome!r} for task {task_id}; "
                             f"expected one of {OUTCOMES}")
        key, shard = self.keys.record(task_id), self.keys.shard_for(task_id)
        keys = [key, shard.deadlines, shard.stats, self.keys.message(task_id), shard.sequence]
        args = [task_id, owner, int(token), outcome, _ms(self.retention), int(next_attempt),
                _ms(self.publish_grace if retry_grace is None else retry_grace), int(not_after)]
        if write is not None:
            if outcome == "retry":
                raise ValueError(f"finish: task {task_id}: a retry hand-over writes no result")
            keys.append(write[0])
            args.extend((write[1], int(write[2] or 0)))
        reply = self._run(scripts.finish, keys, args, f"task {task_id}, key {key}")
        _raise_if_corrupt(reply, f"finish of task {task_id}")
        code, current, state = reply
        _raise_unless_ok(Code(code), task_id, token, state.decode())

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
        key, shard = self.keys.record(task_id), self.keys.shard_for(task_id)
        reply = self._run(
            scripts.revoke, [key, shard.deadlines, shard.stats, self.keys.message(task_id)],
            [task_id, 1 if expired else 0, _ms(self.retention), owner, int(token or 0), name],
            f"task {task_id}, key {key}")
        _raise_if_corrupt(reply, f"revoke of task {task_id}")
        return Code(reply[0])

    def renew_many(self, owner: str, leases: Mapping[str, int], *, ttl: float | None = None,
                   check_progress: bool = False) -> dict[str, Code]:
        """Renew leases ``owner`` holds, all with the same ``ttl``, in one call per shard.

        Returns the leases not renewed, with why. ``check_progress`` enforces
        progress deadlines (leases of tasks with a progress timeout). With
        several shards the per-shard calls go out pipelined: one round trip to
        a single server, one per master on a cluster.
        """
        if not leases:
            return {}
        # A large renewal allocates tens of thousands of short-lived objects; a
        # cyclic GC pass triggered in the middle of it doubled its latency. The
        # collection is deferred until the call is done (never skipped).
        pause_gc = len(leases) >= 1000 and gc.isenabled()
        if pause_gc:
            gc.disable()
        try:
            ttl_ms, progress = _ms(self.ttl if ttl is None else ttl), 1 if check_progress else 0
            calls = []
            groups = self._by_shard(leases) if self.shards > 1 else {0: list(leases)}
            for index, task_ids in groups.items():
                shard = self.keys.shard(index)
                start = shard.record_prefix()
                calls.append(([shard.deadlines, shard.stats, *(start + t for t in task_ids)],
                              [owner, ttl_ms, progress, len(start), *(leases[t] for t in task_ids)]))
            out: dict[str, Code] = {}
            results = self._run_many(scripts.renew_many, calls, f"{len(leases)} leases of {owner}")
            for task_ids, flat in zip(groups.values(), results):
                if flat and flat[0] == Code.CORRUPT:
                    # The shard's deadline index itself: none of its leases can be renewed.
                    logger.error("lease heartbeat of %s: %s field %s %s; its %d lease(s) are not "
                                 "renewed", owner, flat[1].decode(), flat[2].decode(), flat[3].decode(),
                                 len(task_ids))
                    out.update(dict.fromkeys(task_ids, Code.CORRUPT))
                    continue
                i = 0
                while i < len(flat):
                    task_id, code = flat[i].decode(), Code(flat[i + 1])
                    out[task_id] = code
                    i += 2
                    if code is Code.CORRUPT:
                        # One record: that task's lease is not renewed (lost); the rest were.
                        logger.error("lease of task %s not renewed: its record %s field %s; it is "
                                     "treated as lost and recovery parks it", task_id,
                                     self.keys.record(task_id), flat[i].decode())
                        i += 1
            return out
        finally:
            if pause_gc:
                gc.enable()

    def progress(self, task_id: str, owner: str, token: int) -> None:
        """Report progress of the running body; raises LeaseLost when no longer the owner."""
        key = self.keys.record(task_id)
        reply = self._run(scripts.progress, (key, self.keys.shard_for(task_id).deadlines),
                          (task_id, owner, int(token)), f"task {task_id}, key {key}")
        _raise_if_corrupt(reply, f"progress of task {task_id}")
        _raise_unless_ok(Code(reply[0]), task_id, token)

    def release(self, owner: str, leases: Mapping[str, int], *, unstarted: bool = False) -> int:
        """Make these leases due now so they are recovered without waiting out the ttl.

        ``unstarted`` marks leases whose task never ran (a warm shutdown's
        prefetched messages): taking them over then counts no recovery.
        """
        if not leases:
            return 0
        calls = []
        for index, task_ids in self._by_shard(leases).items():
            keys = [self.keys.shard(index).deadlines]
            args: list[Any] = [owner, 1 if unstarted else 0]
            for task_id in task_ids:
                keys.append(self.keys.record(task_id))
                args += [task_id, int(leases[task_id])]
            calls.append((keys, args))
        released = 0
        for reply in self._run_many(scripts.release, calls, f"{len(leases)} leases of {owner}"):
            _raise_if_corrupt(reply, f"releasing leases of {owner}")
            released += int(reply[1])
            for task_id, what in zip(reply[2::2], reply[3::2]):
                logger.error("lease of task %s not released: its record %s field %s",
                             task_id.decode(), self.keys.record(task_id.decode()), what.decode())
        return released

    def mark_started(self, owner: str, leases: Mapping[str, int]) -> int:
        """Record that the bodies of these leases started running; returns how many were marked.

        Only a started lease counts a recovery when its owner dies: prefetched
        tasks of a dead worker are not charged for its death (mark_started.lua).
        """
        if not leases:
            return 0
        calls = []
        for index, task_ids in self._by_shard(leases).items():
            calls.append(([self.keys.shard(index).stats, *(self.keys.record(t) for t in task_ids)],
                          [owner, *(int(leases[t]) for t in task_ids)]))
        return sum(int(n) for n in self._run_many(scripts.mark_started, calls,
                                                  f"start marks of {len(leases)} leases of {owner}"))

    def claim_expired(self, limit: int | None = None, ids: Sequence[str] | None = None) -> list[Claim]:
        """Claim up to ``limit`` leases whose deadline passed (see claim_expired.lua).

        ``ids`` (of any shards) are claimed with one script call per shard.
        """
        if ids is None:
            ids = self.expired(limit or self.recover_batch)
        if not ids:
            return []
        calls = []
        for index, task_ids in self._by_shard(ids).items():
            shard = self.keys.shard(index)
            keys = [shard.deadlines, shard.stats]
            for t in task_ids:
                keys += [self.keys.record(t), self.keys.message(t)]
            calls.append((keys, [self.max_recoveries, _ms(self.publish_grace), _ms(self.retention),
                                 *task_ids]))
        rows = []
        for result in self._run_many(scripts.claim_expired, calls, f"{len(ids)} expired leases"):
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
                    f"message {self.keys.message(task_id)} of task {task_id} holds an envelope "
                    f"that is not JSON", self.keys.message(task_id), "envelope")
            if not isinstance(env, dict):
                env = {}
            claims.append(Claim(task_id, code, int(gen), int(recoveries),
                                name.decode("utf-8", "replace"), body, env, error))
        return claims

    def mark_published(self, claims: Iterable[Claim]) -> int:
        """Confirm re-published claims: the broker holds them from now on."""
        claims = list(claims)
        if not claims:
            return 0
        by_id = {c.task_id: c for c in claims}
        calls = []
        for index, task_ids in self._by_shard(c.task_id for c in claims).items():
            keys = [self.keys.shard(index).deadlines]
            args: list[Any] = [_ms(self.retention)]
            for t in task_ids:
                keys += [self.keys.record(t), self.keys.message(t)]
                args += [t, by_id[t].generation]
            calls.append((keys, args))
        confirmed = 0
        for reply in self._run_many(scripts.mark_published, calls, f"{len(claims)} claims"):
            if isinstance(reply, list):  # CORRUPT: the deadline index; claimed again, reported then
                logger.error("recovery: confirming claims: %s field %s %s", *(v.decode() for v in reply[1:4]))
                continue
            confirmed += int(reply)
        return confirmed

    def recover(self, publish: Callable[[Claim], None] | None = None,
                on_dead: Callable[[Claim], None] | None = None,
                limit: int | None = None,
                on_corrupt: Callable[[Claim], None] | None = None) -> RecoveryReport:
        """Run one recovery pass: claim expired leases, re-publish them, confirm.

        A publish that raises leaves its claim unconfirmed; the next pass after
        ``publish_grace`` claims it again. Stops after ``limit`` claims (default:
        until nothing is due). A corrupt record affects its own task only: the
        script took it out of the deadline index, and ``on_corrupt`` (the Celery
        side parks it) gets the claim, with the stored message if it was readable.
        """
        publish = publish or self.publish
        on_dead = on_dead or self.on_dead
        on_corrupt = on_corrupt or self.on_corrupt
        if publish is None:
            raise LeaseError("recover() needs a publish callable (celery_leases.store(app) provides one)")
        report = RecoveryReport()
        remaining = limit
        # Every round lists, claims and confirms on all shards with work left,
        # each step one pipelined round trip: with many shards a pass costs
        # about as many round trips as with one.
        pending = list(range(self.shards))
        while pending and (remaining is None or remaining > 0):
            batch = self.recover_batch if remaining is None else min(remaining, self.recover_batch)
            found = self._expired_by_shard(pending, batch)
            pending = [index for index, found_ids in found.items() if len(found_ids) >= batch]
            ids = [t for found_ids in found.values() for t in found_ids]
            if remaining is not None:
                ids = ids[:remaining]
            if not ids:
                break
            claims = self.claim_expired(ids=ids)
            published = []
            for claim in claims:
                if claim.code is Code.CORRUPT:
                    report.corrupt += 1
                    self._corrupt_claim(claim, on_corrupt)
                    continue
                if claim.error is not None and claim.code is Code.RECOVERED and on_corrupt is not None:
                    # Claimed, but its stored message cannot be re-published (an envelope
                    # that is not JSON): as permanent as a corrupt record, so parked and
                    # confirmed (out of the index) instead of failing every publish grace.
                    report.corrupt += 1
                    self._corrupt_claim(claim, on_corrupt)
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
                                 self.publish_grace, exc, exc_info=True)
            self.mark_published(published)
            if remaining is not None:
                remaining -= len(ids)
        return report

    # -- parking ------------------------------------------------------------

    def park(self, task_id: str, reason: str, *, name: str = "", body: bytes = b"",
             envelope: Mapping | None = None, key: str = "", field: str = "") -> None:
        """Keep a delivery that must not run (see park.lua); the lease record is not touched.

        ``key`` and ``field`` name what was corrupt, when the cause is a key.
        """
        keys = self.keys
        reply = self._run(
            scripts.park, (keys.parked, keys.parked_meta, keys.parked_body),
            (task_id, reason, name, body, _compact_json(dict(envelope)) if envelope else "", key, field,
             _ms(self.parked_retention), int(self.parked_cap)),
            f"parking task {task_id}")
        _raise_if_corrupt(reply, f"parking task {task_id}")
        if int(reply[1]):
            logger.warning("parking task %s dropped %d older parked deliveries of %s "
                           "(kept: %d at most, for %ss)", task_id, int(reply[1]), keys.parked,
                           self.parked_cap, self.parked_retention)

    def parked(self, limit: int = 100) -> list[Parked]:
        """Parked deliveries, oldest first (without their bodies: ``unpark`` returns those)."""
        keys = self.keys

        def read() -> list:
            ids: list[Any] = list(self.client.zrange(keys.parked, 0, int(limit) - 1))
            if not ids:
                return []
            return list(zip(ids, self.client.hmget(keys.parked_meta, ids)))

        out = []
        for task_id, meta in self._read(read, f"reading {keys.parked}"):
            if meta is not None:  # dropped between the two reads
                out.append(Parked.parse(task_id.decode("utf-8", "surrogateescape"), meta))
        return out

    def parked_entry(self, task_id: str) -> Parked | None:
        """``task_id``'s parked delivery without its body, or None (nothing is removed)."""
        meta = self._read(lambda: self.client.hget(self.keys.parked_meta, task_id),
                          f"reading {self.keys.parked_meta}")
        return None if meta is None else Parked.parse(task_id, meta)

    def unpark(self, task_id: str) -> Parked | None:
        """Remove ``task_id``'s parked delivery and return it with its body and envelope (None: none)."""
        keys = self.keys
        reply = self._run(scripts.unpark, (keys.parked, keys.parked_meta, keys.parked_body),
                          (task_id,), f"unparking task {task_id}")
        _raise_if_corrupt(reply, f"unparking task {task_id}")
        if Code(reply[0]) is Code.MISSING:
            return None
        return Parked.parse(task_id, reply[1], reply[2])

    def reset_record(self, task_id: str) -> bool:
        """Delete ``task_id``'s lease record, stored message and deadline entry (an operator's choice).

        For a corrupt record that keeps a parked delivery from running again
        (``celery leases replay --reset-record``): the next delivery starts a
        fresh record. Nothing is read, so a corrupt record of any type goes.
        True when there was a record.
        """
        key, shard = self.keys.record(task_id), self.keys.shard_for(task_id)

        def delete() -> list:
            # One slot (the task's shard tag); redis-py's cluster pipeline has no MULTI.
            pipe = self.client.pipeline(transaction=not hasattr(self.client, "get_node_from_key"))
            pipe.delete(key)
            pipe.delete(self.keys.message(task_id))
            pipe.zrem(shard.deadlines, task_id)
            return pipe.execute()

        return bool(self._read(delete, f"deleting {key} of task {task_id}")[0])

    def _corrupt_claim(self, claim: Claim, on_corrupt: Callable[[Claim], None] | None) -> None:
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

    def try_recovery_turn(self, owner: str, interval: float) -> bool:
        """True for one caller per ``interval`` across all workers (the fallback recoverer's guard)."""
        return bool(self._read(
            lambda: self.client.set(self.keys.recovery_guard, owner, nx=True, px=_ms(interval)),
            f"setting {self.keys.recovery_guard}"))

    def complete_step(self, task_id: str, owner: str, token: int, step: str) -> bool:
        """Record once-only ``step`` of ``task_id`` as done under the caller's lease.

        True when recorded now; False when it was already recorded (by this or
        an earlier owner). Raises LeaseLost when the caller no longer owns the
        lease, so a stale owner never marks a step done for its successor.
        """
        key = self.keys.record(task_id)
        reply = self._run(
            scripts.complete_step, (key,), (owner, int(token), step),
            f"task {task_id}, step {step!r}, key {key}")
        _raise_if_corrupt(reply, f"step {step!r} of task {task_id}")
        code = reply[0]
        if Code(code) is Code.STEP_DONE:
            return False
        _raise_unless_ok(Code(code), task_id, token)
        return True

    def completed_steps(self, task_id: str) -> dict[str, int]:
        """Once-only steps recorded for ``task_id``: step name -> token of the owner that recorded it."""
        key = self.keys.record(task_id)
        raw = self._read(lambda: self.client.hgetall(key), f"reading {key} of task {task_id}")
        try:
            return {k.decode()[5:]: int(v) for k, v in raw.items() if k.startswith(b"step:")}
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"steps of task {task_id} in {key} are corrupt: {exc!r}") from None

    # -- reads ---------------------------------------------------------------

    def get(self, task_id: str) -> LeaseRecord | None:
        """The lease record of ``task_id``, or None when there is none."""
        key = self.keys.record(task_id)

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.zscore(self.keys.shard_for(task_id).deadlines, task_id)
            pipe.exists(self.keys.message(task_id))
            return pipe.execute()

        raw, deadline, has_message = self._read(read, f"reading {key} of task {task_id}")
        if not raw:
            return None
        return LeaseRecord.parse(task_id, key, raw, int(deadline or 0), bool(has_message))

    def check(self, task_id: str, owner: str, token: int) -> None:
        """Raise LeaseLost unless ``owner`` with ``token`` still holds ``task_id``'s lease."""
        key = self.keys.record(task_id)
        state, current, current_owner = self._read(
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

        found = self._read(read, f"reading {shards[0].deadlines}" + (
            f" and {len(shards) - 1} more deadline indexes" if len(shards) > 1 else ""))
        rows = sorted(((int(s), t.decode()) for rows in found for t, s in rows))[:limit]
        return [(t, s) for s, t in rows]

    def expired(self, limit: int = 1000) -> list[str]:
        """Task ids whose deadline passed, by the server clock (up to ``limit``, of any shards)."""
        out: list[str] = []
        for ids in self._expired_by_shard(range(self.shards), limit).values():
            out += ids
        return out[:limit]

    def _expired_by_shard(self, shards: Iterable[int], limit: int) -> dict[int, list[str]]:
        """Up to ``limit`` expired task ids of each of ``shards`` (each by its own master's clock)."""
        shards = list(shards)
        calls = [((self.keys.shard(i).deadlines,), (int(limit),)) for i in shards]
        results = self._run_many(scripts.expired, calls, "listing expired leases")
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
        seconds, micros = self._read(read, "reading the server clock")
        return int(seconds) * 1000 + int(micros) // 1000

    def stats(self) -> dict[str, int]:
        """Lifetime counters of this prefix plus the number of leases in the index (summed over shards)."""
        shards = self.keys.all_shards()

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            for shard in shards:
                pipe.hgetall(shard.stats)
                pipe.zcard(shard.deadlines)
            return pipe.execute()

        rows = self._read(read, f"reading {shards[0].stats}" + (
            f" and {len(shards) - 1} more shards" if len(shards) > 1 else ""))
        out: dict[str, int] = {}
        indexed = 0
        for shard, raw, count in zip(shards, rows[::2], rows[1::2]):
            for k, v in raw.items():
                try:
                    out[k.decode()] = out.get(k.decode(), 0) + int(v)
                except ValueError:
                    # Counters are best effort in the scripts; reading them says so.
                    raise CorruptRecord(f"stats hash {shard.stats}: field {k.decode()} is not a "
                                        f"number: {v!r}", shard.stats, k.decode()) from None
            indexed += int(count)
        out["indexed"] = indexed
        return out

    def expire_now(self, task_id: str) -> bool:
        """Make ``task_id``'s lease due now, as if its ttl had run out (a test helper).

        Scores the lease at the server's now in the deadline index, and only a
        lease already there (``ZADD XX``: active or recovering); False when it
        is not. The record is not touched: whoever acts on the due lease (a
        recovery pass, a redelivered copy) re-checks it in its own script, as
        for any expiry, so no Lua is needed. Not atomic with the owner's
        heartbeat: an owner that still renews pushes the deadline back at its
        next tick (``celery_leases.testing.make_stale`` expires and claims).
        """
        deadlines = self.keys.shard_for(task_id).deadlines
        now = self.server_time_ms(deadlines)

        def rescore() -> list:
            pipe = self.client.pipeline(transaction=True)
            pipe.zadd(deadlines, {task_id: now}, xx=True)
            pipe.zscore(deadlines, task_id)
            return pipe.execute()

        _, score = self._read(rescore, f"rescoring {task_id} in {deadlines}")
        return score is not None

    def other_layout(self) -> tuple[int, int] | None:
        """(shard count, leases indexed) of another layout of this prefix still holding live leases.

        Changing leases_shards moves every task to other key names: leases
        written under the old count are no longer renewed, recovered or
        refused by the new one. This looks at the layout last recorded by a
        sharded store (``Keys.layout``) and, for a sharded store, at the
        one-shard layout; it records this store's count once no other layout
        holds live leases. None when nothing is stranded.
        """
        marker = self._read(lambda: self.client.get(self.keys.layout), f"reading {self.keys.layout}")
        previous = int(marker) if marker and marker.isdigit() else None
        candidates = {previous} if previous and previous != self.shards else set()
        if self.shards > 1:
            candidates.add(1)
        for count in sorted(c for c in candidates if c):
            keys = Keys(self.keys.prefix, count).all_shards()

            def read(keys: list[ShardKeys] = keys) -> list:
                pipe = self.client.pipeline(transaction=False)
                for shard in keys:
                    pipe.zcard(shard.deadlines)
                return pipe.execute()

            indexed = sum(int(n) for n in self._read(read, f"reading the deadline indexes of {count} shards"))
            if indexed:
                return count, indexed
        if previous != self.shards:
            if self.shards > 1:
                self._read(lambda: self.client.set(self.keys.layout, self.shards), f"setting {self.keys.layout}")
            elif previous is not None:
                self._read(lambda: self.client.delete(self.keys.layout), f"deleting {self.keys.layout}")
        return None

    # -- inspection and maintenance (the operators' CLI) ----------------------

    def records(self, task_ids: Iterable[str], *, skip_corrupt: bool = False) -> list[LeaseRecord]:
        """The records of ``task_ids`` in that order, without their stored messages.

        Missing records are left out; one pipelined round trip for all of them.
        A corrupt record raises CorruptRecord, or is logged and left out with
        ``skip_corrupt``.
        """
        task_ids = list(task_ids)
        if not task_ids:
            return []
        keys = [self.keys.record(t) for t in task_ids]
        fields = ("state", "owner", "name", "started", *_INT_FIELDS, *(f"h:{n}" for n in range(16)))

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key, task_id in zip(keys, task_ids):
                pipe.hmget(key, fields)
                pipe.exists(self.keys.message(task_id))
                pipe.zscore(self.keys.shard_for(task_id).deadlines, task_id)
            return pipe.execute(raise_on_error=False)

        rows = self._read(read, f"reading {len(keys)} lease records")
        out = []
        for i, (key, task_id) in enumerate(zip(keys, task_ids)):
            values, has_message, deadline = rows[3 * i:3 * i + 3]
            try:
                for value in (values, has_message, deadline):
                    if isinstance(value, Exception):  # e.g. WRONGTYPE: not a hash
                        error = lease_error(value, f"reading lease record {key} of task {task_id}",
                                            self.description)
                        raise error from value
                if values[0] is None:  # gone (expired or purged) since it was listed
                    continue
                raw = {f.encode(): v for f, v in zip(fields, values) if v is not None}
                out.append(LeaseRecord.parse(task_id, key, raw, int(deadline or 0), bool(has_message)))
            except CorruptRecord as exc:
                if not skip_corrupt:
                    raise
                logger.warning("skipping a corrupt lease record: %s", exc)
        return out

    def scan(self, state: str | None = None, count: int = 500,
             limit: int | None = None) -> list[LeaseRecord]:
        """Lease records of this prefix (only those in ``state`` if given), in no particular order.

        Walks the database with ``SCAN MATCH <record prefix>*`` (``count`` is
        SCAN's batch hint), so its cost grows with the number of keys in the
        database: for operators, never on a hot path. Live leases are listed
        cheaply from the deadline index (``active``). Corrupt records are
        logged and skipped. Stops after ``limit`` matching records.
        """
        out: list[LeaseRecord] = []
        for batch in self._scan_record_keys(count):
            for record in self.records([t for _, t in batch], skip_corrupt=True):
                if state is not None and record.state != state:
                    continue
                out.append(record)
                if limit is not None and len(out) >= limit:
                    return out
        return out

    def purge(self, older_than: float = 0.0, *, dry_run: bool = False, count: int = 500) -> int:
        """Delete finished records (succeeded, failed, revoked, dead) at least ``older_than`` seconds old.

        Never deletes an active or recovering record (purge.lua checks and
        deletes atomically). Ages are measured on the Redis server's clock.
        ``dry_run`` only counts. Returns the number of records deleted (or
        that would be). A purged record no longer refuses late duplicates of
        its task: purge only what is older than any duplicate can be.
        """
        if dry_run:
            cutoff = self.server_time_ms() - _ms(older_than)
            return sum(1 for r in self.scan(count=count)
                       if r.state in TERMINAL_STATES and r.finished_at <= cutoff)
        purged = 0
        for batch in self._scan_record_keys(count):
            calls = []
            for index, task_ids in self._by_shard(t for _, t in batch).items():
                calls.append(([self.keys.shard(index).deadlines, *map(self.keys.record, task_ids)],
                              [_ms(older_than), *task_ids]))
            for reply in self._run_many(scripts.purge, calls, f"{len(batch)} records"):
                if reply[0] == Code.CORRUPT:
                    logger.error("purge: %s field %s %s; its records are left alone",
                                 *(v.decode() for v in reply[1:4]))
                    continue
                purged += int(reply[1])
                for task_id, what in zip(reply[2::2], reply[3::2]):
                    logger.warning("purge: left corrupt record %s alone: field %s",
                                   self.keys.record(task_id.decode()), what.decode())
        return purged

    def held_for(self, task_id: str) -> float | None:
        """Seconds since the current or last owner of ``task_id`` acquired it, by the server clock.

        None when there is no record (or it was never acquired).
        """
        key = self.keys.record(task_id)
        acquired_at = self._read(lambda: self.client.hget(key, "acquired_at"),
                                 f"reading {key} of task {task_id}")
        if not acquired_at:
            return None
        return max(0.0, (self.server_time_ms(key) - int(acquired_at)) / 1000.0)

    def _scan_record_keys(self, count: int) -> Iterable[list[tuple[str, str]]]:
        """Batches of (record key, task id) found by SCAN MATCH on the record prefix.

        One pattern covers every shard; on a cluster each master is scanned.
        Keys of another prefix or shard count that the pattern also matches
        are left out.
        """
        if self.shards == 1:
            match = _glob_escape(self.keys.record_prefix()) + "*"
        else:
            match = _glob_escape("{" + self.keys.prefix + ":") + "[0-9]*}:lease:*"
        nodes = self.client.get_primaries() if hasattr(self.client, "get_primaries") else [None]
        for node in nodes:
            target = {} if node is None else {"target_nodes": node}
            cursor = 0
            while True:
                cursor, keys = self._read(
                    lambda: self._scan_one(cursor, match, count, target), f"scanning {match}")
                batch = [parsed for parsed in map(self._parse_record_key, keys) if parsed]
                if batch:
                    yield batch
                if int(cursor) == 0:
                    break

    def _scan_one(self, cursor: int, match: str, count: int, target: dict) -> tuple[int, list]:
        cursor_out, keys = self.client.scan(cursor, match=match, count=count, **target)
        if isinstance(cursor_out, dict):  # RedisCluster answers per node
            (cursor_out,) = cursor_out.values()
        return cursor_out, keys

    def _parse_record_key(self, key: Any) -> tuple[str, str] | None:
        """(key, task id) when ``key`` is a record key of this store's layout, else None."""
        key = key.decode() if isinstance(key, bytes) else key
        if self.shards == 1:
            return key, key[len(self.keys.record_prefix()):]
        tag, sep, task_id = key.partition("}:lease:")
        if not sep:
            return None
        index = tag[len(self.keys.prefix) + 2:]
        if not index.isdigit() or int(index) >= self.shards or self.keys.shard_of(task_id) != int(index):
            return None
        return key, task_id


#: One encoder for every stored envelope: json.dumps with separators builds a new one per call.
_compact_json = json.JSONEncoder(separators=(",", ":")).encode


def acquisition_of(raw: Sequence[Any]) -> Acquisition:
    """acquire.lua's reply as an Acquisition; a CORRUPT answer raises CorruptRecord naming key and field."""
    _raise_if_corrupt(raw, "acquire")
    code, token, gen, recoveries, state = raw
    return Acquisition(Code(code), int(token), int(gen), int(recoveries), state.decode())


def _raise_if_corrupt(reply: Any, what: str) -> None:
    """A script's CORRUPT answer {CORRUPT, key, field, detail} as CorruptRecord naming key and field."""
    if isinstance(reply, list) and reply and reply[0] == Code.CORRUPT:
        key, fld, detail = (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                            for v in reply[1:4])
        raise CorruptRecord(f"{what}: {key} field {fld} {detail}; nothing was written", key, fld)


def _raise_unless_ok(code: Code, task_id: str, token: int, state: str = "") -> None:
    """The one place a refused transition becomes an exception."""
    if code is Code.OK:
        return
    reason = {Code.LOST: "lost", Code.FINISHED: f"already finished ({state})" if state else "finished",
              Code.MISSING: "missing",
              Code.LATE: "late: the finish reached the store after its not-after moment"}.get(
        code, code.name.lower())
    raise LeaseLost(task_id, token, reason)


def _redirected(error: Exception) -> bool:
    """True for a cluster's "ask that other node" answers (the slot moved, a failover)."""
    text = str(error)
    return text.startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")) or \
        type(error).__name__ in ("MovedError", "AskError", "TryAgainError", "ClusterDownError",
                                 "MasterDownError")


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
