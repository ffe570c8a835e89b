"""Revokes: every way Celery 5.7 revokes a task reaches the lease, and REVOKED is
stored only when the lease agrees.

Celery revokes a task on these paths, all in the worker's main process:

- ``Request._announce_revoked``: a delivery found revoked or expired (at
  receipt, or when it is due), and ``terminate`` on prefork. Overridden in
  ``LeasedRequest``, which asks the store first.
- ``celery.worker.control._revoke`` stores REVOKED with
  ``backend.mark_as_revoked`` for a request this worker holds but has not
  started (prefetched, or waiting for its ETA) and for ids it does not hold
  at all, without announcing anything. :func:`gate_backend` puts the store's
  decision in front of that write.
- ``_revoke`` skips a request that is running here: a plain revoke does not
  stop it in Celery. :func:`install_control_hook` tells the store, so the
  run's own outcome stands but nobody runs the task after it.
- ``terminate`` on a pool that cannot terminate (threads, solo) raises before
  anything is announced; ``LeasedRequest.terminate`` handles it as the plain
  revoke it is.

The store answers OK (REVOKED may be stored), FINISHED (the task finished: its
stored result stays) or BUSY (another owner runs it: its outcome stands). When
the store is unreachable the revoke still happens in Celery as usual and is
remembered here, retried until the store answers (:class:`HeldRevokes`). A worker's
revokes go through its :class:`Revoker`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from functools import cached_property
from typing import Any, Callable

from celery import states
from celery.worker.state import active_requests

from .. import patches
from ..config import LeaseConfig
from ..exceptions import LeaseError, LeaseUnavailable
from ..protocol.codes import Code
from ..protocol.store import LeaseStore
from ..runtime import get_worker, is_decided
from .heartbeat import Heartbeat

logger = logging.getLogger("celery_leases.worker")

def gate_backend(backend: Any, decide: Callable[[str], bool]) -> None:
    """Make ``backend.mark_as_revoked`` store REVOKED only when ``decide(task_id)`` says so.

    Patched on the instance, not the class: the type stays Celery's own (the
    fused result write checks it), and other apps' backends are untouched.
    """
    if getattr(backend, "_celery_leases_gate", False):
        return
    original = backend.mark_as_revoked

    def mark_as_revoked(task_id: str, reason: str = "", request: Any = None,
                        store_result: bool = True, state: str = states.REVOKED) -> Any:
        if not is_decided(task_id) and not decide(task_id):
            return None
        return original(task_id, reason, request=request, store_result=store_result, state=state)

    backend.mark_as_revoked = mark_as_revoked
    backend._celery_leases_gate = True


def install_control_hook() -> None:
    """Tell the lease about a plain revoke of a task running in this worker.

    Celery's ``revoke`` remote-control command skips running requests (they
    are not stopped); the worker of the command's app is told of each id first
    (``Revoker.revoke_running``). Registered once per process, in Celery's
    own command registry.
    """
    from celery.worker import control  # loaded by workers only: install(app) runs in clients too

    current = control.Panel.data.get("revoke")
    if current is None or getattr(current, "_celery_leases_hook", False):
        return

    def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None,
               **kwargs: Any) -> Any:
        worker = get_worker(state.app) if not terminate and hasattr(state, "app") else None
        if worker is not None:
            from celery.utils.functional import maybe_list
            for one in set(maybe_list(task_id) or []):
                try:
                    worker.revokes.revoke_running(one)
                except Exception:  # noqa: BLE001 - never break Celery's revoke
                    logger.exception("task %s: the revoke could not be passed to its lease", one)
        return current(state, task_id, terminate=terminate, signal=signal, **kwargs)

    revoke._celery_leases_hook = True  # type: ignore[attr-defined]
    revoke.__doc__ = current.__doc__
    patches.patch_item("celery.worker.control.Panel[revoke]", control.Panel.data, "revoke", revoke)


class HeldRevokes:
    """Revokes the store could not take (unreachable), retried every ``delay`` seconds.

    Celery has already revoked the task (REVOKED stored, the delivery dropped,
    the id in its revoked set), so this only makes the lease agree: until then
    a copy of the task that reaches this worker is discarded by Celery's
    revoked set before any acquire, and one that reaches another live worker
    is discarded by that worker's set (revokes are broadcast). At most ``limit``
    are held; past it the oldest is dropped with an error naming it.
    """

    def __init__(self, apply: Callable[..., Code], delay: float, limit: int = 10_000) -> None:
        self._apply, self.delay, self.limit = apply, delay, limit
        self._held: "OrderedDict[str, dict]" = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since: float | None = None

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._held

    def add(self, task_id: str, exc: Exception, **call: Any) -> None:
        with self._lock:
            first = not self._held
            self._held[task_id] = call
            self._held.move_to_end(task_id)
            while len(self._held) > self.limit:
                dropped, _ = self._held.popitem(last=False)
                logger.error("task %s: a revoke held back for the unreachable lease store was "
                             "dropped (more than %d held); its lease was not revoked", dropped, self.limit)
            if first:
                self._since = time.monotonic()
                logger.warning("lease store unreachable during a revoke of task %s (%s): Celery "
                               "revoked it as usual; the lease is revoked once the store answers "
                               "(tried every %.1fs)", task_id, exc, self.delay)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="celery-leases-revokes",
                                                daemon=True)
                self._thread.start()

    def retry(self) -> int:
        """Try every held revoke once; the number still held."""
        with self._lock:
            items = list(self._held.items())
        applied = 0
        for task_id, call in items:
            try:
                code = self._apply(task_id, **call)
            except LeaseUnavailable:
                break  # still down: try again after the delay
            except LeaseError as exc:
                logger.error("task %s: held-back revoke not applied to its lease: %s", task_id, exc)
            else:
                applied += 1
                if code is Code.FINISHED:
                    logger.warning("task %s: revoked while the lease store was unreachable, but the "
                                   "lease says it had finished; REVOKED was already stored", task_id)
            with self._lock:
                if self._held.get(task_id) is call:
                    del self._held[task_id]
        with self._lock:
            left = len(self._held)
            if not left and applied and self._since is not None:
                logger.warning("lease store back: %d held-back revoke(s) applied to their leases "
                               "after %.1fs", applied, time.monotonic() - self._since)
                self._since = None
        return left

    def _run(self) -> None:
        while not self._stop.wait(self.delay):
            try:
                if self.retry() == 0:
                    with self._lock:
                        if not self._held:
                            self._thread = None
                            return
            except Exception:  # noqa: BLE001 - logged; this thread keeps trying
                logger.exception("celery-leases: retrying held-back revokes failed; trying again")

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._held:
                logger.error("celery-leases: %d revoke(s) never reached the lease store: %s",
                             len(self._held), ", ".join(list(self._held)[:20]))


class Revoker:
    """The revokes of one worker process: each put to the lease, held back while the store is away."""

    def __init__(self, app: Any, config: LeaseConfig, store: LeaseStore, owner: str,
                 heartbeat: Heartbeat) -> None:
        self.app, self.config, self.store, self.owner, self.heartbeat = app, config, store, owner, heartbeat

    def gate(self, backend: Any = None) -> None:
        """Every revoke path of Celery reaches the lease: the backends this process stores
        REVOKED with ask the store first, and so does the revoke command."""
        if backend is not None:
            gate_backend(backend, self.revoke_stored)
            return
        gate_backend(self.app.backend, self.revoke_stored)
        for task in list(self.app.tasks.values()):
            if getattr(task, "leased", False) and getattr(task, "_backend", None) is not None:
                gate_backend(task._backend, self.revoke_stored)
        install_control_hook()

    def stop(self) -> None:
        if "held" in self.__dict__:
            self.held.stop()

    @cached_property
    def held(self) -> HeldRevokes:
        """Revokes the store could not take yet (unreachable), retried until it answers."""
        return HeldRevokes(self.store.revoke, self.config.unavailable_retry_delay)

    def revoke(self, task_id: str, *, expired: bool = False, owner: str = "",
               token: int | None = None, name: str = "") -> bool:
        """Put a Celery revoke (or, ``expired``, an expiry) to the lease; True when Celery
        may store REVOKED.

        ``owner``/``token``: this worker's own lease of the delivery being
        discarded or terminated. False when the task finished (its stored
        result stays) or another owner runs it (its outcome stands). The store
        unreachable: True, as Celery revokes regardless, and the revoke is held
        and retried until the store answers.
        """
        if token is not None:
            self.heartbeat.forget(task_id, token)
        call: dict[str, Any] = dict(expired=expired, owner=owner if token is not None else "",
                    token=token or 0, name=name)
        try:
            code = self.store.revoke(task_id, **call)
        except LeaseUnavailable as exc:
            self.held.add(task_id, exc, **call)
            return True
        except LeaseError as exc:
            logger.error("task %s: revoke not applied to its lease: %s; Celery revokes it as usual",
                         task_id, exc)
            return True
        except Exception:  # noqa: BLE001 - called from inside Celery's revoke: never break it
            logger.exception("task %s: revoke not applied to its lease; Celery revokes it as usual",
                             task_id)
            return True
        if code is Code.OK:
            return True
        if code is Code.FINISHED:
            logger.info("task %s: revoke of a task that already finished: its stored result stays",
                        task_id)
        elif expired:
            logger.info("task %s: expired copy not run; another owner started the task in time "
                        "and its outcome stands", task_id)
        else:
            logger.info("task %s: revoked while another owner runs it: that run's outcome stands, "
                        "and the task will not run again", task_id)
        return False

    def revoke_stored(self, task_id: str) -> bool:
        """Celery's revoke command is about to store REVOKED for a task not running here
        (prefetched, ETA-held, or not held by this worker); True to let it."""
        held = self.heartbeat.held.get(task_id)
        request = held.request if held is not None else None
        if held is not None and not held.lost and request is not None \
                and request not in active_requests:
            return self.revoke(task_id, owner=self.owner, token=held.token, name=request.name)
        return self.revoke(task_id)

    def revoke_running(self, task_id: str) -> None:
        """A plain revoke of ``task_id`` (Celery's revoke command, before it runs): a leased
        request running here is not stopped, but the lease must remember the revoke."""
        request = next((r for r in list(active_requests) if r.id == task_id), None)
        if request is not None and getattr(request.task, "leased", False):
            self.revoke(task_id, name=request.name)
