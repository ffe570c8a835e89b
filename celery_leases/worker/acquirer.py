"""Acquire at receipt without waiting for Redis in the worker's event loop.

Every message a worker receives passes through its main thread, one at a
time; a blocking acquire there adds a Redis round trip to each. With an event
loop, the acquire is sent on a connection of its own and the loop goes on; the
reply is read when the loop sees the socket readable. Acquires wait for
company while that delays nothing (an earlier call is still to come back, or
the pool (prefork, threads) has a task ready to start per process), for a few
milliseconds at most, and then go out together in one script call
(acquire_many.lua), with the start marks that have waited their delay riding
along (heartbeat.py). The task is not handed to its pool until its reply is
in (``LeasedRequest`` defers it), so no body runs without a lease.

redis-py opens the connection (TLS, AUTH, SELECT, Sentinel's current
master); the commands and replies then go over its socket directly
(protocol/transport/resp.py), since one read may bring several replies.

Everything here runs in the loop's thread: no locks, and no second thread
competing with the loop for the GIL (a sending thread, measured, cost the
loop more CPU than the round trip it saves: bench/HISTORY.md).

Not used where the loop thread runs task bodies (solo pool): a reply could
then wait a whole body long, and the lease expire unrenewed meanwhile.
"""
from __future__ import annotations

import logging
import select
from collections import deque
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Callable

from redis.exceptions import ConnectionError as RedisConnectionError

from ..exceptions import LeaseError, LeaseUnavailable
from ..protocol import renewals
from ..protocol.replies import is_acquire_many_reply, is_finishes_reply
from ..protocol.transport.direct import close_connection, open_connection, supported
from ..protocol.errors import lease_error
from ..protocol.transport.resp import Incomplete, pack, parse
from .delivery import MalformedMessage

logger = logging.getLogger("celery_leases.worker")


@dataclass
class Job:
    """One acquire: the store's keyword arguments, and what to do with the result."""

    call: dict
    #: Called in the loop with an Acquisition or a LeaseError.
    done: Callable[["Job", Any], None]
    request: Any = None
    #: Anything the callback needs (the worker keeps its config and epoch here).
    context: dict = field(default_factory=dict)
    #: Its keys and arguments, packed (LeaseStore.acquire_parts); a job is in flight
    #: only once these are set.
    parts: tuple[bytes, bytes] | None = None


@dataclass
class Batch:
    """The jobs of one acquire_many call, the start marks that rode along, and the
    finishes whose call went first in the same write (their reply comes first)."""

    jobs: list[Job]
    starts: dict[str, int]
    #: The finishes (background.py's Pending) and their call, until its reply is read.
    finishing: list | None = None
    finish_call: Any = None
    sent_at: float = 0.0


