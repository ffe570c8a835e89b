"""Bootsteps and signal handlers: when the worker's lease services start and stop.

Thin on purpose, in the shape of Celery's own ``worker/consumer/heart.py``:
each step is an on/off switch and an ordering, and hands its service what it
needs. What the services do is in service.py, heartbeat.py, recovery/fallback.py,
receipt.py and health.py.

- ``HealthStep`` (worker): the HTTP probes and the health file (health.py), when
  ``leases_http_port`` or ``leases_health_file`` is set; ``LeaseStep`` requires it, so it
  is registered with it and started before it;
- ``LeaseStep`` (worker): builds the ``LeaseWorker`` once the pool exists and
  starts it, blocking the worker's start until the store answers;
- ``HeartbeatStep`` (worker): starts the renewal thread;
- ``RecoveryStep`` (worker): runs the fallback recovery (``leases_worker_recovery``);
- ``OutboxStep`` (worker): runs the outbox relay (``leases_outbox_url``);
- ``LeaseConsumerStep`` (consumer): releases the leases of requests the
  consumer dropped (broker reconnect, shutdown);
- ``task_received``: the acquire at receipt; ``worker_process_init``: a pool
  child reads the store's clock; ``worker_shutdown``: releases the rest.
"""
from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery import current_app
from celery.signals import task_received, worker_process_init, worker_shutdown
from celery.worker.components import Pool

from ..protocol.clock import server_clock
from ..config import get_config
from ..exceptions import ConfigurationError, LeaseError, LeaseUnavailable
from ..runtime import get_store, get_worker, set_worker
from . import held
from ..outbox.relay import Relay
from ..recovery.fallback import FallbackRecovery
from .health import Health
from .isolation import Isolation, shares_process
from .loop import LoopWatch
from .service import LeaseWorker
from .startup import EX_CONFIG, EX_UNAVAILABLE, refuse, refuse_if_misconfigured, wait_for_store

logger = logging.getLogger("celery_leases.worker")

__all__ = ["HealthStep", "LeaseStep", "HeartbeatStep", "RecoveryStep", "OutboxStep", "LeaseConsumerStep"]

#: Pools whose event loop does not run task bodies: there the acquire is sent without waiting.
_ASYNC_ACQUIRE_POOLS = ("celery.concurrency.prefork", "celery.concurrency.thread")


class HealthStep(bootsteps.StartStopStep):
    """Worker bootstep: ``/livez``, ``/readyz``, ``/metrics`` and the health file (health.py).

    Built once the pool exists but before it forks (prefork's metrics need that), started
    before ``LeaseStep`` so that probes answer while the worker waits for the lease store,
    and stopped at ``worker_shutdown``, once the pool is gone: a warm shutdown that waits
    for running tasks still answers its probes.
    """

    label = "Leases health"
    # The class, not its name: a step only another step requires is never given its names'
    # classes by Celery (bootsteps.Blueprint._firstpass).
    requires = (Pool,)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.health: Health | None = None

    def create(self, w: Any) -> "HealthStep":
        try:
            config = get_config(w.app)
            if config.http_port is not None or config.health_file is not None:
                self.health = Health(w.app, w, config,
                                     prefork=type(w.pool).__module__ == "celery.concurrency.prefork")
        except ConfigurationError:
            pass  # LeaseStep's start reports it and stops the worker
        except Exception:  # noqa: BLE001 - nothing may raise in a create; the worker runs without probes
            logger.exception("celery-leases: the health probes could not be set up; the worker runs without them")
        return self

    def start(self, w: Any) -> None:
        if self.health is not None:
            self.health.start()
            worker_shutdown.connect(self._on_worker_shutdown, sender=w, weak=False)

    def stop(self, w: Any) -> None:
        pass  # at worker_shutdown: probes answer while the pool finishes its tasks

    terminate = stop

    def _on_worker_shutdown(self, sender: Any = None, **kwargs: Any) -> None:
        if self.health is not None:
            self.health.stop()


