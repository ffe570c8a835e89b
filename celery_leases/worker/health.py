"""The worker's health for an orchestrator: ``/livez``, ``/readyz`` and ``/metrics`` over HTTP
(``leases_http_port``), and a file touched while the worker is live (``leases_health_file``).

Built by ``HealthStep`` (steps.py) in the worker's main process only, before the pool forks
and before the worker waits for the lease store, so that probes answer from the start.

- **live**: the lease heartbeat thread runs and, while the consumer is in its event loop, the
  loop went round within ``LOOP_WEDGED_AFTER`` seconds (loop.py). Only the process's own
  state counts: a lease store or a broker that is down leaves the worker live, since a restart
  would not bring them back. Starting (waiting for the store or the broker), reconnecting and
  shutting down (tasks finishing) are live too.
- **ready**: live, the consumer consumes (connected, in its event loop), and the lease store
  answered within the last two heartbeat intervals: a renewal by the heartbeat, else a TIME
  call this service sends when the heartbeat sent none (a tick with no lease sends nothing).
- **/metrics**: what ``celery_leases.metrics.enable_prometheus(app)`` exports. That module sits
  a layer above this one, so it hands itself over (``set_exporter``) instead of being imported.

A probe reads what the threads keep (heartbeat, loop watch, consumer, the last store answer)
and sends nothing to Redis: it answers at once even while the store hangs.
"""
from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Protocol

from celery.bootsteps import CLOSE, RUN, TERMINATE

from ..config import LeaseConfig
from ..runtime import get_store, get_worker
from .loop import LOOP_WEDGED_AFTER

logger = logging.getLogger("celery_leases.worker")

__all__ = ["Health", "Verdict", "MetricsExporter", "set_exporter", "exporter_of"]

#: Seconds between two looks at the worker's state by the health thread (and touches of
#: ``leases_health_file`` while live).
PROBE_INTERVAL = 1.0
#: Seconds between two TIME calls while the lease store does not answer: it is back soon after.
STORE_RETRY = 1.0

_TEXT = "text/plain; charset=utf-8"

#: What the consumer is doing, as the probes see it.
STARTING, CONSUMING, CONNECTING, STOPPING = "starting", "consuming", "connecting", "stopping"


class MetricsExporter(Protocol):
    """What ``/metrics`` needs of the metrics of an app (``celery_leases.metrics.LeaseMetrics``)."""

    def prepare_worker(self, prefork: bool) -> None:
        """Called in the worker's main process before the pool forks."""

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The metrics in the format ``accept`` asks for, and its content type."""

    def worker_stopped(self) -> None:
        """Called once the worker's pool is gone."""


_exporters: "weakref.WeakKeyDictionary[Any, MetricsExporter]" = weakref.WeakKeyDictionary()


def set_exporter(app: Any, exporter: MetricsExporter | None) -> None:
    """Serve ``exporter`` on the ``/metrics`` of ``app``'s workers (None: no metrics)."""
    if exporter is None:
        _exporters.pop(app, None)
    else:
        _exporters[app] = exporter


def exporter_of(app: Any) -> MetricsExporter | None:
    return _exporters.get(app)


@dataclass(frozen=True)
class Verdict:
    """The answer of one probe: its status and a one-line reason."""

    ok: bool
    reason: str