class Acquirer:
    """Pipelined acquires on one dedicated connection, read back by the event loop."""

    def __init__(self, store: Any, hub: Any, busy: Callable[[], bool] | None = None,
                 max_hold: float = 0.005, marks: Any = None) -> None:
        self.store, self.hub = store, hub
        #: The heartbeat, whose due start marks ride along (take_due_starts, give_back_starts).
        self.marks = marks
        if marks is not None:
            marks.carry_marks()
        #: True while the pool has enough tasks ready to start: new acquires may
        #: then wait (up to max_hold seconds) and go out together.
        self.busy, self.max_hold = busy, max_hold
        self._held_since = 0.0
        self._timer: Any = None
        self._conn: Any = None
        self._sock: Any = None
        self._fd: int | None = None
        #: Bytes read and not yet parsed (a reply cut across reads).
        self._buffer = bytearray()
        #: Calls sent, in that order: the next reply is the first one's. A job enters only
        #: with its packed parts, so replies and jobs cannot drift apart.
        self._sent: deque[Batch] = deque()
        #: Jobs packed and held until the replies still to come are in.
        self._held: list[Job] = []
        #: Acquires sent, and the calls (one write each) that sent them.
        self.sent = self.writes = 0
        #: Prefork's finishes nobody waits for (background.py), which ride in these writes.
        self.finishes: Any = None

    @classmethod
    def supported(cls, store: Any) -> bool:
        """One server behind a connection pool (plain, TLS, unix socket, Sentinel); not a cluster."""
        return supported(store.client)

    @property
    def pending(self) -> int:
        return sum(len(batch.jobs) for batch in self._sent) + len(self._held)

    def requests(self) -> list:
        """The requests whose acquire is held or awaits its reply."""
        return [job.request for batch in self._sent for job in batch.jobs] + \
            [job.request for job in self._held]

    def submit(self, job: Job) -> None:
        """Send the acquire; ``job.done`` runs when its reply is read.

        Sent at once unless sending later delays nothing: while an earlier
        acquire awaits its reply (as Nagle's algorithm does for TCP), or,
        for at most ``max_hold`` seconds, while ``busy()`` says the pool has
        enough tasks ready to start. What is held goes out as one script
        call. An idle worker's acquire goes out at once; a busy one makes
        one call, one write and one read for several acquires.
        """
        try:
            job.parts = self.store.acquire_parts(**job.call)
        except Exception as exc:  # noqa: BLE001 - this job's own fault: it alone fails, nothing was sent
            # (A job queued before its command was packed shifted every later
            # reply onto the wrong job: issue #14.1.)
            self._call(job, MalformedMessage(
                f"task {job.call.get('task_id')!r}: its acquire cannot be sent to the lease store: "
                f"{exc!r}", field="envelope" if isinstance(exc, (TypeError, ValueError)) else "id"))
            return
        if not self._held:
            self._held_since = monotonic()
        self._held.append(job)
        self._maybe_send()

    def _maybe_send(self) -> None:
        """Send what is held, unless a reply is still to come or the pool can wait;
        with nothing held, the finishes that have waited long enough for company."""
        if self._sent:
            return
        if not self._held:
            finishes = self.finishes
            if finishes is not None and finishes.queued and finishes.due_alone():
                self._send_held()
            return
        if self.busy is not None and self.busy() and monotonic() - self._held_since < self.max_hold:
            if self._timer is None:
                self._timer = self.hub.call_later(self.max_hold, self._on_timer)
            return
        self._send_held()

    def _on_timer(self) -> None:
        self._timer = None
        self._maybe_send()

    def tick(self) -> None:
        """Every loop iteration: a task may have started and the pool need more."""
        self._maybe_send()

    def _send_held(self) -> None:
        jobs = self._held
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        finishing, finish_call, command = self._finishes_command(bool(jobs))
        starts = self.marks.take_due_starts() if self.marks is not None and jobs else {}
        sent_at = monotonic()
        try:
            self._connection()
            if jobs:
                command += self.store.acquire_many_command(
                    [job.parts for job in jobs], self.marks.owner if starts else "", starts)
            if command:
                self._sock.sendall(command)
        except Exception as exc:  # noqa: BLE001 - every waiting job learns why; none is dropped
            self._give_back(starts)
            if finishing:  # not answered: sent again with backoff, as after a reset
                self.finishes.settle(finishing, LeaseUnavailable(
                    f"acquire connection to {self.store.description}: {exc!r}"), sent_at)
            self._fail_all(exc)
            return
        if not command:
            return
        self._held = []
        self._sent.append(Batch(jobs, starts, finishing or None, finish_call, sent_at))
        self.sent += len(jobs)
        self.writes += 1

    def _finishes_command(self, riding: bool) -> tuple[list, Any, bytes]:
        """The queued finishes due now, their call and its command (first in the write)."""
        finishes = self.finishes
        if finishes is None or not finishes.queued:
            return [], None, b""
        finishing = finishes.take(riding)
        if not finishing:
            return [], None, b""
        reqs = [p.req for p in finishing]
        call = renewals.finishes_call(self.store, reqs)
        if call is None:  # (not one call: a finish with its optional tail) sent on their own
            finishes.settle(finishing, self._finish_alone(reqs), monotonic())
            return [], None, b""
        script, keys, args = call
        return finishing, call, pack("EVALSHA", script.sha, len(keys), *keys, *args)

    def _finish_alone(self, reqs: list) -> Any:
        try:
            return self.store.finish_many(reqs)
        except LeaseError as exc:
            return exc

    def _connection(self) -> Any:
        if self._conn is None:
            # redis-py connects (TLS, AUTH, SELECT, Sentinel's master); from
            # then on this socket is read and written here only.
            conn = open_connection(self.store.client)
            self._conn, self._sock = conn, conn._sock
            self._fd = self._sock.fileno()
            self._buffer.clear()
        # The loop forgets its readers whenever the consumer restarts
        # (hub.reset()); re-registering is a dict lookup.
        if self._fd not in self.hub.readers:
            self.hub.add_reader(self._fd, self.on_readable)
        return self._conn

    def on_readable(self, *args: Any) -> None:
        """Read what has arrived and hand each complete reply to its job."""
        sock = self._sock
        if sock is None:
            return
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    raise RedisConnectionError(f"{self.store.description} closed the acquire connection")
                buffer = self._buffer
                buffer += data
                pos = 0
                while True:
                    try:
                        reply, after = parse(buffer, pos)
                    except Incomplete:
                        break
                    if not self._sent:
                        raise OutOfStep(f"acquire connection to {self.store.description}: "
                                        f"reply without a request: {reply!r}")
                    finishing = self._sent[0].finishing
                    if finishing is not None:
                        batch = self._sent[0]
                        if not is_finishes_reply(reply, len(finishing)):
                            raise OutOfStep(f"acquire connection to {self.store.description}: "
                                            f"reply {reply!r} is not the reply to "
                                            f"{len(finishing)} finish(es)")
                        pos = after
                        self._finished(batch, reply)
                        if not batch.jobs:
                            self._sent.popleft()
                        continue
                    if not is_acquire_many_reply(reply, len(self._sent[0].jobs)):
                        # Not what acquire_many.lua answers: replies and calls are out
                        # of step, so no reply on this connection can be trusted.
                        raise OutOfStep(f"acquire connection to {self.store.description}: "
                                        f"reply {reply!r} is not the reply to "
                                        f"{len(self._sent[0].jobs)} acquire(s) (first task "
                                        f"{self._sent[0].jobs[0].call.get('task_id')!r})")
                    pos = after
                    self._deliver(self._sent.popleft(), reply)
                del buffer[:pos]
                # A TLS socket may hold decrypted bytes the poller cannot see.
                if not self._sent or not getattr(sock, "pending", lambda: 0)():
                    break
        except Exception as exc:  # noqa: BLE001 - the connection is reset; waiting jobs fail over
            self._fail_all(exc)
        self._maybe_send()

    def _deliver(self, batch: Batch, reply: Any) -> None:
        """Each job of the call gets its own answer (an Acquisition, or its LeaseError)."""
        calls = [job.call for job in batch.jobs]
        owner = self.marks.owner if batch.starts else ""
        try:
            results, _ = self.store.acquire_many_reply(reply, calls, owner=owner, starts=batch.starts)
        except LeaseError as exc:  # an error of the whole call: every acquire of it failed
            self._give_back(batch.starts)
            results = [exc] * len(calls)
        except Exception:  # noqa: BLE001 - named, and no task is run without a lease
            self._give_back(batch.starts)
            results = [LeaseError(f"{len(calls)} acquire(s) (first task {calls[0].get('task_id')}): "
                                  f"acquire_many returned {reply!r}")] * len(calls)
        for job, result in zip(batch.jobs, results):
            self._call(job, result)

    def _finished(self, batch: Batch, reply: Any) -> None:
        """The finishes' reply of ``batch``: each finish's answer, or the error of them all."""
        finishing, batch.finishing = batch.finishing, None
        assert finishing is not None
        what = f"{len(finishing)} finish(es) (acquire connection)"
        try:
            answers: Any = renewals.finishes_reply(self.store, [p.req for p in finishing],
                                                   batch.finish_call, reply, what)
        except LeaseError as exc:
            answers = exc
        except Exception as exc:  # noqa: BLE001 - an answer we cannot read: each is asked again
            answers = LeaseError(f"{what}: unreadable reply {reply!r}: {exc!r}")
        try:
            self.finishes.settle(finishing, answers, batch.sent_at)
        except Exception:  # noqa: BLE001 - one settle's failure must not stop the replies
            logger.exception("celery-leases: settling %d finish(es) failed", len(finishing))

    def _give_back(self, starts: dict[str, int]) -> None:
        """Start marks whose call failed go back to the heartbeat, which sends them."""
        if starts and self.marks is not None:
            self.marks.give_back_starts(starts)

    def _call(self, job: Job, result: Any) -> None:
        try:
            job.done(job, result)
        except Exception:  # noqa: BLE001 - one job's failure must not stop the others'
            logger.exception("celery-leases: handling the acquire result of task %s failed",
                             job.call.get("task_id"))

    def _fail_all(self, exc: Exception) -> None:
        """The connection broke: drop it; every job waiting on it gets the error."""
        self._close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        error = lease_error(exc, "acquire (acquire connection)", self.store.description)
        if not isinstance(error, LeaseUnavailable):
            # Whatever broke the connection (out of step included), no job on it
            # was answered: each is tried again as if the store had been unreachable.
            error = LeaseUnavailable(f"acquire connection to {self.store.description} reset: {exc!r}")
            if isinstance(exc, OutOfStep):
                logger.error("celery-leases: %s; the connection is reset and %d acquire(s) waiting "
                             "on it are tried again", exc, self.pending)
        jobs = [job for batch in self._sent for job in batch.jobs] + self._held
        for batch in self._sent:
            self._give_back(batch.starts)
            if batch.finishing is not None:  # sent again with backoff (background.py)
                finishing, batch.finishing = batch.finishing, None
                self.finishes.settle(finishing, error, batch.sent_at)
        self._sent.clear()
        self._held = []
        for job in jobs:
            self._call(job, error)

    def flush(self, timeout: float = 10.0) -> None:
        """Read every outstanding reply now, blocking (shutdown, consumer restart)."""
        while self._sent or self._held:
            if self._held and not self._sent:
                self._send_held()
                continue
            try:
                ready = bool(getattr(self._sock, "pending", lambda: 0)()) or \
                    bool(select.select([self._sock], [], [], timeout)[0])
            except Exception as exc:  # noqa: BLE001
                self._fail_all(exc)
                return
            if not ready:
                self._fail_all(TimeoutError(f"no reply to {self.pending} acquire(s) "
                                            f"within {timeout}s"))
                return
            self.on_readable()

    def _close(self) -> None:
        conn, fd = self._conn, self._fd
        self._conn = self._sock = self._fd = None
        self._buffer.clear()
        if fd is not None and fd in self.hub.readers:
            try:
                self.hub.remove_reader(fd)
            except Exception:  # noqa: BLE001 - the loop may already be closed
                pass
        if conn is not None:
            # Back to the pool, closed: the replies it still owed are gone with it.
            close_connection(self.store.client, conn)

    def stop(self) -> None:
        self.flush()
        self._close()


class OutOfStep(LeaseError):
    """Raised when a reply on the acquire connection cannot be the next job's (fails every job)."""


__all__ = ["Acquirer", "Batch", "Job"]