class LeaseStep(bootsteps.StartStopStep):
    """Worker bootstep: builds the LeaseWorker and starts it."""

    label = "Leases"
    requires = ("celery.worker.components:Pool", HealthStep)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.lease_worker: LeaseWorker | None = None
        self.loop: LoopWatch | None = None
        self.isolation: Isolation | None = None

    def create(self, w: Any) -> "LeaseStep":
        # Nothing here may raise: an exception in a bootstep's create escapes
        # WorkController.__init__ as a traceback. A broken setting is reported
        # once by the start-up check (startup.py), which stops the worker.
        try:
            self.lease_worker = self._build(w)
        except (ConfigurationError, LeaseUnavailable):
            self.lease_worker = None  # start() reports it, or waits for the store
        return self

    def _build(self, w: Any) -> LeaseWorker:
        config = get_config(w.app)
        # The acquire waits for Redis only where the event loop does not run
        # task bodies: prefork and threads. Elsewhere (solo, gevent, eventlet,
        # a transport without a loop) it stays a blocking call at receipt.
        pool_module = type(w.pool).__module__
        loop_hub = getattr(w, "hub", None) if getattr(w, "use_eventloop", False) else None
        hub = loop_hub if pool_module in _ASYNC_ACQUIRE_POOLS else None
        # Every pool with an event loop has it watched (loop.py); solo runs bodies in it. Built
        # once per step: _build runs again at start when the store was away at create.
        if self.loop is None and loop_hub is not None:
            self.loop = LoopWatch(loop_hub, runs_bodies=pool_module == "celery.concurrency.solo")
        loop = self.loop
        # A pool whose tasks share one process gets the isolation gate, once per pool and
        # before the consumer makes its request classes (they take pool.apply_async).
        if self.isolation is None and shares_process(w.pool):
            self.isolation = Isolation(w.pool)
            self.isolation.install()
        # Before the consumer opens its channel: deliveries of recorded tasks held by their lease.
        if config.held_deliveries and config.delivery_timeout and _redis_broker(w.app) and held.install():
            logger.info("celery-leases: deliveries of tasks recorded at publish are held by their "
                        "lease, not by kombu's unacked hash (leases_held_deliveries)")
        lease_worker = LeaseWorker(w.app, config, pool=w.pool, hostname=w.hostname, hub=hub,
                                   quick_release=getattr(w, "_quick_release", None),
                                   prefork=pool_module == "celery.concurrency.prefork", loop=loop,
                                   isolation=self.isolation)
        set_worker(w.app, lease_worker)
        return lease_worker

    def start(self, w: Any) -> None:
        # Blocks the worker's start sequence: the consumer (started last) receives nothing
        # until the configuration passed and the lease store answered.
        refuse_if_misconfigured(w.app)
        try:
            if self.lease_worker is None:  # the store's client could not be built (a cluster down)
                wait_for_store(w.app, lambda: get_store(w.app).server_time_ms())
                self.lease_worker = self._build(w)
            self.lease_worker.start()
        except ConfigurationError as exc:  # what only building the client finds (a URL that does not parse)
            refuse(str(exc), EX_CONFIG)
        except LeaseUnavailable as exc:
            refuse(str(exc), EX_UNAVAILABLE)

    def stop(self, w: Any) -> None:
        # Warm shutdown: running tasks are still finishing in the pool, so the
        # heartbeat keeps going; worker_shutdown (after the pool) releases the rest.
        pass

    def terminate(self, w: Any) -> None:
        if self.lease_worker is not None:
            self.lease_worker.stop()


def _redis_broker(app: Any) -> bool:
    """True when the app's broker is kombu's Redis transport (redis, rediss, sentinel, unix socket)."""
    try:
        transport = app.connection_for_read().transport
    except Exception:  # noqa: BLE001 - an unusable broker URL is Celery's to report
        return False
    return type(transport).__module__ == "kombu.transport.redis"


