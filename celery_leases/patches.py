"""Every change celery-leases makes to Celery's and kombu's own code, in one place.

Process-wide changes (a class's or a module's attribute, an entry of a registry
dict) go through ``patch`` / ``patch_item``, which install each once per process
and keep the original, so ``undo_all`` (``celery_leases.testing.undo_patches``)
puts everything back. They are:

========================================  =======================================  ==============================
name                                      installed by                             why
========================================  =======================================  ==============================
``kombu.messaging.dumps``                 ``install(app)`` (publishing/serialize)  the body serialized once
``celery.canvas.group._apply_tasks``      ``install(app)`` (publishing/batches)    a group's records in one batch
``kombu.transport.redis.Channel._put``    an app's first recorded publish          the one-call publish
                                          (publishing/one_call.py)                 (record and LPUSH together)
``kombu.transport.redis.Channel.QoS``     the worker's ``LeaseStep``               lease-held deliveries
                                          (worker/held.py)                         (no kombu ``unacked`` copy)
``celery.worker.control.Panel[revoke]``   the worker (worker/revokes.py)           a plain revoke reaches the lease
``celery.bin.base.CLIContext.pretty``     Celery's command line, importing the     ``celery inspect leases``
                                          package's ``celery.commands`` entry      prints tables
                                          point (cli/__init__.py)
========================================  =======================================  ==============================

Changes of one object belong to it and end with it: an app's ``send_task``
(publishing/tracking.py), a result backend's ``mark_as_revoked`` (worker/revokes.py), a
worker's pool's ``apply_async`` (worker/isolation.py).
"""
from __future__ import annotations

import threading
from typing import Any, MutableMapping

__all__ = ["patch", "patch_item", "undo", "undo_all", "installed"]

_lock = threading.Lock()
#: name -> (owner, attribute or key, original, whether it is a mapping item)
_patches: dict[str, tuple[Any, Any, Any, bool]] = {}


def patch(name: str, owner: Any, attribute: str, replacement: Any) -> bool:
    """Set ``owner.attribute`` to ``replacement`` unless ``name`` is installed; True if it was now."""
    with _lock:
        if name in _patches:
            return False
        _patches[name] = (owner, attribute, getattr(owner, attribute), False)
        setattr(owner, attribute, replacement)
        return True


def patch_item(name: str, mapping: MutableMapping, key: Any, replacement: Any) -> bool:
    """Set ``mapping[key]`` to ``replacement`` unless ``name`` is installed; True if it was now."""
    with _lock:
        if name in _patches:
            return False
        _patches[name] = (mapping, key, mapping.get(key), True)
        mapping[key] = replacement
        return True


def original(name: str) -> Any:
    """What ``name`` replaced (None when it is not installed)."""
    entry = _patches.get(name)
    return entry[2] if entry is not None else None


def undo(name: str) -> None:
    """Put back what ``name`` replaced (objects made meanwhile keep what they took)."""
    with _lock:
        entry = _patches.pop(name, None)
    if entry is None:
        return
    owner, attribute, was, item = entry
    if item:
        owner[attribute] = was
    else:
        setattr(owner, attribute, was)


def undo_all() -> None:
    for name in list(_patches):
        undo(name)


def installed() -> list[str]:
    return sorted(_patches)
