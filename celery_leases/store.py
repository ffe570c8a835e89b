"""The lease store: every ownership change of a task is one atomic Lua script.

Knows nothing of Celery. The Celery wiring hands it opaque message bodies and
envelopes to keep for recovery, and a ``publish`` callable to put them back.
"""
from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .codes import OUTCOMES, TERMINAL_STATES, Code
from .connection import connect, describe
from .exceptions import CorruptRecord, LeaseError, LeaseLost, LeaseUnavailable
from .keys import Keys
from .scripts import Script, scripts

__all__ = ["LeaseStore", "LeaseRecord", "Acquisition", "Claim", "RecoveryReport"]

logger = logging.getLogger("celery_leases.store")

_INT_FIELDS = ("token", "ttl", "generation", "recoveries", "attempt",
               "progress_timeout", "progress_deadline", "acquired_at", "finished_at")


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
    #: (token, owner, acquired_at) of the last owners, oldest first.
    history: tuple = ()
    has_message: bool = False

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
                                    f"number: {data[name]!r}") from None
        try:
            state = data["state"].decode()
        except (KeyError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"lease record {key} of task {task_id}: field state is "
                                f"missing or unreadable: {exc!r}") from None
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
                   has_message=has_message, **values)


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
    errors: list = field(default_factory=list)

    def __iadd__(self, other: "RecoveryReport") -> "RecoveryReport":
        self.recovered += other.recovered
        self.dead += other.dead
        self.publish_failed += other.publish_failed
        self.errors.extend(other.errors)
        return self

    def as_dict(self) -> dict:
        return {"recovered": self.recovered, "dead": self.dead,
                "publish_failed": self.publish_failed}


def _ms(seconds: float) -> int:
    return max(0, int(round(seconds * 1000)))


