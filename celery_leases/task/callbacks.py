"""Link callbacks and the next chain step of an accepted success, sent with retries.

Celery's tracer sends them after ``__call__`` returns and before it stores
the result; when the broker fails there, it stores FAILURE(OperationalError)
for a task whose success the lease store already accepted, and the callback
is never sent. A LeasedTask sends them itself, right after its success was
accepted, each with bounded retries and a growing delay, and then clears
them from the request so the tracer sends nothing more and stores SUCCESS.
One it still cannot send is reported (an ERROR log naming the task and the
callback, the ``callbacks_failed`` signal), never dropped silently, and the
backend still holds SUCCESS: it never contradicts the lease.

Each callback is published on its own (Celery groups several links into one
group), so a retry never re-sends one that already went out.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from celery.canvas import signature
from kombu.exceptions import EncodeError, OperationalError

from .. import defaults
from ..signals import callbacks_failed

logger = logging.getLogger("celery_leases.task")

#: Errors a later try may not meet again (the broker down, a connection reset).
TRANSIENT = (OperationalError, ConnectionError, OSError, TimeoutError)


def send_callbacks(task: Any, request: Any, retval: Any, *, sleep: Callable[[float], None] = time.sleep,
                   attempts: int = defaults.CALLBACK_SEND_ATTEMPTS) -> int:
    """Send the request's link callbacks, then its next chain step; returns how many could not be sent."""
    app = task.app
    callbacks, chain = list(request.callbacks or ()), list(request.chain or ())
    # From here on they are ours: the tracer must not send them (again) nor store a failure for them.
    request.callbacks = None
    request.chain = None
    priority = None
    if app.conf.task_inherit_parent_priority:
        priority = (request.delivery_info or {}).get("priority")
    options = dict(parent_id=request.id, root_id=request.root_id or request.id, priority=priority)
    # Celery 5.7 waits between its publish retries for callbacks (amqp._retry_publish).
    publish = getattr(app.amqp, "_retry_publish", None) or _call
    sends: list[tuple[str, Callable[[], Any]]] = []
    for raw in callbacks:
        sig = signature(raw, app=app)
        sends.append((f"link callback {_name(sig)}", _sender(publish, sig, retval, options)))
    if chain:
        step = signature(chain[-1], app=app)
        rest = chain[:-1]
        sends.append((f"next chain step {_name(step)}",
                      lambda: publish(step.apply_async, (retval,), chain=rest, **options)))
    failed = 0
    for what, send in sends:
        if not _send(task, request.id, what, send, sleep, attempts):
            failed += 1
    return failed


def _send(task: Any, task_id: str, what: str, send: Callable[[], Any],
          sleep: Callable[[float], None], attempts: int) -> bool:
    delay = defaults.CALLBACK_SEND_DELAY
    for attempt in range(1, attempts + 1):
        try:
            send()
        except TRANSIENT as exc:
            if attempt == attempts:
                return _report(task, task_id, what, exc, attempt)
            logger.warning("task %s[%s]: succeeded; its %s could not be sent (%r), try %d of %d "
                           "in %.1fs", task.name, task_id, what, exc, attempt + 1, attempts, delay)
            sleep(delay)
            delay = min(delay * 2, defaults.CALLBACK_SEND_MAX_DELAY)
        except EncodeError as exc:  # no later try would encode it either
            return _report(task, task_id, what, exc, attempt)
        except Exception as exc:  # noqa: BLE001 - reported, and the success still stored
            return _report(task, task_id, what, exc, attempt)
        else:
            if attempt > 1:
                logger.warning("task %s[%s]: its %s was sent on try %d", task.name, task_id, what, attempt)
            return True
    return False  # pragma: no cover - attempts < 1


def _report(task: Any, task_id: str, what: str, exc: BaseException, attempts: int) -> bool:
    logger.error("task %s[%s]: succeeded, but its %s could not be sent after %d try(s): %r; the "
                 "success stays stored and the callback is NOT sent (send it by hand)",
                 task.name, task_id, what, attempts, exc)
    callbacks_failed.send(sender=task, task_id=task_id, callback=what, error=exc)
    return False


def _name(sig: Any) -> str:
    try:
        return f"{sig.task}" + (f"[{sig.id}]" if sig.id else "")
    except Exception:  # noqa: BLE001 - a name for a log line only
        return repr(sig)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _sender(publish: Callable[..., Any], sig: Any, retval: Any, options: dict) -> Callable[[], Any]:
    """One link callback's send, bound to its own signature."""
    return lambda: publish(sig.apply_async, (retval,), **options)
