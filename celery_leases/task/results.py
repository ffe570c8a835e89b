"""Writing a leased task's result in the same script that accepts its success.

Celery stores a success in three round trips after the body returns (a GET of
the old result, then SET + PUBLISH). When the result backend is Celery's Redis
backend on the very server and database of the lease store, the finish script
can write that same record itself: the accepted outcome and its result then
land atomically (a process dying in between cannot leave a finished
lease without a result), a refused one writes nothing, and the task costs one
round trip instead of four. Celery is then told the result is already stored
(``request.ignore_result``), so ``mark_as_done`` writes nothing more but still
runs chord bookkeeping.

Only the plain success of a task without link callbacks or a chain goes this
way: Celery sends those before storing, and the stored record must list them
as children. Every other case keeps Celery's own write (docs/celery.md), and
its finish *keeps* the result in the store until this process confirms that
Celery wrote it (protocol/unwritten.py): should the process die in between,
the recovery pass writes it (``ResultWriter``). The confirmations cost no
round trip: the ids ride along in this process's next finish.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import states
from celery.app.task import Context, Task
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.signals import worker_process_shutdown, worker_shutdown

from ..protocol import unwritten
from ..protocol.records import RecoveryReport
from ..protocol.unwritten import KEPT_MAX, UnwrittenResult
from ..signals import result_written_by_recovery
from . import followups

logger = logging.getLogger("celery_leases.results")

try:  # Celery >= 5.2
    from celery.app.task import get_actual_ignore_result
except ImportError:  # pragma: no cover - older Celery
    def get_actual_ignore_result(task: Any, request: Any) -> bool:
        return bool(task.ignore_result or getattr(request, "ignore_result", False))

try:
    from celery.backends.redis import RedisBackend
except ImportError:  # pragma: no cover - redis-py missing: nothing to fuse with
    RedisBackend = None  # type: ignore[assignment,misc]

# backend id -> (pid, store id, same server?): decided once per process and pair.
_same_server: "dict[int, tuple[int, int, bool]]" = {}


def _target(kwargs: dict) -> tuple:
    if kwargs.get("path"):
        return ("unix", kwargs["path"], int(kwargs.get("db") or 0))
    host = str(kwargs.get("host") or "localhost")
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    return (host, int(kwargs.get("port") or 6379), int(kwargs.get("db") or 0))


def shares_server(backend: Any, store: Any) -> bool:
    """True when ``backend`` is Celery's own Redis backend on the store's server and db."""
    if RedisBackend is None or type(backend) is not RedisBackend:
        return False  # a subclass (Sentinel, user code) may store differently
    cached = _same_server.get(id(backend))
    if cached is not None and cached[0] == os.getpid() and cached[1] == id(store):
        return cached[2]
    pool = getattr(store.client, "connection_pool", None)
    store_kwargs = getattr(pool, "connection_kwargs", None)
    # A client without a fixed address (Sentinel: the master moves) is never "the same
    # server": _target would read its missing host as localhost:6379.
    target = dict(store_kwargs or {})
    fixed = "host" in target or "path" in target
    same = fixed and _target(dict(backend.connparams)) == _target(target)
    _same_server[id(backend)] = (os.getpid(), id(store), same)
    return same


def fused_write(task: Any, request: Any, retval: Any, store: Any) -> tuple[str, bytes | str, int] | None:
    """The (key, value, expires) Celery would store for this success, when the
    finish script may write it; None to leave the write to Celery."""
    if (request.is_eager or request.callbacks or request.chain
            or get_actual_ignore_result(task, request)):
        return None
    backend = task.backend
    if not shares_server(backend, store):
        return None
    try:
        result = backend.encode_result(retval, states.SUCCESS)
        meta = backend._get_result_meta(result=result, state=states.SUCCESS, traceback=None, request=request)
        meta["task_id"] = request.id
        value = backend.encode(meta)
    except Exception:  # noqa: BLE001 - Celery's own write reports it (EncodeError -> FAILURE)
        return None
    if isinstance(value, str) and len(value) > backend._MAX_STR_VALUE_SIZE:
        return None  # Celery raises BackendStoreError for this; let it
    return backend.get_key_for_task(request.id), value, int(backend.expires or 0)


def mark_stored(request: Any) -> None:
    """Tell Celery's ``mark_as_done`` the result is already stored."""
    request.ignore_result = True


