"""Publish tracking, the store side: tasks recorded at publish, and the ones the broker lost.

Knows nothing of Celery (imports no celery or kombu): the Celery wiring
(tracking.py) hands it serialized messages to record and a ``publish``
callable to put undelivered ones back. A record is created in state
``queued`` before its message is published (enqueue.lua); the acquire at
receipt makes it ``active`` and takes it out of the shard's queued index.
A task nobody acquired within ``delivery_timeout`` seconds after it became due
is claimed (claim_undelivered.lua): re-published with generation + 1, or,
past its ``expires``, revoked. A copy the broker holds for a ``recovering``
record (a confirmed recovery re-publish, a retry hand-over) waits in the same
index and is claimed the same way. A task that stays undelivered waits twice as
long before each further copy, up to ``backoff_cap`` timeouts.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ..exceptions import CorruptRecord, LeaseUnavailable
from .calls import compact_json
from .codes import Code
from .direct import close_connection, open_connection
from .direct import supported as direct_supported
from .errors import lease_error
from .records import RecoveryReport
from .scripts import scripts
from .store import LeaseStore
from .wire import Incomplete, pack, parse

__all__ = ["QueuedTask", "Undelivered", "QueuedTasks", "PendingEnqueue"]

logger = logging.getLogger("celery_leases.recovery")

@dataclass(frozen=True)
class QueuedTask:
    """One published message to record: what a re-publish needs, and when it is due."""

    task_id: str
    name: str
    #: The serialized message body, as published.
    body: bytes
    #: exchange, routing_key, headers, properties, content_type, content_encoding, priority.
    envelope: Mapping[str, Any]
    #: ETA in ms since the epoch (the publisher's clock), 0 when none.
    eta_ms: int = 0
    #: Expiry in ms since the epoch (the publisher's clock), 0 when none.
    expires_ms: int = 0
    #: The message's publish id ('' when none): kept with the stored message, so the
    #: acquire of this very publish may leave the message out (acquire.lua ARGV[14]).
    publish: str = ""


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


class QueuedTasks:
    """The records of one LeaseStore (its prefix and shards) waiting for a delivery: queued at
    publish, or recovering (a confirmed re-publish, a retry hand-over)."""

    #: The longest wait between two re-publishes of a task that stays undelivered, as a
    #: multiple of the delivery timeout: the nth consecutive re-publish waits
    #: timeout * 2^(n-1), at most this (claim_undelivered.lua; docs/design.md, publish tracking).
    backoff_cap: int = 8

    def __init__(self, store: LeaseStore, delivery_timeout: float) -> None:
        if not delivery_timeout or delivery_timeout <= 0:
            raise ValueError(f"leases_delivery_timeout must be a positive number of seconds "
                             f"to track publishes, got {delivery_timeout!r}")
        self.store = store
        self.delivery_timeout = delivery_timeout
        # The store's confirmed re-publishes and retry hand-overs wait in the queued index too.
        store.delivery_timeout = delivery_timeout
        self._timeout_ms = max(1, int(round(delivery_timeout * 1000)))
        #: False until an enqueue in this process went through the NOSCRIPT-safe path (send()).
        self._script_loaded = False
        #: The fixed parts of the packed enqueue (_enqueue_command), for this script's SHA.
        self._packed_sha = ""
        self._packed_head = b""
        self._packed_shards: dict[str, tuple[bytes, bytes, bytes]] = {}
        #: This process's connection for enqueues answered after the publish (_Line).
        self._line = _Line(store.client) if direct_supported(store.client) else None

    # -- publish side ---------------------------------------------------------

    def enqueue_call(self, task: QueuedTask) -> tuple[list, list]:
        """KEYS and ARGV of enqueue.lua for ``task``."""
        keys = self.store.keys
        shard = keys.shard_for(task.task_id)
        return ([keys.record(task.task_id), shard.queued, keys.message(task.task_id), shard.stats],
                [task.task_id, task.name, task.body, compact_json(dict(task.envelope)),
                 self._timeout_ms, int(task.eta_ms or 0), int(task.expires_ms or 0), task.publish])

    def one_call_ok(self) -> bool:
        """True when ``enqueue_and_push`` may be used: not on a Redis Cluster client."""
        return not hasattr(self.store.client, "get_node_from_key")

    def enqueue_and_push(self, task: QueuedTask, list_key: str, payload: str) -> tuple[Code, str]:
        """``enqueue`` and the broker's LPUSH of the message ``payload`` onto ``list_key`` in one
        call (the store and the broker share a server and database: enqueue.lua KEYS[5]).

        LeaseUnavailable: no answer, so it is unknown whether the message was pushed. Any
        other LeaseError comes with an answer: the record failed, the message was pushed.
        """
        keys, args = self.enqueue_call(task)
        reply = self.store.calls.run(scripts.enqueue, [*keys, list_key], [*args, payload],
                                     f"recording and publishing task {task.task_id}")
        return self._result(task, reply)

    def enqueue(self, task: QueuedTask) -> tuple[Code, str]:
        """Record ``task`` as queued: (OK, "queued"), or (BUSY/FINISHED, state) when a
        record exists already, which is left as it is (enqueue.lua)."""
        return self.enqueue_many([task])[0]

    def send(self, task: QueuedTask) -> "PendingEnqueue | None":
        """Send ``enqueue`` for ``task`` and return before its reply: the caller publishes the
        message meanwhile, then calls ``result()``, so a publish costs about one round trip, not two.

        Safe in either order at the server: enqueue never overwrites a record, so a worker's
        acquire that lands first only makes the late enqueue a no-op (BUSY or FINISHED).
        None on a Redis Cluster client, and for this process's first call: use ``enqueue``,
        whose NOSCRIPT fallback sends the source, so the record still lands before the message.
        A server that lost its scripts later answers NOSCRIPT: ``result()`` sends the call again
        with the source, so that record lands after its message.
        """
        if not self.can_send():
            return None
        return self.send_on(self.take(), task, release=True)

    def can_send(self) -> bool:
        """True when ``send`` / ``send_on`` may be used (see ``send``); the first call says
        False and counts as the script load the caller's ``enqueue`` does."""
        if not self._script_loaded or hasattr(self.store.client, "get_node_from_key"):
            self._script_loaded = True  # the caller's enqueue() loads it now
            return False
        return True

    def take(self) -> Any:
        """A connection to write enqueues on: this process's line when no other thread holds
        it (no pool round of locks and a poll per publish), else one from the store's pool.
        Give it back with ``give_back``."""
        line = self._line
        if line is not None and line.take():
            return line
        return self.store.client.connection_pool.get_connection()

    def give_back(self, conn: Any) -> None:
        if self._line is not None and conn is self._line:
            conn.give_back()
        else:
            self.store.client.connection_pool.release(conn)

    def send_on(self, conn: Any, task: QueuedTask, *, release: bool = False) -> "PendingEnqueue":
        """Write ``enqueue`` for ``task`` on ``conn`` (from ``take``) without reading its reply.
        Several on one connection make a pipeline: one round trip for a batch (a group's
        members) when their replies are read, in order, at its end.
        ``release``: the reply's reader gives ``conn`` back (else the caller does)."""
        command = self._enqueue_command(task)
        try:
            if self._line is not None and conn is self._line:
                conn.write(command)
            else:
                conn.send_packed_command([command])
        except BaseException as exc:
            conn.disconnect()
            if release:
                self.give_back(conn)
            if not isinstance(exc, Exception):
                raise
            raise self._error(task, exc) from exc
        return PendingEnqueue(self, task, conn, release=release)

    def _enqueue_command(self, task: QueuedTask) -> bytes:
        """``enqueue_call(task)`` packed as one EVALSHA (wire.py's format), built straight
        from the task: a publish pays this on every record, so nothing is built twice."""
        sha = scripts.enqueue.sha
        if self._packed_sha != sha:  # the call's fixed part: EVALSHA, the script, 4 keys
            self._packed_sha = sha
            self._packed_head = pack("EVALSHA", sha, 4)[len(b"*3\r\n"):]
            self._packed_shards = {}
        keys, task_id = self.store.keys, task.task_id
        shard = keys.shard_for(task_id)
        fixed = self._packed_shards.get(shard.tag)
        if fixed is None:
            fixed = self._packed_shards[shard.tag] = (pack(shard.queued)[4:], pack(shard.stats)[4:],
                                                      pack(self._timeout_ms)[4:])
        queued, stats, timeout = fixed
        envelope = task.envelope
        record, message, name = keys.record(task_id).encode(), keys.message(task_id).encode(), task.name.encode()
        body = task.body
        env = compact_json(envelope if type(envelope) is dict else dict(envelope)).encode()
        tid = task_id.encode()
        eta, expires = b"%d" % int(task.eta_ms or 0), b"%d" % int(task.expires_ms or 0)
        pub = task.publish.encode()
        return b"".join((
            b"*15\r\n", self._packed_head,
            b"$%d\r\n%s\r\n" % (len(record), record), queued,
            b"$%d\r\n%s\r\n" % (len(message), message), stats,
            b"$%d\r\n%s\r\n" % (len(tid), tid), b"$%d\r\n%s\r\n" % (len(name), name),
            b"$%d\r\n" % len(body), body, b"\r\n", b"$%d\r\n%s\r\n" % (len(env), env), timeout,
            b"$%d\r\n%s\r\n" % (len(eta), eta), b"$%d\r\n%s\r\n" % (len(expires), expires),
            b"$%d\r\n%s\r\n" % (len(pub), pub)))

    def _error(self, task: QueuedTask, exc: BaseException) -> BaseException:
        return lease_error(exc, f"enqueue (recording published task {task.task_id})", self.store.description)

    def _result(self, task: QueuedTask, reply: Any) -> tuple[Code, str]:
        if reply and reply[0] == Code.CORRUPT:
            key, fld, detail = (v.decode("utf-8", "replace") for v in reply[1:4])
            raise CorruptRecord(f"enqueue of task {task.task_id}: {key} field {fld} {detail}; "
                                f"nothing was written", key, fld)
        return Code(reply[0]), reply[1].decode()

    def enqueue_many(self, tasks: Sequence[QueuedTask]) -> list[tuple[Code, str]]:
        """``enqueue`` for each task, pipelined: one round trip per server."""
        if not tasks:
            return []
        calls = [self.enqueue_call(t) for t in tasks]
        what = f"recording {len(tasks)} published task(s)" if len(tasks) > 1 else \
            f"recording published task {tasks[0].task_id}"
        return [self._result(task, reply)
                for task, reply in zip(tasks, self.store.calls.run_many(scripts.enqueue, calls, what))]

    def forget(self, task_id: str) -> Code:
        """Drop ``task_id``'s record if still queued and never re-published (its publish
        failed, forget.lua): OK, MISSING, or BUSY when it is anything else (left alone)."""
        keys = self.store.keys
        reply = self.store.calls.run(scripts.forget,
                                [keys.record(task_id), keys.shard_for(task_id).queued, keys.message(task_id)],
                                [task_id], f"forgetting unpublished task {task_id}")
        if reply and reply[0] == Code.CORRUPT:
            key, fld, detail = (v.decode("utf-8", "replace") for v in reply[1:4])
            raise CorruptRecord(f"forget of task {task_id}: {key} field {fld} {detail}; nothing was "
                                f"written", key, fld)
        return Code(reply[0])

    # -- recovery side ----------------------------------------------------------

    def overdue(self, limit: int = 1000) -> dict[int, list[str]]:
        """Up to ``limit`` ids per shard whose wait for a delivery is over (server clock)."""
        keys = self.store.keys
        shards = list(range(self.store.shards))
        calls = [((keys.shard(i).queued,), (int(limit),)) for i in shards]
        out: dict[int, list[str]] = {}
        for i, rows in zip(shards, self.store.calls.run_many(scripts.expired, calls, "listing undelivered tasks")):
            if rows and rows[0] == Code.CORRUPT:
                logger.error("listing undelivered tasks: %s field %s %s", *(v.decode() for v in rows[1:4]))
                rows = [0]
            out[i] = [t.decode() for t in rows[1:]]
        return out

    def claim(self, ids: Iterable[str]) -> list[Undelivered]:
        """Claim these overdue ids (claim_undelivered.lua), one call per shard, pipelined."""
        store, keys = self.store, self.store.keys
        calls = []
        for index, task_ids in keys.by_shard(ids).items():
            shard = keys.shard(index)
            call_keys = [shard.queued, shard.stats]
            for t in task_ids:
                call_keys += [keys.record(t), keys.message(t)]
            calls.append((call_keys, [self._timeout_ms, int(round(store.retention * 1000)),
                                      int(self.backoff_cap), *task_ids]))
        if not calls:
            return []
        out = []
        for rows in store.calls.run_many(scripts.claim_undelivered, calls, "claiming undelivered tasks"):
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

    def recover(self, publish: Callable[[Undelivered], None],
                on_expired: Callable[[Undelivered], None] | None = None,
                batch: int | None = None) -> RecoveryReport:
        """One pass over the overdue queued tasks: re-publish each, or revoke the expired.

        Costs O(overdue). A publish that raises is reported; the task is due
        again after its next wait (its generation already grew, so no copy of
        the failed attempt can run).
        """
        report = RecoveryReport(tracked=True)
        batch = batch or self.store.recover_batch
        pending = True
        while pending:
            found = self.overdue(batch)
            ids = [t for shard_ids in found.values() for t in shard_ids]
            pending = any(len(shard_ids) >= batch for shard_ids in found.values())
            if not ids:
                break
            claimed = self.claim(ids)
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
                                 item.generation, self.delivery_timeout, exc, exc_info=True)
            if not claimed:
                break
        return report

    def count(self) -> int:
        """Tasks in the queued indexes (recorded at publish, not acquired yet)."""
        keys = self.store.keys

        def read() -> list:
            pipe = self.store.client.pipeline(transaction=False)
            for shard in keys.all_shards():
                pipe.zcard(shard.queued)
            return pipe.execute()
        return sum(int(n) for n in self.store.calls.read(read, "counting queued tasks"))


