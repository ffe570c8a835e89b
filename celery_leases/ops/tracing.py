"""OpenTelemetry: the lease on the task span (extra: ``celery-leases[opentelemetry]``).

    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    import celery_leases.tracing

    CeleryInstrumentor().instrument()      # in each worker process (worker_process_init)
    celery_leases.tracing.enable(app)

With ``opentelemetry-instrumentation-celery`` active, each run of a leased task
has a span (``run/<task name>``). Once enabled, this module adds to it:

- attributes ``celery_leases.token``, ``celery_leases.generation`` and
  ``celery_leases.recovered`` (True for a run of a message a recovery
  re-published: generation above 0);
- events ``celery_leases.lease_lost`` (the heartbeat found the lease lost, or
  the body was not started because of it) and ``celery_leases.refused`` (the
  run's outcome was refused: another run owns the task);
- on a recovered run, a link to the span of the run it replaces.

The link needs the replaced run's span context, which only the process that
ran it knew. So each run writes its own into ``{p}:spans:<task id>`` (a hash,
one field per token, one pipelined HSET + PEXPIRE per run, expiring after
``leases_retention``); a recovered run reads it (one HGETALL) and links to the
run of the highest token below its own. Fields per token need no fencing: a
stale run writes only its own field. Without ``enable()`` nothing of this
runs, not even an import of opentelemetry (docs/operations.md, "Tracing").
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import task_postrun

from ..protocol.codes import Code
from ..signals import delivery_refused, lease_lost, stale_outcome_rejected

logger = logging.getLogger("celery_leases.tracing")

__all__ = ["enable", "disable", "enabled"]

#: Apps traced in this process (None: every app); checked first by every hook, so with
#: tracing off a task pays one attribute read.
_apps: set | None = None
_on = False
#: task id -> (span, token) of the runs under way in this process (for the heartbeat's
#: lease_lost, sent from another thread of the same process under threads and solo).
_running: dict[str, tuple[Any, int]] = {}
_lock = threading.Lock()
_trace: Any = None


def enable(app: Any = None) -> None:
    """Put the lease on the task spans of ``app`` (every app when None), in this process.

    Call it where the instrumentor is set up (e.g. ``worker_process_init`` under
    prefork). Raises ImportError naming the extra when opentelemetry is missing.
    """
    global _on, _apps, _trace
    try:
        from opentelemetry import trace
    except ImportError as exc:
        raise ImportError("celery_leases.ops.tracing needs opentelemetry: "
                          "pip install 'celery-leases[opentelemetry]'") from exc

    _trace = trace
    with _lock:
        if app is None:
            _apps = None
        elif _on and _apps is not None:
            _apps.add(app)
        elif not _on:
            _apps = {app}
        if not _on:
            lease_lost.connect(_on_lost, weak=False)
            stale_outcome_rejected.connect(_on_refused, weak=False)
            delivery_refused.connect(_on_not_started, weak=False)
            task_postrun.connect(_on_postrun, weak=False)
            _on = True


def disable() -> None:
    """Stop adding the lease to spans in this process."""
    global _on, _apps
    with _lock:
        lease_lost.disconnect(_on_lost)
        stale_outcome_rejected.disconnect(_on_refused)
        delivery_refused.disconnect(_on_not_started)
        task_postrun.disconnect(_on_postrun)
        _on, _apps = False, None
        _running.clear()


def enabled(app: Any) -> bool:
    return _on and (_apps is None or app in _apps)


# -- hooks (task.py) ---------------------------------------------------------


def run_started(task: Any, lease: Any) -> None:
    """The body is about to run under ``lease``: annotate the current (task) span, store
    its context for a later recovered run, and link a recovered run to the one it replaces."""
    if not _on or not enabled(task.app):
        return
    try:
        span = _trace.get_current_span()
        if not span.is_recording():
            return
        generation = int(lease.generation or 0)
        span.set_attribute("celery_leases.token", int(lease.token))
        span.set_attribute("celery_leases.generation", generation)
        span.set_attribute("celery_leases.recovered", generation > 0)
        with _lock:
            _running[lease.task_id] = (span, int(lease.token))
        store = lease.store
        key = store.keys.spans(lease.task_id)
        ctx = span.get_span_context()
        previous = None
        pipe = store.client.pipeline(transaction=False)
        if generation > 0:
            pipe.hgetall(key)
        pipe.hset(key, str(lease.token), f"{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}")
        pipe.pexpire(key, int(store.settings.retention * 1000))
        replies = pipe.execute()
        if generation > 0:
            previous = _replaced(replies[0], int(lease.token))
        if previous is not None:
            span.add_link(previous, {"celery_leases.relation": "replaces"})
    except Exception as exc:  # noqa: BLE001 - tracing must never fail a task
        logger.debug("task %s: lease not added to its span: %r", lease.task_id, exc)


def _on_postrun(sender: Any = None, task_id: str = "", **kw: Any) -> None:
    with _lock:
        _running.pop(task_id, None)


def _replaced(spans: dict, token: int) -> Any:
    """The span context of the run with the highest token below ``token``, if stored."""
    best = None
    for raw_token, raw in spans.items():
        try:
            t = int(raw_token)
            trace_id, span_id, flags = (raw.decode() if isinstance(raw, bytes) else raw).split("-")
        except (ValueError, AttributeError):
            continue
        if t < token and (best is None or t > best[0]):
            best = (t, int(trace_id, 16), int(span_id, 16), int(flags, 16))
    if best is None:
        return None
    return _trace.SpanContext(best[1], best[2], is_remote=True, trace_flags=_trace.TraceFlags(best[3]))


def _on_lost(sender: Any = None, task_id: str = "", token: Any = None, reason: str = "", **kw: Any) -> None:
    """The heartbeat (this process: threads, solo) found the lease lost."""
    with _lock:
        entry = _running.get(task_id)
    if entry is None or (token is not None and entry[1] != token):
        return          # not a run of this process (prefork: the run is in a pool child)
    _mark_lost(entry[0], reason)


def _mark_lost(span: Any, reason: str) -> None:
    if span.is_recording() and not getattr(span, "_celery_leases_lost", False):
        span.add_event("celery_leases.lease_lost", {"celery_leases.reason": reason})
        try:
            span._celery_leases_lost = True
        except AttributeError:
            pass


def _on_refused(sender: Any = None, task_id: str = "", token: Any = None, outcome: str = "",
                reason: str = "", **kw: Any) -> None:
    """An outcome of this run was refused: the run learns here (at the latest) that its lease
    was lost, so the loss is an event too if the heartbeat did not say so first."""
    try:
        with _lock:
            entry = _running.get(task_id)
        span = entry[0] if entry and (token is None or entry[1] == token) else None
        if span is None:
            current = _trace.get_current_span()
            span = current if current.is_recording() else None
        if span is None:
            return
        _mark_lost(span, reason)
        span.add_event("celery_leases.refused", {"celery_leases.outcome": outcome,
                                                 "celery_leases.reason": reason,
                                                 "celery_leases.token": int(token or 0)})
    except Exception as exc:  # noqa: BLE001 - tracing must never fail a task
        logger.debug("task %s: refusal not added to its span: %r", task_id, exc)


def _on_not_started(sender: Any = None, code: Any = None, reason: str = "", **kw: Any) -> None:
    """A body not started because its lease was lost (task.py, sent in the run's process)."""
    if code is not Code.LOST or not hasattr(sender, "app"):
        return
    span = _trace.get_current_span()
    if span.is_recording():
        _mark_lost(span, reason)
