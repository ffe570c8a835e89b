"""Publish tracking, the store side: tasks recorded at publish, and the ones the broker lost.

Knows nothing of Celery (imports no celery or kombu): the Celery wiring
(tracking.py) hands it serialized messages to record and a ``publish``
callable to put undelivered ones back. A record is created in state
``queued`` before its message is published (enqueue.lua); the acquire at
receipt makes it ``active`` and takes it out of the shard's queued index.
A task nobody acquired within ``delivery_timeout`` seconds after it became due
is claimed and re-published (undelivered.py, the recovery side). An enqueue may
be written before the message is published and its reply read after, on this
process's publish line (transport/line.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ..exceptions import CorruptRecord
from . import undelivered
from .calls import compact_json
from .codes import Code
from .core import StoreCore
from .errors import lease_error
from .records import RecoveryReport
from .scripts import scripts
from .transport.direct import supported as direct_supported
from .transport.line import RECORDED, Line
from .transport.resp import pack
from .undelivered import Undelivered

__all__ = ["QueuedTask", "Undelivered", "QueuedTasks", "PendingEnqueue"]


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



class QueuedTasks:
    """The records of one store (its prefix and shards) waiting for a delivery: queued at
    publish, or recovering (a confirmed re-publish, a retry hand-over)."""

    #: The longest wait between two re-publishes of a task that stays undelivered, as a
    #: multiple of the delivery timeout: the nth consecutive re-publish waits
    #: timeout * 2^(n-1), at most this (claim_undelivered.lua; docs/design.md, publish tracking).
    backoff_cap: int = 8

    def __init__(self, store: StoreCore, delivery_timeout: float) -> None:
        if not delivery_timeout or delivery_timeout <= 0:
            raise ValueError(f"leases_delivery_timeout must be a positive number of seconds "
                             f"to track publishes, got {delivery_timeout!r}")
        self.store = store
        self.delivery_timeout = delivery_timeout
        # The store's confirmed re-publishes and retry hand-overs wait in the queued index too.
        store.settings = replace(store.settings, delivery_timeout=delivery_timeout)
        self._timeout_ms = max(1, int(round(delivery_timeout * 1000)))
        #: False until an enqueue in this process went through the NOSCRIPT-safe path (send()).
        self._script_loaded = False
        #: The fixed parts of the packed enqueue (_enqueue_command), for this script's SHA.
        self._packed_sha = ""
        self._packed_head = b""
        self._packed_shards: dict[str, tuple[bytes, bytes, bytes]] = {}
        #: This process's connection for enqueues answered after the publish (transport/line.py).
        self._line = Line(store.client) if direct_supported(store.client) else None

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
        self._script_loaded = True  # (answered: the server has the script, send_on may be used)
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

    def send_on(self, conn: Any, task: QueuedTask, *, release: bool = False,
                push: tuple[str, str] | None = None) -> "PendingEnqueue":
        """Write ``enqueue`` for ``task`` on ``conn`` (from ``take``) without reading its reply.
        Several on one connection make a pipeline: one round trip for a batch (a group's
        members) when their replies are read, in order, at its end.
        ``release``: the reply's reader gives ``conn`` back (else the caller does).
        ``push``: (list key, payload) of the message, pushed by the same call
        (``enqueue_and_push``'s; the store is the broker's server)."""
        if push is None:
            command = self._enqueue_command(task)
        else:
            keys, args = self._push_call(task, push)
            command = pack("EVALSHA", scripts.enqueue.sha, len(keys), *keys, *args)
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
        return PendingEnqueue(self, task, conn, release=release, push=push)

    def _push_call(self, task: QueuedTask, push: tuple[str, str] | None) -> tuple[list, list]:
        """enqueue.lua's KEYS and ARGV for ``task``, with the message's push (KEYS[5], ARGV[9])."""
        keys, args = self.enqueue_call(task)
        if push is None:
            return keys, args
        return [*keys, push[0]], [*args, push[1]]

    def _enqueue_command(self, task: QueuedTask) -> bytes:
        """``enqueue_call(task)`` packed as one EVALSHA (transport/resp.py's format), built straight
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

    # -- recovery side (undelivered.py) ------------------------------------------

    def overdue(self, limit: int = 1000) -> dict[int, list[str]]:
        """Up to ``limit`` ids per shard whose wait for a delivery is over (server clock)."""
        return undelivered.overdue(self.store, limit)

    def claim(self, ids: Iterable[str]) -> list[Undelivered]:
        """Claim these overdue ids (claim_undelivered.lua), one call per shard, pipelined."""
        return undelivered.claim(self.store, ids, self._timeout_ms, self.backoff_cap)

    def recover(self, publish: Callable[[Undelivered], None],
                on_expired: Callable[[Undelivered], None] | None = None,
                batch: int | None = None) -> RecoveryReport:
        """One pass over the overdue queued tasks: re-publish each, or revoke the expired
        (undelivered.recover)."""
        return undelivered.recover(self.store, publish, on_expired, batch, lister=self.overdue,
                                   claimer=self.claim, delivery_timeout=self.delivery_timeout)

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

    def __init__(self, tracked: QueuedTasks, task: QueuedTask, conn: Any, release: bool = True,
                 push: tuple[str, str] | None = None) -> None:
        self.tracked, self.task, self.conn = tracked, task, conn
        self.release, self.push = release, push
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
                call = self.tracked._push_call(self.task, self.push)
                return self.tracked._result(self.task, store.calls.run(scripts.enqueue, *call, what))
            raise self.tracked._error(self.task, failure) from failure
        # NOSCRIPT (the server lost its scripts): calls.reply runs the call again, which loads
        # the script; this record then lands after its message, still overwriting nothing a
        # worker wrote meanwhile.
        if raw is RECORDED:
            return raw
        if isinstance(raw, list):  # a reply: nothing for calls.reply to decide
            return self.tracked._result(self.task, raw)
        reply = store.calls.reply(scripts.enqueue, *self.tracked._push_call(self.task, self.push), raw, what)
        return self.tracked._result(self.task, reply)