class PendingEnqueue:
    """An enqueue written on a connection whose reply is read by ``result()`` (once)."""

    def __init__(self, tracked: QueuedTasks, task: QueuedTask, conn: Any, release: bool = True) -> None:
        self.tracked, self.task, self.conn = tracked, task, conn
        self.release = release
        line = conn if conn is tracked._line else None
        #: The line's socket this was written on, and whether it was held from an earlier publish.
        self.epoch = line.epoch if line is not None else 0
        self.reused = line is not None and line.reused

    def result(self) -> tuple[Code, str]:
        store = self.tracked.store
        what = f"recording published task {self.task.task_id}"
        line = self.conn if self.conn is self.tracked._line else None
        failure: Exception | None = None
        try:
            raw: Any = line.read(self.epoch) if line is not None else self.conn.read_response()
        except ResponseError as exc:  # an error reply (NOSCRIPT among them): calls.reply decides
            raw = exc
        except Exception as exc:
            if line is None:
                self.conn.disconnect()  # the replies still due on it are lost: their readers fail too
            failure = exc  # (the line closes itself, and only the socket that failed)
        finally:
            if self.release:
                self.tracked.give_back(self.conn)
        if failure is not None:
            if self.reused and isinstance(failure, (RedisConnectionError, ConnectionError)):
                # Written on the line held since an earlier publish, which had gone stale (an
                # idle connection the server closed, a restart): the call is sent once more,
                # now after its message, which is safe as for NOSCRIPT below.
                call = self.tracked.enqueue_call(self.task)
                return self.tracked._result(self.task, store.calls.run(scripts.enqueue, *call, what))
            raise self.tracked._error(self.task, failure) from failure
        # NOSCRIPT (the server lost its scripts): calls.reply runs the call again, which loads
        # the script; this record then lands after its message, still overwriting nothing a
        # worker wrote meanwhile.
        if raw is RECORDED:
            return raw
        if isinstance(raw, list):  # a reply: nothing for calls.reply to decide
            return self.tracked._result(self.task, raw)
        reply = store.calls.reply(scripts.enqueue, *self.tracked.enqueue_call(self.task), raw, what)
        return self.tracked._result(self.task, reply)