# -- kept results -------------------------------------------------------------

#: Seconds recovery keeps trying to write a kept result before it gives up (logged).
KEPT_GIVE_UP = 3600.0


def outcome_unread(task: Any, request: Any) -> bool:
    """Nobody reads this task's success: Celery stores no result of it (Celery's own rule,
    any backend) and no callback, errback, chain, chord or group waits on it."""
    if request.callbacks or request.errbacks or request.chain or request.chord or request.group:
        return False
    # (The flags first: task.backend is a lookup through the app.)
    return get_actual_ignore_result(task, request) or isinstance(task.backend, DisabledBackend)


def finished_by_main_process(task: Any, request_dict: dict) -> bool:
    """Prefork: the worker's main process finishes this task's success when the pool reports
    it (task/request.py), and the pool process does not (``lease_parent_finish``): nobody
    reads the success, and no success handler of the task's own could still turn it into
    a failure after the body returned."""
    return type(task).on_success is Task.on_success and outcome_unread(task, Context(request_dict))


def _stores_results(task: Any, request: Any, failure: bool) -> bool:
    """Whether Celery's tracer will write this outcome's result (its own rule), to a backend
    recovery can write to as well (not the RPC backend: its results go to the caller's
    reply queue, named only in the request)."""
    if request.is_eager or isinstance(task.backend, (DisabledBackend, RPCBackend)):
        return False
    if get_actual_ignore_result(task, request):
        return failure and bool(task.store_errors_even_if_ignored)
    return True


def _kept(task: Any, request: Any, state: str, result: Any, traceback: str | None,
          write: bool, follow_ups: dict | None) -> bytes | None:
    backend = task.backend
    try:
        encoded = backend.encode(result)
    except Exception:  # noqa: BLE001 - Celery's own write reports it (EncodeError -> FAILURE)
        return None
    if len(encoded) > KEPT_MAX:
        return None  # left to Celery's write alone (docs/celery.md)
    return unwritten.pack(state, task.name, traceback, encoded, write=write, follow_ups=follow_ups)


def keep_success(task: Any, request: Any, retval: Any, written: bool = False) -> bytes | None:
    """The kept value for a success: the result Celery stores after the finish (unless
    ``written``: the finish writes it) and the follow-ups; None when there is neither."""
    write = not written and _stores_results(task, request, failure=False)
    after = followups.describe(task, request, states.SUCCESS)
    if not write and not after:
        return None
    try:
        result = task.backend.encode_result(retval, states.SUCCESS)
    except Exception:  # noqa: BLE001 - as above
        return None
    return _kept(task, request, states.SUCCESS, result, None, write, after)


def keep_failure(task: Any, request: Any, exc: BaseException, traceback: str | None) -> bytes | None:
    """The kept value for a failure: the result Celery stores after the finish and a chord
    member's part; None when there is neither."""
    write = _stores_results(task, request, failure=True)
    after = followups.describe(task, request, states.FAILURE)
    if not write and not after:
        return None
    try:
        result = task.backend.prepare_exception(exc)
    except Exception:  # noqa: BLE001 - as above
        return None
    return _kept(task, request, states.FAILURE, result, traceback, write, after)


