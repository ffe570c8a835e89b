"""Which pools finish a success nobody reads without waiting, and how (background.py):

- prefork: the main process, in its acquirer's writes (worker/acquirer.py);
- a threads pool of more than one thread: a thread of its own;
- solo: riding with the next acquire, and sent before any other body starts.

Everywhere else (a threads pool of one, the green pools, a loop-less worker)
every finish is waited for.
"""
from __future__ import annotations

import logging
from typing import Any

from ..protocol.store import LeaseStore
from .background import BackgroundFinishes
from .isolation import shares_process

logger = logging.getLogger("celery_leases.worker")

__all__ = ["for_pool", "before_each_body", "POOLS", "SOLO", "PREFORK"]


#: The pools whose finishes may go out from a thread (with more than one task at a
#: time in the process: isolation.shares_process).
POOLS = frozenset({"celery.concurrency.thread"})
#: The pool whose finishes ride with its next acquire (with an event loop: loop.py).
SOLO = "celery.concurrency.solo"
#: The pool whose main process finishes its children's unread successes, in the writes of
#: its acquirer (worker/acquirer.py).
PREFORK = "celery.concurrency.prefork"


def for_pool(store: LeaseStore, pool: Any, loop: Any = None, acquirer: Any = None) -> BackgroundFinishes | None:
    """The finishes nobody waits for of a worker with ``pool`` (``loop``: its LoopWatch, if
    it has an event loop; ``acquirer``: its acquires sent without waiting, if any), or None
    where every finish stays waited for."""
    module = type(pool).__module__
    if module in POOLS and shares_process(pool):
        return BackgroundFinishes(store)
    if module == SOLO and loop is not None and loop.runs_bodies:
        return BackgroundFinishes(store, hub=loop.hub)
    if module == PREFORK and acquirer is not None:
        finishes = BackgroundFinishes(store, hub=acquirer.hub)
        finishes.carrier = acquirer
        return finishes
    return None


def before_each_body(pool: Any, finishes: BackgroundFinishes) -> None:
    """On the solo pool, no body (leased or plain, an ETA's too) starts while a finish queued
    before it is on its way: what the acquire did not carry goes out first. The pool's
    ``on_apply`` is where every job starts (Celery's BasePool.apply_async calls it)."""
    apply = pool.on_apply

    def on_apply(*args: Any, **kwargs: Any) -> Any:
        if finishes.queued:
            try:
                finishes.flush()
            except Exception:  # noqa: BLE001 - a bug: its finishes were withheld (reported)
                logger.exception("background finishes: the flush before a body failed unexpectedly")
        return apply(*args, **kwargs)

    pool.on_apply = on_apply