class LeaseStore:
    """Leases of one key prefix on one Redis.

    ``ttl``, ``retention`` and ``publish_grace`` are seconds. ``publish`` and
    ``on_dead`` are what a recovery pass does with a claimed lease; the Celery
    wiring provides them.
    """

    def __init__(self, client: redis.Redis, prefix: str = "leases", *,
                 ttl: float = 30.0, retention: float = 86400.0,
                 max_recoveries: int = 3, publish_grace: float = 60.0,
                 recover_batch: int = 500,
                 publish: Callable[[Claim], None] | None = None,
                 on_dead: Callable[[Claim], None] | None = None,
                 description: str | None = None) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.ttl, self.retention = ttl, retention
        self.max_recoveries, self.publish_grace = max_recoveries, publish_grace
        self.recover_batch = recover_batch
        self.publish, self.on_dead = publish, on_dead
        self.description = description or describe(client)

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
            return script(self.client, keys, args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise LeaseUnavailable(
                f"lease store at {self.description} unreachable during {script.name} "
                f"({what}): {exc}") from exc
        except ResponseError as exc:
            text = str(exc)
            if "CORRUPT" in text or "WRONGTYPE" in text:
                raise CorruptRecord(f"{script.name} ({what}): {text}") from exc
            raise LeaseError(f"{script.name} ({what}) failed on {self.description}: {text}") from exc

    def _read(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise LeaseUnavailable(f"lease store at {self.description} unreachable ({what}): {exc}") from exc
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise CorruptRecord(f"{what}: {exc}") from exc
            raise LeaseError(f"{what} failed on {self.description}: {exc}") from exc

    # -- transitions ---------------------------------------------------------

    def acquire(self, task_id: str, owner: str, *, ttl: float | None = None,
                generation: int = 0, attempt: int = 0, max_recoveries: int | None = None,
                progress_timeout: float = 0, name: str = "", body: bytes = b"",
                envelope: Mapping | None = None) -> Acquisition:
        """Try to become the owner of ``task_id``'s lease for one delivery of its message."""
        key = self.keys.record(task_id)
        code, token, gen, recoveries, state = self._run(
            scripts.acquire,
            (key, self.keys.deadlines, self.keys.sequence, self.keys.stats, self.keys.message(task_id)),
            (task_id, owner, _ms(self.ttl if ttl is None else ttl), int(generation), int(attempt),
             self.max_recoveries if max_recoveries is None else int(max_recoveries),
             _ms(progress_timeout), name, body,
             json.dumps(envelope, separators=(",", ":")) if envelope is not None else "",
             _ms(self.retention)),
            f"task {task_id}, key {key}")
        return Acquisition(Code(code), int(token), int(gen), int(recoveries), state.decode())

    def finish(self, task_id: str, owner: str, token: int, outcome: str,
               *, next_attempt: int = 0, retry_grace: float | None = None,
               write: tuple[str, bytes | str, int] | None = None) -> None:
        """Record the owner's outcome; raises LeaseLost when the caller is not the owner.

        ``retry`` hands the lease to attempt ``next_attempt``, which must acquire
        within ``retry_grace`` seconds (default: publish_grace) or be recovered.
        ``write`` = (key, value, expires seconds or 0), with a terminal outcome:
        also SET ``key`` and PUBLISH ``value`` on the channel ``key`` in the same
        script, so an accepted outcome and its result record land together and
        a refused one writes neither (``key`` must live on the same server).
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"finish: unknown outcome {outcome!r} for task {task_id}; "
                             f"expected one of {OUTCOMES}")
        key = self.keys.record(task_id)
        keys = [key, self.keys.deadlines, self.keys.stats, self.keys.message(task_id)]
        args = [task_id, owner, int(token), outcome, _ms(self.retention), int(next_attempt),
                _ms(self.publish_grace if retry_grace is None else retry_grace)]
        if write is not None:
            if outcome == "retry":
                raise ValueError(f"finish: task {task_id}: a retry hand-over writes no result")
            keys.append(write[0])
            args.extend((write[1], int(write[2] or 0)))
        code, current, state = self._run(scripts.finish, keys, args, f"task {task_id}, key {key}")
        _raise_unless_ok(Code(code), task_id, token, state.decode())

    def renew_many(self, owner: str, leases: Mapping[str, int], *, ttl: float | None = None,
                   check_progress: bool = False) -> dict[str, Code]:
        """Renew leases ``owner`` holds, all with the same ``ttl``, in one call.

        Returns the leases not renewed, with why. ``check_progress`` enforces
        progress deadlines (leases of tasks with a progress timeout).
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
            record = self.keys.record
            keys = [self.keys.deadlines, self.keys.stats, *map(record, leases)]
            args = [owner, _ms(self.ttl if ttl is None else ttl), 1 if check_progress else 0,
                    len(self.keys.record_prefix()), *leases.values()]
            flat = self._run(scripts.renew_many, keys, args, f"{len(leases)} leases of {owner}")
            return {flat[i].decode(): Code(flat[i + 1]) for i in range(0, len(flat), 2)}
        finally:
            if pause_gc:
                gc.enable()

    def progress(self, task_id: str, owner: str, token: int) -> None:
        """Report progress of the running body; raises LeaseLost when no longer the owner."""
        key = self.keys.record(task_id)
        (code,) = self._run(scripts.progress, (key, self.keys.deadlines),
                            (task_id, owner, int(token)), f"task {task_id}, key {key}")
        _raise_unless_ok(Code(code), task_id, token)

    def release(self, owner: str, leases: Mapping[str, int], *, unstarted: bool = False) -> int:
        """Make these leases due now so they are recovered without waiting out the ttl.

        ``unstarted`` marks leases whose task never ran (a warm shutdown's
        prefetched messages): taking them over then counts no recovery.
        """
        if not leases:
            return 0
        keys = [self.keys.deadlines]
        args: list[Any] = [owner, 1 if unstarted else 0]
        for task_id, token in leases.items():
            keys.append(self.keys.record(task_id))
            args += [task_id, int(token)]
        return int(self._run(scripts.release, keys, args, f"{len(leases)} leases of {owner}"))

    def claim_expired(self, limit: int | None = None, ids: Sequence[str] | None = None) -> list[Claim]:
        """Claim up to ``limit`` leases whose deadline passed (see claim_expired.lua)."""
        if ids is None:
            ids = self.expired(limit or self.recover_batch)
        if not ids:
            return []
        keys = [self.keys.deadlines, self.keys.stats]
        for t in ids:
            keys += [self.keys.record(t), self.keys.message(t)]
        rows = self._run(scripts.claim_expired, keys,
                         [self.max_recoveries, _ms(self.publish_grace), _ms(self.retention), *ids],
                         f"{len(ids)} expired leases")
        claims = []
        for task_id, code, gen, recoveries, name, body, envelope in rows:
            task_id = task_id.decode()
            error = None
            try:
                env = json.loads(envelope) if envelope else {}
            except ValueError:
                # Reported by the recovery pass; the rest of the batch goes on.
                env = {}
                error = CorruptRecord(f"message {self.keys.message(task_id)} of task {task_id} "
                                      f"holds an envelope that is not JSON")
            claims.append(Claim(task_id, Code(code), int(gen), int(recoveries),
                                name.decode(), body, env, error))
        return claims

    def mark_published(self, claims: Iterable[Claim]) -> int:
        """Confirm re-published claims: the broker holds them from now on."""
        claims = list(claims)
        if not claims:
            return 0
        keys = [self.keys.deadlines]
        for c in claims:
            keys += [self.keys.record(c.task_id), self.keys.message(c.task_id)]
        args: list[Any] = [_ms(self.retention)]
        for c in claims:
            args += [c.task_id, c.generation]
        return int(self._run(scripts.mark_published, keys, args, f"{len(claims)} claims"))

    def recover(self, publish: Callable[[Claim], None] | None = None,
                on_dead: Callable[[Claim], None] | None = None,
                limit: int | None = None) -> RecoveryReport:
        """Run one recovery pass: claim expired leases, re-publish them, confirm.

        A publish that raises leaves its claim unconfirmed; the next pass after
        ``publish_grace`` claims it again. Stops after ``limit`` claims (default:
        until nothing is due).
        """
        publish = publish or self.publish
        on_dead = on_dead or self.on_dead
        if publish is None:
            raise LeaseError("recover() needs a publish callable (celery_leases.store(app) provides one)")
        report = RecoveryReport()
        remaining = limit
        while remaining is None or remaining > 0:
            batch = self.recover_batch if remaining is None else min(remaining, self.recover_batch)
            ids = self.expired(batch)
            if not ids:
                break
            claims = self.claim_expired(ids=ids)
            published = []
            for claim in claims:
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
            if len(ids) < batch:
                break
        return report

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
        code, _recorded_by = self._run(
            scripts.complete_step, (key,), (owner, int(token), step),
            f"task {task_id}, step {step!r}, key {key}")
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
            pipe.zscore(self.keys.deadlines, task_id)
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
        """(task id, deadline ms) of leases in the deadline index, soonest first."""
        rows = self._read(lambda: self.client.zrange(self.keys.deadlines, 0, limit - 1, withscores=True),
                          f"reading {self.keys.deadlines}")
        return [(t.decode(), int(s)) for t, s in rows]

    def expired(self, limit: int = 1000) -> list[str]:
        """Task ids whose deadline passed, by the server clock."""
        rows = self._run(scripts.expired, (self.keys.deadlines,), (int(limit),), "listing expired leases")
        return [t.decode() for t in rows[1:]]

    def server_time_ms(self) -> int:
        seconds, micros = self._read(self.client.time, "reading the server clock")
        return int(seconds) * 1000 + int(micros) // 1000

    def stats(self) -> dict[str, int]:
        """Lifetime counters of this prefix plus the number of leases in the index."""
        raw = self._read(lambda: self.client.hgetall(self.keys.stats), f"reading {self.keys.stats}")
        out = {k.decode(): int(v) for k, v in raw.items()}
        out["indexed"] = int(self._read(lambda: self.client.zcard(self.keys.deadlines),
                                        f"reading {self.keys.deadlines}"))
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
        now = self.server_time_ms()

        def rescore() -> list:
            pipe = self.client.pipeline(transaction=True)
            pipe.zadd(self.keys.deadlines, {task_id: now}, xx=True)
            pipe.zscore(self.keys.deadlines, task_id)
            return pipe.execute()

        _, score = self._read(rescore, f"rescoring {task_id} in {self.keys.deadlines}")
        return score is not None

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
        fields = ("state", "owner", "name", *_INT_FIELDS, *(f"h:{n}" for n in range(16)))

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key, task_id in zip(keys, task_ids):
                pipe.hmget(key, fields)
                pipe.exists(self.keys.message(task_id))
                pipe.zscore(self.keys.deadlines, task_id)
            return pipe.execute(raise_on_error=False)

        rows = self._read(read, f"reading {len(keys)} lease records")
        out = []
        for i, (key, task_id) in enumerate(zip(keys, task_ids)):
            values, has_message, deadline = rows[3 * i:3 * i + 3]
            try:
                for value in (values, has_message, deadline):
                    if isinstance(value, ResponseError):  # e.g. WRONGTYPE: not a hash
                        raise CorruptRecord(f"lease record {key} of task {task_id}: {value}")
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
        start = len(self.keys.record_prefix())
        for keys in self._scan_record_keys(count):
            for record in self.records([k[start:] for k in keys], skip_corrupt=True):
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
        start = len(self.keys.record_prefix())
        for keys in self._scan_record_keys(count):
            _, n = self._run(scripts.purge, [self.keys.deadlines, *keys],
                             [_ms(older_than), *(k[start:] for k in keys)],
                             f"{len(keys)} records")
            purged += int(n)
        return purged

    def held_for(self, task_id: str) -> float | None:
        """Seconds since the current or last owner of ``task_id`` acquired it, by the server clock.

        None when there is no record (or it was never acquired).
        """
        key = self.keys.record(task_id)

        def read() -> list:
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(key, "acquired_at")
            pipe.time()
            return pipe.execute()

        acquired_at, (seconds, micros) = self._read(read, f"reading {key} of task {task_id}")
        if not acquired_at:
            return None
        return max(0.0, (int(seconds) * 1000 + int(micros) // 1000 - int(acquired_at)) / 1000.0)

    def _scan_record_keys(self, count: int) -> Iterable[list[str]]:
        """Batches of record key names (str) found by SCAN MATCH on the record prefix."""
        match = _glob_escape(self.keys.record_prefix()) + "*"
        cursor = 0
        while True:
            cursor, keys = self._read(
                lambda: self.client.scan(cursor, match=match, count=count),
                f"scanning {match}")
            if keys:
                yield [k.decode() if isinstance(k, bytes) else k for k in keys]
            if int(cursor) == 0:
                return


def _raise_unless_ok(code: Code, task_id: str, token: int, state: str = "") -> None:
    """The one place a refused transition becomes an exception."""
    if code is Code.OK:
        return
    reason = {Code.LOST: "lost", Code.FINISHED: f"already finished ({state})" if state else "finished",
              Code.MISSING: "missing"}.get(code, code.name.lower())
    raise LeaseLost(task_id, token, reason)


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
