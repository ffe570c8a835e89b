"""Writing a leased task's result in the same script that accepts its success.

Celery stores a success in three round trips after the body returns (a GET of
the old result, then SET + PUBLISH). When the result backend is Celery's Redis
backend on the very server and database of the lease store, the finish script
can write that same record itself: the accepted outcome and its result then
land atomically (a process dying in between can no longer leave a finished
lease without a result), a refused one writes nothing, and the task costs one
round trip instead of four. Celery is then told the result is already stored
(``request.ignore_result``), so ``mark_as_done`` writes nothing more but still
runs chord bookkeeping.

Only the plain success of a task without link callbacks or a chain goes this
way: Celery sends those before storing, and the stored record must list them
as children. Every other case keeps Celery's own write (docs/celery.md).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from celery import states

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