class Confirmations:
    """This process's kept results, and those Celery has written since (to confirm).

    A finish that kept a result records its id here; after the tracer stored the
    result (``LeasedTask.after_return``) the id moves to the written list, and the
    process's next finish carries it (``take``). Bounded: past ``CAP`` unconfirmed
    ids, the oldest are left to recovery, which finds their results written.
    """

    CAP = 1000

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.kept: dict[str, None] = {}
        self.written: list[str] = []
        #: The store of the latest finish that kept a result: where ``flush`` confirms.
        self.store: Any = None

    def kept_for(self, store: Any, task_id: str) -> None:
        with self.lock:
            self.store = store
            self.kept[task_id] = None
            if len(self.kept) > self.CAP:
                del self.kept[next(iter(self.kept))]

    def stored(self, task_id: str) -> None:
        with self.lock:
            if self.kept.pop(task_id, 0) is None:
                self.written.append(task_id)
                del self.written[:-self.CAP]

    def take(self, store: Any, task_id: str) -> list[str]:
        """The written ids a finish of ``task_id`` carries (its shard's), taken off the list."""
        with self.lock:
            if not self.written:
                return []
            riding = unwritten.riding(store, task_id, self.written)
            if len(riding) == len(self.written):
                self.written = []
            else:
                taken = set(riding)
                self.written = [t for t in self.written if t not in taken]
            return riding

    def flush(self) -> None:
        """Confirm the written ids no finish carried (the process is exiting: a prefork child
        recycled by ``worker_max_tasks_per_child``, a worker shutting down). Best effort:
        what is not confirmed is checked by recovery."""
        with self.lock:
            ids, self.written, store = self.written, [], self.store
        if ids and store is not None:
            try:
                unwritten.confirm(store, ids)
            except Exception as exc:  # noqa: BLE001 - recovery finds these results written
                logger.debug("confirming %d written result(s) at exit failed: %r", len(ids), exc)


_confirmations: Confirmations | None = None


def confirmations() -> Confirmations:
    """This process's Confirmations (a prefork child starts with none of its parent's)."""
    global _confirmations
    if _confirmations is None or _confirmations.pid != os.getpid():
        _confirmations = Confirmations()
    return _confirmations


@worker_process_shutdown.connect(weak=False, dispatch_uid="celery_leases.results.child")
@worker_shutdown.connect(weak=False, dispatch_uid="celery_leases.results.worker")
def _confirm_at_exit(**kwargs: Any) -> None:
    if _confirmations is not None and _confirmations.pid == os.getpid():
        _confirmations.flush()


class ResultWriter:
    """The recovery step that writes kept results nobody confirmed (their process died)."""

    def __init__(self, app: Any, store: Any) -> None:
        self.app, self.store = app, store

    def __call__(self) -> RecoveryReport:
        report = RecoveryReport()
        done, wrote = [], 0
        for item in unwritten.claim(self.store):
            try:
                if self.write(item):
                    wrote += 1
                done.append(item.task_id)
            except Exception as exc:  # noqa: BLE001 - handed out again after publish_grace
                report.errors.append((item.task_id, exc))
                if time.time() - item.kept_at > KEPT_GIVE_UP:
                    done.append(item.task_id)
                    logger.error("task %s[%s]: its kept %s result could not be written for %.0fs; "
                                 "given up, the backend has no result for it: %r", item.name,
                                 item.task_id, item.state, time.time() - item.kept_at, exc)
                    continue
                logger.error("task %s[%s]: writing its kept %s result failed; tried again in %ss: %r",
                             item.name, item.task_id, item.state, self.store.settings.publish_grace, exc,
                             exc_info=True)
        if done:
            unwritten.confirm(self.store, done, wrote)
        report.results_written = wrote
        return report

    def write(self, item: UnwrittenResult) -> bool:
        """Store ``item``'s result unless the backend holds one for its task, then do the
        follow-ups its process may not have done (followups.py); True if a result was written."""
        backend = self.app.backend
        value = backend.decode(item.encoded)
        if item.state == states.FAILURE:
            value = backend.exception_to_python(value)
        wrote = stored = False
        if item.write:
            meta = backend.get_task_meta(item.task_id, cache=False)
            stored = meta.get("status") in states.READY_STATES  # Celery wrote it
            if not stored:
                backend.store_result(item.task_id, value, item.state, traceback=item.traceback)
                logger.warning("task %s[%s]: %s result written by recovery: the process that finished "
                               "it died after its outcome was accepted, before Celery stored the result",
                               item.name, item.task_id, item.state)
                result_written_by_recovery.send(sender=self.app, task_id=item.task_id, state=item.state)
                wrote = True
        if item.follow_ups:
            followups.redo(self.app, self.store, item.task_id, item.name, item.state, value,
                           item.follow_ups, tracer_done=stored)
        return wrote


def attach(app: Any, store: Any) -> None:
    """Add the kept-results step to ``store``'s recovery passes (runtime.on_new_store), for
    the stores of apps install() ran for (their backend writes the results)."""
    if getattr(app, "_celery_leases_installed", False):
        store.recovery_steps.append(ResultWriter(app, store))
