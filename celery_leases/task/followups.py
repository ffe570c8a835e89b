"""Follow-ups: what a finishing process does after an accepted outcome, kept so none is lost.

After the finish accepts an outcome, the process that ran the task still has
work to do: send the success's link callbacks and its chain's next step
(callbacks.py), and count a chord member's part (Celery's ``mark_as_done`` ->
``on_chord_part_return``), which sends the chord's body once every part is in.
A process killed in that moment (a pill beside it on threads, the OOM killer)
would leave the task finished and its follow-ups never sent: the chain stops,
the chord never fires, and nothing re-runs a finished task.

So the finish keeps them with the outcome (results.py, protocol/unwritten.py),
until Celery's tracer has done them in this process (``after_return``
confirms). Recovery does those nobody confirmed (``redo``), and sends each at
most once where the store can tell:

- a callback or chain step that is a leased task recorded at publish has a
  lease record from its publish on: one with a record was sent, and is not
  sent again (a plain task, or tracking off, cannot be told: it is sent again
  unless the task's result shows the tracer got past its sends);
- a chord part is counted again only on Celery's Redis backend with ordered
  chords (its default), where counting a part twice adds nothing, and only
  while the chord's body has no lease record (it was not sent yet).
"""
from __future__ import annotations

import json
import logging
import uuid
from types import SimpleNamespace
from typing import Any

from celery import states
from celery.app.task import Context

from .callbacks import send_callbacks

logger = logging.getLogger("celery_leases.results")

__all__ = ["describe", "redo"]

try:
    from celery.backends.redis import RedisBackend
except ImportError:  # pragma: no cover - redis-py missing
    RedisBackend = None  # type: ignore[assignment,misc]


def describe(task: Any, request: Any, state: str) -> dict | None:
    """The follow-ups of this outcome, as JSON values; None when there are none.

    A link callback without a task id gets one here (what its send would give it),
    so a send by recovery is recognisable as the same task.
    """
    if request.is_eager:
        return None
    after: dict[str, Any] = {}
    if request.chord and request.group:
        after["chord"] = {"group": request.group, "group_index": request.group_index,
                          "chord": request.chord}
    if state == states.SUCCESS and (request.callbacks or request.chain):
        for callback in request.callbacks or ():
            options = callback.setdefault("options", {})
            if not options.get("task_id"):
                options["task_id"] = str(uuid.uuid4())
        after["callbacks"] = list(request.callbacks or ())
        after["chain"] = list(request.chain or ())
        after["parent"] = {"root_id": request.root_id,
                           "priority": (request.delivery_info or {}).get("priority")}
    if not after:
        return None
    try:
        json.dumps(after)
    except (TypeError, ValueError) as exc:
        logger.warning("task %s[%s]: its follow-ups (chord part, callbacks, chain) are not JSON "
                       "(%r) and are not kept: a death right after its finish loses them",
                       task.name, request.id, exc)
        return None
    return after


def _id(sig: dict) -> str | None:
    return (sig.get("options") or {}).get("task_id")


def redo(app: Any, store: Any, task_id: str, name: str, state: str, value: Any,
         follow_ups: dict, tracer_done: bool) -> None:
    """Do the follow-ups of ``task_id`` its dead process may not have done.

    ``tracer_done``: the backend holds the result Celery's tracer stores after the
    callbacks and chain step were sent (so they were).
    """
    chord = follow_ups.get("chord")
    if chord:
        _count_chord_part(app, store, task_id, name, state, value, chord)
    if state == states.SUCCESS and not tracer_done and (follow_ups.get("callbacks") or follow_ups.get("chain")):
        _send(app, store, task_id, name, value, follow_ups)


def _send(app: Any, store: Any, task_id: str, name: str, value: Any, follow_ups: dict) -> None:
    callbacks = [c for c in follow_ups.get("callbacks") or () if not _recorded(store, _id(c))]
    chain = list(follow_ups.get("chain") or ())
    if chain and _recorded(store, _id(chain[-1])):
        chain = []  # the next step was sent; it sends the rest itself
    if not callbacks and not chain:
        return
    parent = follow_ups.get("parent") or {}
    request = SimpleNamespace(id=task_id, root_id=parent.get("root_id"), callbacks=callbacks,
                              chain=chain, delivery_info={"priority": parent.get("priority")})
    task = app.tasks.get(name) or SimpleNamespace(app=app, name=name)
    failed = send_callbacks(task, request, value)
    logger.warning("task %s[%s]: %d follow-up(s) sent by recovery (%d failed): the process that "
                   "finished it died before sending them", name, task_id,
                   len(callbacks) + bool(chain) - failed, failed)


def _count_chord_part(app: Any, store: Any, task_id: str, name: str, state: str, value: Any,
                      chord: dict) -> None:
    body = chord.get("chord") or {}
    if _recorded(store, _id(body)):
        return  # the body was sent: every part was counted
    backend = app.backend
    if RedisBackend is None or not isinstance(backend, RedisBackend) or not getattr(backend, "_chord_zset", False):
        logger.error("task %s[%s]: its process died after its outcome was accepted; its chord part "
                     "may be uncounted, and %s cannot count a part twice safely: if the chord "
                     "(group %s) never completes, send its body by hand", name, task_id,
                     type(backend).__name__, chord.get("group"))
        return
    request = Context(id=task_id, group=chord.get("group"), group_index=chord.get("group_index"),
                      chord=body, task=name, delivery_info={})
    backend.on_chord_part_return(request, state, value)


def _recorded(store: Any, task_id: str | None) -> bool:
    """True when ``task_id`` has a lease record (a leased task recorded at its publish)."""
    return bool(task_id) and store.get(task_id) is not None