#: enqueue's reply for a task it recorded, as ``result()`` returns it, and as it comes on the
#: wire (the same in RESP2 and RESP3): the line recognises it without parsing.
RECORDED = (Code.OK, "queued")
_RECORDED = b"*2\r\n:%d\r\n$6\r\nqueued\r\n" % int(Code.OK)
_RECORDED_LEN = len(_RECORDED)


class _Line:
    """This process's own connection for enqueues whose replies are read after the publish.

    Taken from the store's pool once and kept, so a publish pays neither the pool's
    lock and bookkeeping nor its poll of the socket; commands are packed and replies
    parsed with wire.py. The same rules as direct.py: one process (a forked child opens
    its own, never touching the parent's socket), one holder at a time from ``take`` to
    ``give_back`` (a second thread uses the pool meanwhile), any error closes it. The
    replies are read in the order the commands were written; a holder that gives it
    back with replies still due closes it, so a reply is never read by the wrong caller.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._reset()

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.conn: Any = None
        self.buffer = bytearray()
        #: Replies written for and not read yet, on the current socket.
        self.due = 0
        #: Counts the sockets opened, so a reply due on a closed one is never read from the next.
        self.epoch = 0
        #: True when the socket was opened before the current holder took the line.
        self.reused = False

    def take(self) -> bool:
        if self.pid != os.getpid():
            self._reset()  # a forked child: the parent's socket and lock are not ours
        if not self.lock.acquire(blocking=False):
            return False
        self.reused = self.conn is not None
        return True

    def give_back(self) -> None:
        if self.due:
            self.disconnect()
        self.lock.release()

    def write(self, command: bytes) -> None:
        while True:
            if self.conn is None or self.conn._sock is None:
                if self.conn is not None:
                    self.disconnect()  # closed under us (the client's pool was reset)
                self.conn = open_connection(self.client)
                self.epoch += 1
                self.reused = False
            try:
                self.conn._sock.sendall(command)
            except (OSError, RedisConnectionError):
                stale = self.reused
                self.disconnect()
                if not stale:
                    raise
                # Held since an earlier publish and closed by the server meanwhile (idle
                # timeout, restart): written once more on a new connection, still before the
                # message. The replies due on the old one are lost; their readers know (epoch).
                self.reused = False
                continue
            except BaseException:
                self.disconnect()
                raise
            self.due += 1
            return

    def read(self, epoch: int) -> Any:
        """The next reply due on socket ``epoch``; an error reply is raised as redis-py's exception."""
        if self.conn is None or epoch != self.epoch or self.due <= 0:
            raise RedisConnectionError("the lease store connection closed before the reply was read")
        buffer = self.buffer
        try:
            while True:
                if buffer[:_RECORDED_LEN] == _RECORDED:  # the usual reply, without parsing it
                    del buffer[:_RECORDED_LEN]
                    self.due -= 1
                    return RECORDED
                if buffer:
                    try:
                        reply, end = parse(buffer)
                    except Incomplete:
                        pass
                    else:
                        del buffer[:end]
                        self.due -= 1
                        if isinstance(reply, ResponseError):
                            if isinstance(lease_error(reply, "EVALSHA"), LeaseUnavailable):
                                self.disconnect()  # READONLY, LOADING: a reconnect may reach the master
                            raise reply
                        return reply
                data = self.conn._sock.recv(65536)
                if not data:
                    raise RedisConnectionError("the lease store closed the connection")
                buffer += data
        except ResponseError:
            raise
        except BaseException:
            self.disconnect()
            raise

    def disconnect(self) -> None:
        conn, self.conn = self.conn, None
        self.buffer = bytearray()
        self.due = 0
        if conn is not None:
            close_connection(self.client, conn)