class Health:
    """The probes of one worker (``w``: its WorkController), the HTTP server and the file."""

    def __init__(self, app: Any, w: Any, config: LeaseConfig, *, prefork: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.w = app, w
        self.port, self.host, self.path = config.http_port, config.http_host, config.health_file
        self.interval = config.heartbeat_interval
        #: The monotonic clock of every time read here; the heartbeat's renewal times are
        #: compared with it, so it is the heartbeat's clock outside tests.
        self.clock = clock
        self.exporter = exporter_of(app) if self.port is not None else None
        if self.exporter is not None:
            self.exporter.prepare_worker(prefork)  # before the pool forks (HealthStep.create)
        self._lock = threading.Lock()
        self._consuming_since: float | None = None
        #: When this service's own TIME call was last answered, and the last call's error.
        self._store_answered_at: float | None = None
        self._store_error: str | None = None
        self._touch_failed = False
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()
        self._stopped = False

    # -- the probes ---------------------------------------------------------

    def live(self) -> Verdict:
        state = self._observe()
        if state == STOPPING:
            return Verdict(True, "live: shutting down")
        running = self._heartbeat_running()
        if running is False:
            return Verdict(False, "not live: the lease heartbeat thread has stopped")
        finishes = getattr(get_worker(self.app), "finishes", None)
        if finishes is not None and finishes.running is False:
            return Verdict(False, "not live: the thread sending finishes in the background has stopped")
        stalled = self._loop_stalled_for() if state == CONSUMING else None
        if stalled is not None and stalled > LOOP_WEDGED_AFTER:
            return Verdict(False, f"not live: the event loop has not gone round for {stalled:.1f}s "
                                  f"(a wedged main thread or a broker read that hangs; SIGUSR1 logs "
                                  f"every thread's stack)")
        if running is None:
            return Verdict(True, "live: starting (the lease heartbeat has not started yet)")
        return Verdict(True, f"live: {_WORDS[state]}")

    def ready(self) -> Verdict:
        live = self.live()
        if not live.ok:
            return Verdict(False, "not ready: " + live.reason.removeprefix("not live: "))
        state = self._observe()
        if state != CONSUMING:
            return Verdict(False, f"not ready: {_WORDS[state]}")
        limit = 2 * self.interval
        age = self._store_age()
        error = f": {self._store_error}" if self._store_error else ""
        if age is None:
            return Verdict(False, f"not ready: the lease store has not answered yet{error}")
        if age > limit:
            return Verdict(False, f"not ready: the lease store has not answered for {age:.1f}s "
                                  f"(two heartbeat intervals are {limit:.1f}s){error}")
        return Verdict(True, f"ready: consuming; the lease store answered {age:.1f}s ago")

    def metrics(self, accept: str = "") -> tuple[int, str, bytes]:
        """(status, content type, body) of ``/metrics``."""
        exporter = self.exporter or exporter_of(self.app)
        if exporter is None:
            if importlib.util.find_spec("prometheus_client") is None:
                text = ("no metrics: /metrics needs the prometheus-client package "
                        "(pip install 'celery-leases[prometheus]') and "
                        "celery_leases.ops.metrics.enable_prometheus(app) in the app module")
            else:
                text = "no metrics: call celery_leases.metrics.enable_prometheus(app) in the app module"
            return 404, _TEXT, (text + "\n").encode()
        body, content_type = exporter.exposition(accept)
        return 200, content_type, body

    # -- what the other threads keep -----------------------------------------

    def _heartbeat(self) -> Any:
        lease_worker = get_worker(self.app)
        return lease_worker.heartbeat if lease_worker is not None else None

    def _heartbeat_running(self) -> bool | None:
        heartbeat = self._heartbeat()
        return heartbeat.running if heartbeat is not None else None

    def _consumer_state(self) -> str:
        worker_steps = getattr(self.w, "blueprint", None)
        if worker_steps is not None and worker_steps.state in (CLOSE, TERMINATE):
            return STOPPING
        consumer: Any = getattr(self.w, "consumer", None)
        steps = getattr(consumer, "blueprint", None)
        if consumer is None or steps is None or steps.state is None:
            return STARTING
        if steps.state != RUN:
            return STOPPING
        # Celery's Blueprint.start counts the steps it entered; the last one (the event loop)
        # never returns while the consumer consumes. A broker reconnect starts them again,
        # waiting in the connection step.
        if steps.started != len(consumer.steps) or consumer.connection is None:
            return CONNECTING
        return CONSUMING

    def _observe(self) -> str:
        """The consumer's state, noting when it entered its event loop: a loop entered just
        now (after a broker outage) has not stalled for the length of the outage."""
        state = self._consumer_state()
        with self._lock:
            if state != CONSUMING:
                self._consuming_since = None
            elif self._consuming_since is None:
                self._consuming_since = self.clock()
        return state

    def _loop_stalled_for(self) -> float | None:
        heartbeat = self._heartbeat()
        loop = getattr(heartbeat, "loop", None)
        if loop is None:  # a pool without Celery's event loop (gevent, eventlet): nothing to watch
            return None
        since = self._consuming_since
        stalled = loop.stalled_for()
        return stalled if since is None else min(stalled, self.clock() - since)

    def _store_age(self) -> float | None:
        heartbeat = self._heartbeat()
        answers = [t for t in (getattr(heartbeat, "last_renewed_at", None), self._store_answered_at)
                   if t is not None]
        return self.clock() - max(answers) if answers else None

    # -- threads ---------------------------------------------------------------

    def start(self) -> None:
        if self.port is not None:
            self._serve()
            self._thread(self._watch_store, "celery-leases-store-probe")
        self._thread(self._watch, "celery-leases-health")
        if self.path is not None:
            logger.info("celery-leases: touching %s every %.0fs while the worker is live "
                        "(leases_health_file)", self.path, PROBE_INTERVAL)
        atexit.register(self.stop)

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _serve(self) -> None:
        assert self.port is not None
        try:
            server = _Server((self.host, self.port), self)
        except OSError as exc:
            # The worker runs on: a worker without probes beats one that does not run.
            logger.error("celery-leases: leases_http_port %d: cannot serve /livez, /readyz and /metrics "
                         "on %s:%d: %s; the worker runs on without them", self.port, self.host,
                         self.port, exc)
            return
        self._server = server
        self._thread(lambda: server.serve_forever(poll_interval=0.5), "celery-leases-http")
        logger.info("celery-leases: serving /livez, /readyz and /metrics on http://%s:%d "
                    "(leases_http_port)", self.host, self.port)

    def _watch(self) -> None:
        """Look at the worker every PROBE_INTERVAL; touch the health file while it is live."""
        while not self._stop.wait(PROBE_INTERVAL):
            try:
                if self.live().ok and self.path is not None:
                    self._touch(self.path)
            except Exception:  # noqa: BLE001 - a bug here must be seen, and the probe go on
                logger.exception("celery-leases: the health probe failed unexpectedly")

    def _touch(self, path: str) -> None:
        try:
            try:
                os.utime(path)
            except FileNotFoundError:
                with open(path, "a"):
                    pass
        except OSError as exc:
            if not self._touch_failed:
                logger.error("celery-leases: cannot touch leases_health_file %s: %s", path, exc)
            self._touch_failed = True
            return
        if self._touch_failed:
            logger.warning("celery-leases: leases_health_file %s is touched again", path)
        self._touch_failed = False

    def _watch_store(self) -> None:
        """A TIME call to the lease store whenever the heartbeat has sent none for an interval."""
        while not self._stop.is_set():
            heartbeat = self._heartbeat()
            renewed = getattr(heartbeat, "last_renewed_at", None)
            if renewed is None or self.clock() - renewed >= self.interval:
                self._ask_store()
            self._stop.wait(self.interval if self._store_error is None else min(self.interval, STORE_RETRY))

    def _ask_store(self) -> None:
        try:
            get_store(self.app).server_time_ms()
        except Exception as exc:  # noqa: BLE001 - any failure is an unanswered store, said in /readyz
            self._store_error = str(exc) or type(exc).__name__
            logger.debug("celery-leases: health probe: the lease store did not answer: %s", exc)
            return
        self._store_answered_at = self.clock()
        self._store_error = None

    def stop(self) -> None:
        """Stop serving and touching; remove the health file. Once, in the process that started."""
        if self._stopped or os.getpid() != self._pid:
            return
        self._stopped = True
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        if self.exporter is not None:
            self.exporter.worker_stopped()


_WORDS = {CONSUMING: "consuming", STARTING: "starting (not consuming yet)",
          CONNECTING: "not consuming: connecting to the broker (or starting)", STOPPING: "shutting down"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], health: Health) -> None:
        self.health = health
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "celery-leases"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        health = self.server.health
        path = self.path.split("?", 1)[0]
        if path in ("/livez", "/readyz"):
            verdict = health.live() if path == "/livez" else health.ready()
            self._send(200 if verdict.ok else 503, _TEXT, (verdict.reason + "\n").encode())
        elif path == "/metrics":
            self._send(*health.metrics(self.headers.get("Accept", "")))
        else:
            self._send(404, _TEXT, b"not found: this worker serves /livez, /readyz and /metrics\n")

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        logger.debug("celery-leases: health endpoint: " + format, *args)
