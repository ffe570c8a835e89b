"""Redis key names, and which shard (hash tag, so which cluster slot) each lives in.

With one shard (the default) every key of a prefix carries the tag
``{<prefix>}``: one Redis Cluster slot holds everything, and the names are
those of every earlier release. With ``shards=N > 1`` a task id is mapped to a
shard by ``crc32(task id) % N``, and that task's record and message, and the
shard's deadline index, token sequence and stats, carry the tag
``{<prefix>:<shard>}``, so the shards spread over a cluster's slots (and
masters). Fence hashes and the recovery guard keep ``{<prefix>}``: they are
not per task. Every script still touches one slot: the keys of one task and
of its shard.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable


def usable_id(task_id: Any) -> bool:
    """True for an id that can be a Redis key and travel in RESP: a non-empty UTF-8 string."""
    if not isinstance(task_id, str) or not task_id:
        return False
    if task_id.isascii():  # O(1) in CPython: the common case, no encode
        return True
    try:
        task_id.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: Redis keys and RESP need real UTF-8
        return False
    return True


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard that are not per task."""

    #: Shard number, 0..shards-1.
    index: int
    #: Hash tag of this shard's keys, braces included.
    tag: str

    @property
    def deadlines(self) -> str:
        """Sorted set: task id -> deadline (ms, server clock) of this shard's active/recovering leases."""
        return f"{self.tag}:deadlines"

    @property
    def queued(self) -> str:
        """Sorted set: task id -> due + leases_delivery_timeout (ms) of this shard's queued tasks."""
        return f"{self.tag}:queued"

    @property
    def unwritten(self) -> str:
        """Sorted set: task id -> when (ms) recovery writes the result this shard keeps for it.

        An accepted outcome whose result Celery writes after the finish keeps that
        result here until the writing process confirms it (unwritten.py)."""
        return f"{self.tag}:unwritten"

    @property
    def unwritten_results(self) -> str:
        """Hash: task id -> the kept result (unwritten.py) of this shard's tasks in ``unwritten``."""
        return f"{self.tag}:unwritten:results"

    @property
    def sequence(self) -> str:
        """Counter this shard's fencing tokens are drawn from."""
        return f"{self.tag}:seq"

    @property
    def stats(self) -> str:
        """Hash of this shard's lifetime counters (acquired, recovered, refused, ...)."""
        return f"{self.tag}:stats"

    def record_prefix(self) -> str:
        """Name of this shard's record keys without the task id."""
        return f"{self.tag}:lease:"


@dataclass(frozen=True)
class Keys:
    prefix: str = "leases"
    #: Number of shards (leases_shards); 1 keeps every name in one slot.
    shards: int = 1
    _shard_keys: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (not isinstance(self.prefix, str) or not self.prefix
                or any(c.isspace() or c in "{}" or not c.isprintable() for c in self.prefix)):
            raise ValueError(
                f"leases_key_prefix must be a non-empty string without whitespace, braces or "
                f"control characters, got {self.prefix!r}")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"leases_shards must be an integer >= 1, got {self.shards!r}")
        # Built once: every acquire, renew and finish looks its shard up.
        tags = [self.tag] if self.shards == 1 else ["{" + f"{self.prefix}:{i}" + "}" for i in range(self.shards)]
        object.__setattr__(self, "_shard_keys", tuple(ShardKeys(i, tag) for i, tag in enumerate(tags)))

    @property
    def tag(self) -> str:
        """The prefix's own tag: fences, the recovery guard (and everything with one shard)."""
        return "{" + self.prefix + "}"

    # -- shards ------------------------------------------------------------

    def shard_of(self, task_id: str) -> int:
        """The shard of ``task_id``: stable across processes, releases and machines."""
        if self.shards == 1:
            return 0
        return zlib.crc32(task_id.encode("utf-8", "surrogatepass")) % self.shards

    def shard(self, index: int) -> ShardKeys:
        """The keys of shard ``index``."""
        return self._shard_keys[0 if self.shards == 1 else index]

    def all_shards(self) -> list[ShardKeys]:
        return list(self._shard_keys)

    def by_shard(self, task_ids: Iterable[str]) -> dict[int, list[str]]:
        """``task_ids`` grouped by shard index, in their order within each shard."""
        groups: dict[int, list[str]] = {}
        shard_of = self.shard_of
        for task_id in task_ids:
            groups.setdefault(shard_of(task_id), []).append(task_id)
        return groups

    def shard_for(self, task_id: str) -> ShardKeys:
        """The shard keys that go with ``task_id``'s record in one script call."""
        return self.shard(self.shard_of(task_id))

    # -- per task ----------------------------------------------------------

    def record(self, task_id: str) -> str:
        """Hash holding one task's lease record."""
        return f"{self.shard_for(task_id).tag}:lease:{task_id}"

    def message(self, task_id: str) -> str:
        """Hash holding the message a recovery would re-publish (body, envelope).

        Kept apart from the record so the record stays small enough for
        Redis's compact hash encoding, and is deleted when the task finishes.
        """
        return f"{self.shard_for(task_id).tag}:msg:{task_id}"

    def spans(self, task_id: str) -> str:
        """Hash of the trace context of each run of a task, by token (celery_leases.tracing):
        written only with tracing enabled, expiring after leases_retention."""
        return f"{self.shard_for(task_id).tag}:spans:{task_id}"

    # -- shard 0 (the only shard with shards=1) -------------------------------

    @property
    def deadlines(self) -> str:
        """Deadline index of shard 0 (see ShardKeys.deadlines); the only one with one shard."""
        return self.shard(0).deadlines

    @property
    def sequence(self) -> str:
        """Token counter of shard 0 (see ShardKeys.sequence)."""
        return self.shard(0).sequence

    @property
    def stats(self) -> str:
        """Counters of shard 0 (see ShardKeys.stats)."""
        return self.shard(0).stats

    def record_prefix(self) -> str:
        """Record key prefix of shard 0 (see ShardKeys.record_prefix)."""
        return self.shard(0).record_prefix()

    # -- not sharded ---------------------------------------------------------

    @property
    def recovery_guard(self) -> str:
        """String key held by the worker whose turn it is to run a recovery pass."""
        return f"{self.tag}:recovery-guard"

    @property
    def layout(self) -> str:
        """String key holding the shard count a sharded store was last used with."""
        return f"{self.tag}:shards"

    # -- parked deliveries (not sharded: parking is rare, one slot keeps it one script) --

    @property
    def parked(self) -> str:
        """Sorted set: task id -> server-clock ms it was (last) parked; oldest first."""
        return f"{self.tag}:parked"

    @property
    def parked_meta(self) -> str:
        """Hash: task id -> JSON of a parked delivery (reason, key, field, name, envelope, ...)."""
        return f"{self.tag}:parked:meta"

    @property
    def parked_body(self) -> str:
        """Hash: task id -> message body bytes of a parked delivery."""
        return f"{self.tag}:parked:body"

    def fence(self, resource: str) -> str:
        """Hash guarding one fenced resource (see celery_leases.protocol.fencing)."""
        return f"{self.tag}:fence:{resource}"