class HeartbeatStep(bootsteps.StartStopStep):
    """Worker bootstep: starts the thread that renews every held lease (heartbeat.py).

    Started once the LeaseWorker is; never stopped by this step: tasks still
    finishing at a warm shutdown need their renewals, so the heartbeat stops
    after the last release (``LeaseWorker.stop``, at ``worker_shutdown``).
    """

    label = "Leases heartbeat"
    requires = (LeaseStep,)

    def start(self, w: Any) -> None:
        lease_worker = get_worker(w.app)
        if lease_worker is not None:
            lease_worker.heartbeat.start()


class RecoveryStep(bootsteps.StartStopStep):
    """Worker bootstep: the fallback recovery thread (recovery/fallback.py), when
    ``leases_worker_recovery`` is on."""

    label = "Leases recovery"
    requires = (LeaseStep,)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.recovery: FallbackRecovery | None = None

    def start(self, w: Any) -> None:
        lease_worker = get_worker(w.app)
        if lease_worker is None or not lease_worker.config.worker_recovery:
            return
        self.recovery = FallbackRecovery(lease_worker.store, lease_worker.owner,
                                         lease_worker.config.recovery_interval, sender=w.app)
        self.recovery.start()

    def stop(self, w: Any) -> None:
        if self.recovery is not None:
            self.recovery.stop()

    terminate = stop


class OutboxStep(bootsteps.StartStopStep):
    """Worker bootstep: the outbox relay thread (celery_leases/outbox/relay.py), when
    ``leases_outbox_url`` names a database."""

    label = "Leases outbox relay"
    requires = (LeaseStep,)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        self.relay: Relay | None = None

    def start(self, w: Any) -> None:
        lease_worker = get_worker(w.app)
        if lease_worker is None or not lease_worker.config.outbox_url:
            return
        config = lease_worker.config
        # A green pool's loop would stall in a blocking LISTEN wait: there the relay polls.
        green = type(w.pool).__module__ in ("celery.concurrency.gevent", "celery.concurrency.eventlet")
        self.relay = Relay(w.app, config.outbox_url, config.outbox_table, config.outbox_poll_interval,
                           listen=not green)
        self.relay.start()

    def stop(self, w: Any) -> None:
        if self.relay is not None:
            self.relay.stop()

    terminate = stop


class LeaseConsumerStep(bootsteps.StartStopStep):
    """Consumer bootstep: stopped whenever the consumer restarts (broker reconnect) or
    shuts down, right after Celery dropped the requests it had not started."""

    label = "Leases (consumer)"

    def start(self, c: Any) -> None:
        worker = get_worker(c.app)
        if worker is not None:
            worker.dropped.watch(c.pool)  # the pool has started: prefork's flush exists now

    def stop(self, c: Any) -> None:
        worker = get_worker(c.app)
        if worker is not None:
            worker.release_dropped()

    shutdown = stop


@task_received.connect
def _on_task_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    task = getattr(request, "task", None)
    if task is None or not getattr(task, "leased", False):
        return
    worker = get_worker(task.app)
    if worker is not None:
        worker.receipt.on_received(request)


@worker_process_init.connect
def _on_worker_process_init(sender: Any = None, **kwargs: Any) -> None:
    """A prefork child reads the store's clock before its first finish needs it (settle.py),
    so a store that stalls during that finish does not find it without a reading."""
    app = current_app._get_current_object()
    if not getattr(app, "_celery_leases_installed", False):
        return
    try:
        server_clock(get_store(app)).fresh()  # a store away now: the first finish reads it
    except LeaseError as exc:
        logger.debug("celery-leases: pool process could not read the store's clock: %s", exc)


@worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **kwargs: Any) -> None:
    app = getattr(sender, "app", None)
    worker = get_worker(app) if app is not None else None
    if worker is not None:
        # The pool has finished: each record says whether what is still held ever started.
        worker.stop()
        set_worker(app, None)
    held.uninstall()
