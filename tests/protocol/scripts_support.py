"""What the store's script tests share: constants, helpers and a recorder of recovery claims."""
from __future__ import annotations

import time
from pathlib import Path

from celery_leases import Claim, LeaseStore


TTL = 5.0          #: seconds; long enough that a lease is live for the whole test
SHORT = 0.1        #: seconds; a ttl the test waits out
MARGIN = 0.05      #: seconds slept past a deadline before calling it passed
A, B, C = "worker-a", "worker-b", "worker-c"
BODY = b'[["x"], {}, {}]'
ENVELOPE = {"routing_key": "celery", "headers": {"task": "proj.add"}}
REPO = Path(__file__).resolve().parents[2]


def wait_out(ttl: float = SHORT) -> None:
    """Let a lease acquired or renewed with ``ttl`` pass its deadline (server clock)."""
    time.sleep(ttl + MARGIN)


def acquire(store: LeaseStore, task_id: str, owner: str = A, *, started: bool = True, **kwargs):
    """Acquire, and (``started``) send the start mark the worker sends when the body starts."""
    kwargs.setdefault("name", "proj.add")
    kwargs.setdefault("body", BODY)
    kwargs.setdefault("envelope", ENVELOPE)
    acq = store.acquire(task_id, owner, **kwargs)
    if started and acq.owned:
        assert store.mark_started(owner, {task_id: acq.token}) == 1
    return acq


def fields(store: LeaseStore, task_id: str) -> dict:
    raw = store.client.hgetall(store.keys.record(task_id))
    return {k.decode(): v for k, v in raw.items()}


def pttl(store: LeaseStore, task_id: str) -> int:
    return store.client.pttl(store.keys.record(task_id))


def indexed(store: LeaseStore) -> dict:
    return dict(store.active())


class Recorder:
    """A publish / on_dead pair that records the claims it is handed."""

    def __init__(self, fail: bool = False):
        self.published: list[Claim] = []
        self.dead: list[Claim] = []
        self.fail = fail

    def publish(self, claim: Claim) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.published.append(claim)

    def on_dead(self, claim: Claim) -> None:
        self.dead.append(claim)


