"""Prometheus metrics fed by celery-leases' signals (extra: ``celery-leases[prometheus]``).

    from celery_leases.metrics import enable_prometheus
    app.conf.leases_http_port = 9808   # the worker serves /metrics (and /livez, /readyz) here
    enable_prometheus(app)             # in the app module, next to install(app)

``enable_prometheus`` starts no server: it connects the signals and hands the
metrics to the worker's HTTP endpoint (worker/health.py), which only a
worker's main process serves. So the call is safe where every process runs it
(the app module: the CLI, beat, a web tier).

Counters count what the signals report **in the process they happen in**:
acquisitions, renewals and lost leases in a worker's main process; refusals in
the process that ran the task (a prefork pool child, or the main process for
Celery's own writes); recoveries and dead tasks wherever the recovery pass ran
(a worker's fallback thread, or the pool child running beat's
``celery_leases.recover`` task). Under prefork the worker switches
prometheus_client to its multiprocess mode before the pool forks
(``prepare_worker``): each process writes its values to a directory of its
own (``PROMETHEUS_MULTIPROC_DIR`` if set, else a temporary one removed at
shutdown), and ``/metrics`` serves their sum. Cluster-wide lifetime totals are
in Redis: ``celery leases stats``.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from typing import Any

try:
    import prometheus_client
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the module
    raise ImportError(
        "celery_leases.ops.metrics needs the prometheus-client package: "
        "pip install 'celery-leases[prometheus]'") from exc
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from ..protocol.codes import OUTCOMES, Code
from ..signals import (callbacks_failed, delivery_parked, heartbeat_ticked, lease_acquired, lease_dead, lease_lost,
                      lease_recovered, leases_renewed, outbox_status, recovery_pass, stale_outcome_rejected,
                      result_written_by_recovery, undelivered_republished)
from ..worker.health import set_exporter

__all__ = ["enable_prometheus", "LeaseMetrics", "TIME_TO_RECOVERY_BUCKETS", "RENEW_BUCKETS"]

logger = logging.getLogger("celery_leases.metrics")

#: Buckets (seconds) of the time-to-recovery histogram: a lease's ttl plus a
#: recovery interval is the floor; long tasks that died late reach hours.
TIME_TO_RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)

#: Buckets (seconds) of one renew call's latency: a healthy local Redis answers in a
#: millisecond or two; past a second the heartbeat interval is at risk.
RENEW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

#: Label values created at start, so that rate() and increase() see the first
#: increment (a series born at 1 counts as no increase).
LOST_REASONS = tuple(code.words for code in (Code.LOST, Code.STALLED, Code.MISSING))
RECOVERY_PASS_RESULTS = ("ran", "skipped", "failed")

_enabled: "weakref.WeakKeyDictionary[Any, LeaseMetrics]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class LeaseMetrics:
    """The collectors of one app and the signal receivers that feed them."""

    def __init__(self, app: Any, registry: Any = None, namespace: str = "celery_leases") -> None:
        self.app = app
        self._registry = prometheus_client.REGISTRY if registry is None else registry
        self._namespace = namespace
        #: The multiprocess directory /metrics reads (prepare_worker), and the one this
        #: process made (removed by worker_stopped).
        self._multiprocess_dir: str | None = None
        self._own_dir: str | None = None
        self._owner_pid = os.getpid()
        self._served: Any = None
        self._build()
        self._receivers = [
            (lease_acquired, self._on_acquired), (leases_renewed, self._on_renewed),
            (lease_lost, self._on_lost), (lease_recovered, self._on_recovered),
            (lease_dead, self._on_dead), (stale_outcome_rejected, self._on_refused),
            (delivery_parked, self._on_parked),
            (callbacks_failed, self._on_callback_failed),
            (undelivered_republished, self._on_undelivered),
            (result_written_by_recovery, self._on_result_written),
            (heartbeat_ticked, self._on_tick), (recovery_pass, self._on_recovery_pass),
            (outbox_status, self._on_outbox_status),
        ]
        for signal, receiver in self._receivers:
            signal.connect(receiver, weak=False)
        set_exporter(app, self)

    def _build(self) -> None:
        """Create the collectors in the registry (again, once the value class changed)."""
        kw: dict[str, Any] = {"namespace": self._namespace, "registry": self._registry}
        C, H = prometheus_client.Counter, prometheus_client.Histogram
        self.acquired = C("acquired", "Deliveries that became the lease owner (taken_over: the "
                          "previous owner had expired).", ["taken_over"], **kw)
        self.renewed = C("renewed", "Leases renewed by heartbeat ticks (one per lease per tick).", **kw)
        self.lost = C("lost", "Held leases a heartbeat found lost, by reason.", ["reason"], **kw)
        self.recovered = C("recovered", "Tasks re-published by a recovery pass.", **kw)
        self.dead = C("dead", "Tasks declared dead after leases_max_recoveries.", **kw)
        self.refused = C("refused", "Outcomes of stale owners refused, by outcome.", ["outcome"], **kw)
        self.parked = C("parked", "Deliveries parked instead of run (a corrupt record, a malformed "
                        "message), by the field that was corrupt.", ["field"], **kw)
        self.callbacks_failed = C("callbacks_failed", "Link callbacks and next chain steps of an "
                                  "accepted success not sent after every try.", **kw)
        self.undelivered = C("undelivered_republished", "Queued tasks re-published because no worker "
                             "acquired them within leases_delivery_timeout.", **kw)
        self.results_written = C("results_written_by_recovery", "Results written by a recovery "
                                 "pass: the process that finished the task died before Celery "
                                 "stored its result.", **kw)
        self.time_to_recovery = H(
            "time_to_recovery_seconds", "From the last owner's acquisition of the lease to its "
            "re-publication by a recovery pass.", buckets=TIME_TO_RECOVERY_BUCKETS, **kw)
        self.renew_seconds = H(
            "renew_seconds", "Latency of one heartbeat renew call (all held leases of one tick), "
            "failed calls included.", buckets=RENEW_BUCKETS, **kw)
        self.renew_failures = C("renew_failures", "Heartbeat ticks whose renew call failed (the store "
                                "unreachable); their leases are tried again next tick.", **kw)
        self.held = prometheus_client.Gauge(
            "held", "Leases this worker holds (as of its last heartbeat tick).",
            multiprocess_mode="livesum", **kw)
        self.recovery_passes = C("recovery_passes", "Recovery passes due, by result: ran, skipped "
                                 "(another recoverer took the interval), failed (the store did not "
                                 "answer).", ["result"], **kw)
        # Set by an outbox relay (celery_leases/outbox/relay.py) every few seconds: the same
        # database seen from every worker that relays it, so dashboards take the max.
        G = prometheus_client.Gauge
        self.outbox_depth = G("outbox_depth", "Rows waiting in the outbox (sent, committed, not "
                              "published yet), as the relay last read them.", multiprocess_mode="livemax", **kw)
        self.outbox_oldest_age = G("outbox_oldest_age_seconds", "Age of the oldest row waiting in the "
                                   "outbox (0 when empty), on the database's clock.",
                                   multiprocess_mode="livemax", **kw)
        self.outbox_parked = G("outbox_parked", "Rows the outbox relay parked (could not decode or "
                               "publish), waiting in the parked table.", multiprocess_mode="livemax", **kw)
        self._collectors = [self.outbox_depth, self.outbox_oldest_age, self.outbox_parked, self.acquired,
                            self.renewed, self.lost, self.recovered, self.dead,
                            self.refused, self.parked, self.time_to_recovery, self.callbacks_failed,
                            self.undelivered, self.renew_seconds, self.renew_failures, self.held,
                            self.recovery_passes, self.results_written]
        for value in ("true", "false"):
            self.acquired.labels(taken_over=value)
        for reason in LOST_REASONS:
            self.lost.labels(reason=reason)
        for outcome in OUTCOMES:
            self.refused.labels(outcome=outcome)
        for result in RECOVERY_PASS_RESULTS:
            self.recovery_passes.labels(result=result)

    def _unregister(self) -> None:
        for collector in self._collectors:
            try:
                self._registry.unregister(collector)
            except KeyError:
                pass

    def disable(self) -> None:
        """Disconnect the receivers and unregister the collectors."""
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)
        self._unregister()
        with _lock:
            if _enabled.get(self.app) is self:
                del _enabled[self.app]
        set_exporter(self.app, None)

    # -- the worker's /metrics (worker/health.py) ------------------------------

    def prepare_worker(self, prefork: bool) -> None:
        """In the worker's main process, before the pool forks: under prefork (or wherever
        ``PROMETHEUS_MULTIPROC_DIR`` is set), prometheus_client's multiprocess mode, so that
        /metrics sums the counts of every pool process."""
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
        if not path and not prefork:
            return  # one process: the registry as it is
        if not path:
            _remove_stale_dirs()
            path = self._own_dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = path   # the pool processes inherit it
            atexit.register(self.worker_stopped)
        if not getattr(prometheus_values.ValueClass, "_multiprocess", False):
            # prometheus_client chose its value class at import, before the directory was set:
            # values created from now on (ours, rebuilt now; the pool's) are kept in its files.
            prometheus_values.ValueClass = prometheus_values.MultiProcessValue()
            self._unregister()
            self._build()
        self._multiprocess_dir = path
        self._served = prometheus_client.CollectorRegistry()
        MultiProcessCollector(self._served, path=path)
        logger.info("celery-leases: Prometheus multiprocess mode: the pool processes' metrics are "
                    "kept in %s%s and summed by /metrics", path,
                    " (removed at shutdown)" if self._own_dir else " (PROMETHEUS_MULTIPROC_DIR)")

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The metrics as /metrics serves them (OpenMetrics if ``accept`` asks for it)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self._served if self._served is not None else self._registry), content_type

    def worker_stopped(self) -> None:
        """Remove the multiprocess directory this worker made (its pool is gone)."""
        path, self._own_dir = self._own_dir, None
        if path is None or os.getpid() != self._owner_pid:
            return
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") == path:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]

    # -- receivers ----------------------------------------------------------

    def _ours(self, sender: Any) -> bool:
        """Signals are process-wide: count only those of this app (sender: the app or a task)."""
        return sender is None or sender is self.app or getattr(sender, "app", None) is self.app

    def _on_acquired(self, sender: Any = None, taken_over: bool = False, **kwargs: Any) -> None:
        if self._ours(sender):
            self.acquired.labels(taken_over="true" if taken_over else "false").inc()

    def _on_renewed(self, sender: Any = None, renewed: int = 0, **kwargs: Any) -> None:
        if self._ours(sender) and renewed:
            self.renewed.inc(renewed)

    def _on_lost(self, sender: Any = None, reason: str = "", **kwargs: Any) -> None:
        if self._ours(sender):
            self.lost.labels(reason=reason or "unknown").inc()

    def _on_recovered(self, sender: Any = None, recovered_after: float | None = None,
                      **kwargs: Any) -> None:
        if self._ours(sender):
            self.recovered.inc()
            if recovered_after is not None:
                self.time_to_recovery.observe(recovered_after)

    def _on_dead(self, sender: Any = None, **kwargs: Any) -> None:
        if self._ours(sender):
            self.dead.inc()

    def _on_refused(self, sender: Any = None, outcome: str = "", **kwargs: Any) -> None:
        if self._ours(sender):
            self.refused.labels(outcome=outcome or "unknown").inc()

    def _on_result_written(self, sender: Any = None, **kwargs: Any) -> None:
        if self._ours(sender):
            self.results_written.inc()

    def _on_undelivered(self, sender: Any = None, **kwargs: Any) -> None:
        if self._ours(sender):
            self.undelivered.inc()

    def _on_callback_failed(self, sender: Any = None, **kwargs: Any) -> None:
        if self._ours(sender):
            self.callbacks_failed.inc()

    def _on_tick(self, sender: Any = None, held: int = 0, seconds: float | None = None,
                 failed: bool = False, **kwargs: Any) -> None:
        if self._ours(sender):
            self.held.set(held)
            if seconds is not None:
                self.renew_seconds.observe(seconds)
            if failed:
                self.renew_failures.inc()

    def _on_recovery_pass(self, sender: Any = None, result: str = "", **kwargs: Any) -> None:
        if self._ours(sender):
            self.recovery_passes.labels(result=result or "unknown").inc()

    def _on_outbox_status(self, sender: Any = None, depth: int = 0, oldest_age: float | None = None,
                          parked: int = 0, **kwargs: Any) -> None:
        if self._ours(sender):
            self.outbox_depth.set(depth)
            self.outbox_oldest_age.set(oldest_age or 0.0)
            self.outbox_parked.set(parked)

    def _on_parked(self, sender: Any = None, field: str = "", **kwargs: Any) -> None:
        if self._ours(sender):
            self.parked.labels(field=field or "none").inc()


#: Name of the multiprocess directories workers make: the prefix, the worker's process id, a dash.
_DIR_PREFIX = "celery-leases-prometheus-"
_DIR_NAME = re.compile(re.escape(_DIR_PREFIX) + r"(\d+)-")


def _remove_stale_dirs() -> None:
    """Remove the multiprocess directories of workers that are gone without removing theirs
    (killed): one whose process no longer exists. A directory of a live process stays."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = _DIR_NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            pass  # alive, another user's


