"""Per-app, per-process objects: the LeaseStore and the worker's lease registry.

A prefork child inherits the parent's memory; every cache here is keyed by
process id so a child builds its own Redis connections and never sees the
main process's registry.
"""
from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .config import LeaseConfig, client_config
from .protocol.connection import connect, redact, url_error
from .exceptions import ConfigurationError
from .protocol.store import LeaseStore
from .recovery.recoverer import Recoverer

_stores: "weakref.WeakKeyDictionary[Any, tuple[int, LeaseStore]]" = weakref.WeakKeyDictionary()
#: The worker's LeaseWorker (worker/service.py), typed Any: this module sits below the worker wiring.
_workers: "weakref.WeakKeyDictionary[Any, tuple[int, Any]]" = weakref.WeakKeyDictionary()


def make_store(config: LeaseConfig, **kwargs: Any) -> LeaseStore:
    try:
        client = connect(config.redis_url, transport_options=config.redis_transport_options,
                         socket_timeout=max(2.0, config.ttl / 3),
                         socket_connect_timeout=max(2.0, config.ttl / 3), health_check_interval=30)
    except ConfigurationError:
        raise
    except ValueError as exc:  # redis-py's URL parser: a bad port, a bad query option
        raise ConfigurationError(
            f"leases_redis_url {redact(config.redis_url)} {url_error(config.redis_url, exc)}") from None
    return LeaseStore(client, config.key_prefix, ttl=config.ttl, retention=config.retention,
                      max_recoveries=config.max_recoveries, publish_grace=config.publish_grace,
                      recover_batch=config.recover_batch, shards=config.shards, **kwargs)


#: Called with (app, store) for each store get_store builds: the layers above add their
#: steps to its recovery passes this way (publish tracking, publishing/tracking.py), unseen from here.
_store_hooks: list[Callable[[Any, LeaseStore], None]] = []


def on_new_store(hook: Callable[[Any, LeaseStore], None]) -> None:
    """Run ``hook(app, store)`` for every store get_store builds from now on."""
    if hook not in _store_hooks:
        _store_hooks.append(hook)


def get_store(app: Any) -> LeaseStore:
    """This process's LeaseStore for ``app`` (with the app's recovery publisher bound)."""
    pid = os.getpid()
    entry = _stores.get(app)
    if entry is None or entry[0] != pid:
        config = client_config(app)
        recoverer = Recoverer(app, dead_letter_queue=config.dead_letter_queue)
        store = make_store(config, publish=recoverer.publish, on_dead=recoverer.on_dead,
                           on_corrupt=recoverer.on_corrupt)
        recoverer.store = store  # it parks, and reads held_for, through the store that calls it
        for hook in _store_hooks:
            hook(app, store)
        _stores[app] = entry = (pid, store)
    return entry[1]


def has_store(app: Any) -> bool:
    """True once this process built ``app``'s LeaseStore (from the settings of that moment)."""
    entry = _stores.get(app)
    return entry is not None and entry[0] == os.getpid()


def set_worker(app: Any, worker: Any) -> None:
    if worker is None:
        _workers.pop(app, None)
    else:
        _workers[app] = (os.getpid(), worker)


def get_worker(app: Any) -> Any:
    """The LeaseWorker of this process (the worker's main process), else None."""
    entry = _workers.get(app)
    if entry is None or entry[0] != os.getpid():
        return None
    return entry[1]


#: The task id whose revoke the announce path already put to the store (per thread).
_decided = threading.local()


@contextmanager
def decided(task_id: str) -> Iterator[None]:
    """Celery's own announce runs inside this: its REVOKED write is not asked about again
    (worker/revokes.py's gate of the backend reads it)."""
    previous = getattr(_decided, "task_id", None)
    _decided.task_id = task_id
    try:
        yield
    finally:
        _decided.task_id = previous


def is_decided(task_id: str) -> bool:
    """True inside ``decided(task_id)`` on this thread."""
    return getattr(_decided, "task_id", None) == task_id
