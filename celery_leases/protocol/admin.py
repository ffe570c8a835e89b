"""Operator reads and repairs (the CLI's ``celery leases ...``), over a store's core (core.py).

Nothing here is on a task's hot path: listings walk the database with SCAN,
statistics sum every shard. The methods of the store that docs/operations.md
names (``records``, ``scan``, ``purge``, ``stats``, ``parked``, ``parked_entry``,
``unpark``, ``reset_record``) call these; ``other_layout`` (the doctor's check)
and ``expire_now`` (a test helper) are only functions here.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any, Iterable

from ..exceptions import CorruptRecord, LeaseError, LeaseUnavailable
from .calls import ms
from .codes import TERMINAL_STATES, Code
from .core import StoreCore
from .errors import lease_error
from .keys import Keys, ShardKeys
from .records import INT_FIELDS, LeaseRecord, Parked, raise_if_corrupt
from .scripts import scripts

__all__ = ["stats", "other_layout", "records", "scan", "scan_all", "purge", "parked", "parked_entry", "unpark",
           "reset_record", "expire_now", "glob_escape"]

logger = logging.getLogger("celery_leases.store")


def stats(core: StoreCore) -> dict[str, int]:
    """Lifetime counters of this prefix plus the number of leases in the index (summed over shards)."""
    shards = core.keys.all_shards()

    def read() -> list:
        pipe = core.client.pipeline(transaction=False)
        for shard in shards:
            pipe.hgetall(shard.stats)
            pipe.zcard(shard.deadlines)
        return pipe.execute()

    rows = core.calls.read(read, f"reading {shards[0].stats}" + (
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


def other_layout(core: StoreCore) -> tuple[int, int] | None:
    """(shard count, leases indexed) of another layout of this prefix still holding live leases.

    Changing leases_shards moves every task to other key names: leases
    written under the old count are no longer renewed, recovered or
    refused by the new one. This looks at the layout last recorded by a
    sharded store (``Keys.layout``) and, for a sharded store, at the
    one-shard layout; it records this store's count once no other layout
    holds live leases. None when nothing is stranded.
    """
    marker = core.calls.read(lambda: core.client.get(core.keys.layout), f"reading {core.keys.layout}")
    previous = int(marker) if marker and marker.isdigit() else None
    candidates = {previous} if previous and previous != core.shards else set()
    if core.shards > 1:
        candidates.add(1)
    for count in sorted(c for c in candidates if c):
        keys = Keys(core.keys.prefix, count).all_shards()

        def read(keys: list[ShardKeys] = keys) -> list:
            pipe = core.client.pipeline(transaction=False)
            for shard in keys:
                pipe.zcard(shard.deadlines)
            return pipe.execute()

        indexed = sum(int(n) for n in core.calls.read(read, f"reading the deadline indexes of {count} shards"))
        if indexed:
            return count, indexed
    if previous != core.shards:
        if core.shards > 1:
            core.calls.read(lambda: core.client.set(core.keys.layout, core.shards), f"setting {core.keys.layout}")
        elif previous is not None:
            core.calls.read(lambda: core.client.delete(core.keys.layout), f"deleting {core.keys.layout}")
    return None


def records(core: StoreCore, task_ids: Iterable[str], *, skip_corrupt: bool = False) -> list[LeaseRecord]:
    """The records of ``task_ids`` in that order, without their stored messages.

    Missing records are left out; one pipelined round trip for all of them.
    A corrupt record raises CorruptRecord, or is logged and left out with
    ``skip_corrupt``.
    """
    task_ids = list(task_ids)
    if not task_ids:
        return []
    keys = [core.keys.record(t) for t in task_ids]
    fields = ("state", "owner", "name", "started", "isolate", *INT_FIELDS, *(f"h:{n}" for n in range(16)))

    def read() -> list:
        pipe = core.client.pipeline(transaction=False)
        for key, task_id in zip(keys, task_ids):
            pipe.hmget(key, fields)
            pipe.exists(core.keys.message(task_id))
            pipe.zscore(core.keys.shard_for(task_id).deadlines, task_id)
        return pipe.execute(raise_on_error=False)

    rows = core.calls.read(read, f"reading {len(keys)} lease records")
    out = []
    for i, (key, task_id) in enumerate(zip(keys, task_ids)):
        values, has_message, deadline = rows[3 * i:3 * i + 3]
        try:
            for value in (values, has_message, deadline):
                if isinstance(value, Exception):  # e.g. WRONGTYPE: not a hash
                    error = lease_error(value, f"reading lease record {key} of task {task_id}",
                                        core.description)
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


def scan(core: StoreCore, state: str | None = None, count: int = 500,
         limit: int | None = None) -> list[LeaseRecord]:
    """Lease records of this prefix (only those in ``state`` if given), in no particular order.

    Walks the database with ``SCAN MATCH <record prefix>*`` (``count`` is
    SCAN's batch hint), so its cost grows with the number of keys in the
    database: for operators, never on a hot path. Live leases are listed
    cheaply from the deadline index (``active``). Corrupt records are
    logged and skipped. Stops after ``limit`` matching records.
    """
    out: list[LeaseRecord] = []
    for batch in _scan_record_keys(core, count):
        for record in records(core, [t for _, t in batch], skip_corrupt=True):
            if state is not None and record.state != state:
                continue
            out.append(record)
            if limit is not None and len(out) >= limit:
                return out
    return out


def scan_all(core: StoreCore, count: int = 500) -> tuple[list[LeaseRecord], list[tuple[str, str]]]:
    """Every readable record, and (key, problem) of every corrupt one: one SCAN of the prefix.

    For the doctor, which must report corrupt records rather than skip them
    (``scan`` logs and skips them). Costs what ``scan`` costs.
    """
    good: list[LeaseRecord] = []
    corrupt: list[tuple[str, str]] = []
    for batch in _scan_record_keys(core, count):
        read = records(core, [t for _, t in batch], skip_corrupt=True)
        good += read
        seen = {r.task_id for r in read}
        for key, task_id in batch:
            if task_id in seen:
                continue
            try:  # left out: corrupt, or gone since the scan listed it
                core.get(task_id)
            except LeaseUnavailable:
                raise
            except LeaseError as exc:  # CorruptRecord, or a reply this protocol did not write
                corrupt.append((key, str(exc)))
    return good, corrupt


def purge(core: StoreCore, older_than: float = 0.0, *, dry_run: bool = False, count: int = 500) -> int:
    """Delete finished records (succeeded, failed, revoked, dead) at least ``older_than`` seconds old.

    Never deletes an active or recovering record (purge.lua checks and
    deletes atomically). Ages are measured on the Redis server's clock.
    ``dry_run`` only counts. Returns the number of records deleted (or
    that would be). A purged record no longer refuses late duplicates of
    its task: purge only what is older than any duplicate can be.
    """
    if dry_run:
        cutoff = core.server_time_ms() - ms(older_than)
        return sum(1 for r in scan(core, count=count)
                   if r.state in TERMINAL_STATES and r.finished_at <= cutoff)
    purged = 0
    for batch in _scan_record_keys(core, count):
        calls = []
        for index, task_ids in core.keys.by_shard(t for _, t in batch).items():
            calls.append(([core.keys.shard(index).deadlines, *map(core.keys.record, task_ids)],
                          [ms(older_than), *task_ids]))
        for reply in core.calls.run_many(scripts.purge, calls, f"{len(batch)} records"):
            if reply[0] == Code.CORRUPT:
                logger.error("purge: %s field %s %s; its records are left alone",
                             *(v.decode() for v in reply[1:4]))
                continue
            purged += int(reply[1])
            for task_id, what in zip(reply[2::2], reply[3::2]):
                logger.warning("purge: left corrupt record %s alone: field %s",
                               core.keys.record(task_id.decode()), what.decode())
    return purged


def parked(core: StoreCore, limit: int = 100) -> list[Parked]:
    """Parked deliveries, oldest first (without their bodies: ``unpark`` returns those)."""
    keys = core.keys

    def read() -> list:
        ids: list[Any] = list(core.client.zrange(keys.parked, 0, int(limit) - 1))
        if not ids:
            return []
        return list(zip(ids, core.client.hmget(keys.parked_meta, ids)))

    out = []
    for task_id, meta in core.calls.read(read, f"reading {keys.parked}"):
        if meta is not None:  # dropped between the two reads
            out.append(Parked.parse(task_id.decode("utf-8", "surrogateescape"), meta))
    return out


def parked_entry(core: StoreCore, task_id: str) -> Parked | None:
    """``task_id``'s parked delivery without its body, or None (nothing is removed)."""
    meta = core.calls.read(lambda: core.client.hget(core.keys.parked_meta, task_id),
                      f"reading {core.keys.parked_meta}")
    return None if meta is None else Parked.parse(task_id, meta)


def unpark(core: StoreCore, task_id: str) -> Parked | None:
    """Remove ``task_id``'s parked delivery and return it with its body and envelope (None: none)."""
    keys = core.keys
    reply = core.calls.run(scripts.unpark, (keys.parked, keys.parked_meta, keys.parked_body),
                      (task_id,), f"unparking task {task_id}")
    raise_if_corrupt(reply, f"unparking task {task_id}")
    if Code(reply[0]) is Code.MISSING:
        return None
    return Parked.parse(task_id, reply[1], reply[2])


def reset_record(core: StoreCore, task_id: str) -> bool:
    """Delete ``task_id``'s lease record, stored message and deadline entry (an operator's choice).

    For a corrupt record that keeps a parked delivery from running again
    (``celery leases replay --reset-record``): the next delivery starts a
    fresh record. Nothing is read, so a corrupt record of any type goes.
    True when there was a record.
    """
    key, shard = core.keys.record(task_id), core.keys.shard_for(task_id)

    def delete() -> list:
        # One slot (the task's shard tag); redis-py's cluster pipeline has no MULTI.
        pipe = core.client.pipeline(transaction=not hasattr(core.client, "get_node_from_key"))
        pipe.delete(key)
        pipe.delete(core.keys.message(task_id))
        pipe.zrem(shard.deadlines, task_id)
        return pipe.execute()

    return bool(core.calls.read(delete, f"deleting {key} of task {task_id}")[0])


def expire_now(core: StoreCore, task_id: str) -> bool:
    """Make ``task_id``'s lease due now, as if its ttl had run out (a test helper).

    Scores the lease at the server's now in the deadline index, and only a
    lease already there (``ZADD XX``: active or recovering); False when it
    is not. The record is not touched: whoever acts on the due lease (a
    recovery pass, a redelivered copy) re-checks it in its own script, as
    for any expiry, so no Lua is needed. Not atomic with the owner's
    heartbeat: an owner that still renews pushes the deadline back at its
    next tick (``celery_leases.testing.make_stale`` expires and claims).
    """
    deadlines = core.keys.shard_for(task_id).deadlines
    now = core.server_time_ms(deadlines)

    def rescore() -> list:
        pipe = core.client.pipeline(transaction=True)
        pipe.zadd(deadlines, {task_id: now}, xx=True)
        pipe.zscore(deadlines, task_id)
        return pipe.execute()

    _, score = core.calls.read(rescore, f"rescoring {task_id} in {deadlines}")
    return score is not None


def _scan_record_keys(core: StoreCore, count: int) -> Iterable[list[tuple[str, str]]]:
    """Batches of (record key, task id) found by SCAN MATCH on the record prefix.

    One pattern covers every shard; on a cluster each master is scanned.
    Keys of another prefix or shard count that the pattern also matches
    are left out.
    """
    if core.shards == 1:
        match = glob_escape(core.keys.record_prefix()) + "*"
    else:
        match = glob_escape("{" + core.keys.prefix + ":") + "[0-9]*}:lease:*"
    nodes = core.client.get_primaries() if hasattr(core.client, "get_primaries") else [None]
    for node in nodes:
        target = {} if node is None else {"target_nodes": node}
        cursor = 0
        while True:
            cursor, keys = core.calls.read(
                lambda: _scan_one(core, cursor, match, count, target), f"scanning {match}")
            batch = [parsed for parsed in map(partial(_parse_record_key, core), keys) if parsed]
            if batch:
                yield batch
            if int(cursor) == 0:
                break


def _scan_one(core: StoreCore, cursor: int, match: str, count: int, target: dict) -> tuple[int, list]:
    cursor_out, keys = core.client.scan(cursor, match=match, count=count, **target)
    if isinstance(cursor_out, dict):  # RedisCluster answers per node
        (cursor_out,) = cursor_out.values()
    return cursor_out, keys


def _parse_record_key(core: StoreCore, key: Any) -> tuple[str, str] | None:
    """(key, task id) when ``key`` is a record key of this store's layout, else None."""
    key = key.decode() if isinstance(key, bytes) else key
    if core.shards == 1:
        return key, key[len(core.keys.record_prefix()):]
    tag, sep, task_id = key.partition("}:lease:")
    if not sep:
        return None
    index = tag[len(core.keys.prefix) + 2:]
    if not index.isdigit() or int(index) >= core.shards or core.keys.shard_of(task_id) != int(index):
        return None
    return key, task_id


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
