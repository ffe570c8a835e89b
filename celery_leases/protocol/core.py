"""What every part of the store shares: the client, its key names, the script runner, the settings.

``StoreCore`` is the bottom of the store: the recovery pass (recovery.py), the
heartbeat's transitions (renewals.py), the operators' tools (admin.py), kept
results (unwritten.py) and publish tracking (queued/) take one and never the
``LeaseStore`` built on it (store.py), so imports point one way: store.py
imports them, they import this. It also holds the plain reads (no script) that
they and the store's callers share: a record, the deadline indexes, the server
clock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Iterable

import redis

from .. import defaults
from ..exceptions import CorruptRecord, LeaseLost
from .calls import ScriptCalls
from .codes import Code
from .connection import describe
from .keys import Keys, usable_id
from .records import LeaseRecord
from .scripts import scripts

__all__ = ["StoreSettings", "StoreCore", "one_task", "PARKED_RETENTION", "PARKED_CAP"]

logger = logging.getLogger("celery_leases.store")

#: Parked entries are kept this long (seconds) and at most this many: an operator
#: has a week to look, and a flood of bad deliveries cannot fill the server.
PARKED_RETENTION = 7 * 86400.0
PARKED_CAP = 10_000


def one_task(task_id: Any) -> str:
    """``task_id``, or TypeError naming it when no record can have it (not a non-empty UTF-8
    str). Checked where a caller names one task; ids read back from the store's own indexes
    are not (a corrupt member is the scripts' to report, and must not stop a recovery pass)."""
    if not usable_id(task_id):
        raise TypeError(f"task id {task_id!r}: not a non-empty UTF-8 str; no lease record can have it")
    return task_id


@dataclass(frozen=True)
class StoreSettings:
    """The numbers a store runs with; seconds unless named otherwise (docs/configuration.md)."""

    #: Seconds a lease lives without a renewal (an acquire may name its own).
    ttl: float = defaults.TTL
    #: Seconds a finished record is kept, so a late duplicate delivery is recognised.
    retention: float = defaults.RETENTION
    #: Recoveries allowed before a task is declared dead (an acquire may name its own).
    max_recoveries: int = defaults.MAX_RECOVERIES
    #: Seconds a recovery claim waits for its re-publish to be confirmed before it is claimed again.
    publish_grace: float = defaults.PUBLISH_GRACE
    #: Leases claimed per recovery script call.
    recover_batch: int = defaults.RECOVER_BATCH
    #: Hash tags the records and deadline indexes are spread over (leases_shards, keys.py).
    shards: int = 1
    #: Seconds a parked delivery is kept, and how many are kept at most.
    parked_retention: float = PARKED_RETENTION
    parked_cap: int = PARKED_CAP
    #: leases_delivery_timeout when publish tracking is on for this store, else 0: a confirmed
    #: re-publish and a retry hand-over then wait in the queued index, so a copy the broker
    #: loses is re-published (mark_published.lua, hand_over.lua). Set by queued.QueuedTasks.
    delivery_timeout: float = 0.0
    #: Whether tokens are ordered by the server clock (acquire.lua ARGV[12]); None: decided from
    #: the client, True when sharded or on a cluster. With one sequence per shard, tokens of
    #: different shards are ordered by the clock; on a cluster, a failover that loses the last
    #: INCR of a sequence then cannot hand out a token again (docs/cluster.md).
    clock_tokens: bool | None = None


#: StoreSettings' fields, read through the store (``store.ttl``) and never assigned on it.
_SETTING_NAMES = frozenset(field.name for field in fields(StoreSettings)) - {"clock_tokens", "shards"}


class StoreCore:
    """One key prefix on one Redis (a server, or a Redis Cluster): client, keys, calls, settings.

    Every script call and read goes through ``calls`` (calls.py). The numbers have one
    home, ``settings`` (``core.settings.ttl``); StoreSettings is frozen, so a change
    replaces it (``dataclasses.replace``, as queued.py does for ``delivery_timeout``).
    """

    def __init__(self, client: redis.Redis, prefix: str = defaults.KEY_PREFIX,
                 settings: StoreSettings | None = None, description: str | None = None) -> None:
        settings = settings or StoreSettings()
        self.client = client
        self.keys = Keys(prefix, settings.shards)
        self.shards = self.keys.shards
        self.settings = settings
        self.description = description or describe(client)
        self.calls = ScriptCalls(client, self.description)
        self.cluster = self.calls.cluster

    def __getattr__(self, name: str) -> Any:
        # ``store.ttl`` and the other settings read from their one home, ``settings``.
        if name in _SETTING_NAMES:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTING_NAMES:  # an assignment would shadow the setting, never change it
            raise AttributeError(f"{name} is a setting of the store: replace store.settings "
                                 f"(dataclasses.replace(store.settings, {name}=...))")
        super().__setattr__(name, value)

    @property
    def clock_tokens(self) -> int:
        """1 when tokens are ordered by the server clock (acquire.lua's ARGV), else 0."""
        chosen = self.settings.clock_tokens
        if chosen is None:
            return 1 if self.shards > 1 or self.cluster else 0
        return 1 if chosen else 0

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

    def completed_steps(self, task_id: str) -> dict[str, int]:
        """Once-only steps recorded for ``task_id``: step name -> token of the owner that recorded it."""
        key = self.keys.record(one_task(task_id))
        raw = self.calls.read(lambda: self.client.hgetall(key), f"reading {key} of task {task_id}")
        try:
            return {k.decode()[5:]: int(v) for k, v in raw.items() if k.startswith(b"step:")}
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"steps of task {task_id} in {key} are corrupt: {exc!r}") from None

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