def enable_prometheus(app: Any, registry: Any = None, *, namespace: str = "celery_leases") -> LeaseMetrics:
    """Export celery-leases' signals of ``app`` as Prometheus metrics in ``registry``.

    ``registry`` defaults to prometheus_client's global ``REGISTRY``. Starts no
    server: a worker whose ``leases_http_port`` is set serves the metrics on
    ``/metrics`` from its main process (under prefork summed over its pool
    processes), so the call belongs in the app module, where every process
    (workers, the CLI, beat) runs it. Calling it again for the same app returns
    the metrics already enabled. Metric names:
    ``<namespace>_acquired_total{taken_over}``, ``_renewed_total``,
    ``_lost_total{reason}``, ``_recovered_total``, ``_dead_total``,
    ``_refused_total{outcome}``, ``_parked_total{field}``, ``_callbacks_failed_total``,
    ``_undelivered_republished_total``, ``_results_written_by_recovery_total``,
    ``_renew_failures_total``,
    ``_recovery_passes_total{result}``, ``_held``, ``_outbox_depth``,
    ``_outbox_oldest_age_seconds`` and ``_outbox_parked`` (gauges),
    ``_time_to_recovery_seconds`` and ``_renew_seconds`` (histograms). The known label
    values (``taken_over``, the lost reasons, the refused outcomes, the pass results)
    are exported at 0 from the start.
    """
    with _lock:
        metrics = _enabled.get(app)
        if metrics is None:
            metrics = _enabled[app] = LeaseMetrics(app, registry, namespace)
            logger.info("celery-leases: Prometheus metrics enabled (namespace %s)", namespace)
        return metrics
