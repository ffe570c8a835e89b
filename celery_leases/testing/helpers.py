"""Helpers for tests of leased tasks: configure an app, wait for, expire and take leases.

Plain functions, each taking your app; they talk to the app's lease store
(``celery_leases.store(app)``) and import nothing heavy until called.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping

from .servers import wait_for

if TYPE_CHECKING:
    from ..protocol.records import LeaseRecord, RecoveryReport
    from ..protocol.store import LeaseStore

__all__ = ["configure", "wait_for_lease", "expire_lease", "run_recovery", "make_stale", "undo_patches"]


def configure(app: Any, conf: Mapping[str, Any]) -> Any:
    """Apply ``conf`` to ``app.conf`` and drop what celery-leases cached for the app.

    celery-leases reads its settings once per app and keeps one LeaseStore per
    app and process; after a change of ``leases_*`` settings (a new test's key
    prefix) both must be built again. Call it before the app's first broker
    connection if ``conf`` changes the broker. Returns ``app``.
    """
    from .. import config, runtime

    app.conf.update(dict(conf))
    config._configs.pop(app, None)
    entry = runtime._stores.pop(app, None)
    if entry is not None:
        try:
            entry[1].client.close()
        except Exception:  # noqa: BLE001 - an old connection we no longer use
            pass
    return app


def _store(app: Any) -> "LeaseStore":
    from ..install import store
    return store(app)


def wait_for_lease(app: Any, task_id: str, timeout: float = 10.0) -> "LeaseRecord":
    """Wait until a worker owns ``task_id``'s lease; return the record (``.token``, ``.owner``).

    A worker acquires the lease when it receives the message, just before the
    body starts. AssertionError after ``timeout`` seconds.
    """
    store = _store(app)

    def owned() -> Any:
        record = store.get(task_id)
        return record if record is not None and record.state == "active" and record.owner else None

    return wait_for(owned, timeout, f"a worker to own the lease of task {task_id} "
                                 f"(prefix {store.keys.prefix})")


def expire_lease(app: Any, task_id: str) -> bool:
    """Make ``task_id``'s lease due now, as if its ttl had run out; False if it is not indexed.

    Uses ``celery_leases.protocol.admin.expire_now``: the next recovery pass (or a redelivered
    copy) takes the lease. An owner whose heartbeat still runs renews it at its
    next tick, so expire the lease of a paused or killed worker, or use
    :func:`make_stale` to expire and claim it at once.
    """
    from ..protocol.admin import expire_now  # here: importing the plugin stays cheap
    return expire_now(_store(app), task_id)


def run_recovery(app: Any) -> "RecoveryReport":
    """Run one recovery pass for ``app`` now and return its report (``recovered``, ``dead``)."""
    return _store(app).recover()


def make_stale(app: Any, task_id: str, attempts: int = 5) -> "RecoveryReport":
    """Take ``task_id``'s lease from its current owner: expire it and run a recovery pass.

    The task is re-published under the same id with a new generation (or
    declared dead past its max recoveries); the owner keeps running but is now
    stale: its outcome will be refused and its ``self.lease.lost`` becomes
    True. Works on a running owner too: if its heartbeat renews the lease
    between the two steps, both are repeated (up to ``attempts`` times).
    Returns the report of the pass(es). LookupError when there is no lease,
    ValueError when it is not active (nobody owns it).
    """
    from ..protocol.admin import expire_now
    from ..protocol.records import RecoveryReport

    store = _store(app)
    before = store.get(task_id)
    if before is None:
        raise LookupError(f"make_stale: no lease for task {task_id} under prefix "
                          f"{store.keys.prefix!r}; no worker received it yet (wait_for_lease)")
    if before.state != "active":
        raise ValueError(f"make_stale: the lease of task {task_id} is {before.state!r}; only an "
                         "active lease has an owner to make stale")
    # A running owner's body is charged a recovery only once the store knows it
    # started (the start mark its worker's heartbeat sends within milliseconds);
    # a lease still not marked after a moment belongs to a task that only waits.
    started_by = time.monotonic() + 2.0
    while not before.started and time.monotonic() < started_by:
        time.sleep(0.01)
        current = store.get(task_id)
        if current is None or current.state != "active" or current.token != before.token:
            break
        before = current
    report = RecoveryReport()
    for _ in range(attempts):
        expire_now(store, task_id)
        report += store.recover()
        after = store.get(task_id)
        if (after is None or after.state != "active" or after.token != before.token
                or after.generation != before.generation):
            return report
    raise AssertionError(f"make_stale: task {task_id} kept its lease through {attempts} "
                         "expire-and-recover attempts (its owner renewed it each time)")


def undo_patches() -> list[str]:
    """Put back every change celery-leases made to Celery's and kombu's code in this process
    (celery_leases/patches.py), and return their names. For a test process that must end
    with Celery and kombu as they ship; apps installed before keep their own wrapped
    ``send_task`` until they are closed."""
    from .. import patches
    names = patches.installed()
    patches.undo_all()
    return names
