"""The processes a chaos run drives faults into: Redis servers and N worker slots.

The main Redis (AOF on) holds results and the sink, and the broker unless the
broker has a server of its own (``separate_broker_redis``: no persistence, as a
broker commonly runs; the ``broker_loss`` fault restarts it empty); the lease
store may have its own too (``separate_lease_redis``).

A *slot* is a place for one ``celery worker`` (even slots prefork, odd slots
threads). A killed worker is replaced in its slot after a delay; a restarted
one is replaced after its warm shutdown. Each incarnation has its own name
(``w<slot>g<generation>``) and log file, so histories and logs say which
process did what.

Every fault is logged (``Cluster.log``) with the wall-clock time and the pids
it hit, so the checker can tell which executions a fault cut short.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from celery_leases import testing
from celery_leases.testing.servers import RedisServer, free_port

logger = logging.getLogger("chaos.cluster")

APP = "chaos.app"
#: The repository root: the workers run there, with it on their PYTHONPATH (chaos.app).
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Slot:
    index: int
    pool: str
    concurrency: int
    generation: int = 0
    worker: testing.Worker | None = None
    #: up | stopped | down | restarting
    state: str = "down"
    #: Set to end a running fault on this slot early (heal).
    wake: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return f"w{self.index}g{self.generation}"


def pools_for(workers: int) -> list[tuple[str, int]]:
    """Even slots prefork (2 processes), odd slots threads (4 threads)."""
    return [("prefork", 2) if i % 2 == 0 else ("threads", 4) for i in range(workers)]


class Cluster:
    def __init__(self, run_dir: Path, mode: str, workers: int, *, ttl: float = 3.0,
                 visibility_timeout: float = 5.0, prefetch: int = 2, appendonly: bool = True,
                 separate_lease_redis: bool = False, lease_appendonly: bool = False,
                 separate_broker_redis: bool = False,
                 pools: list[tuple[str, int]] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.mode = mode
        self.ttl = ttl
        self.history_dir = self.run_dir / "history"
        self.log_dir = self.run_dir / "logs"
        for d in (self.history_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(port=free_port(), dir=self.run_dir / "redis", appendonly=appendonly,
                                 extra_args=("--appendfsync", "everysec") if appendonly else ())
        #: The leases on their own Redis: with AOF for the fault runs (so the lease store can be
        #: paused or restarted on its own), without for the no-persistence scenario.
        self.lease_redis = (RedisServer(port=free_port(), dir=self.run_dir / "redis-leases",
                                        appendonly=lease_appendonly,
                                        extra_args=("--appendfsync", "everysec") if lease_appendonly else ())
                            if separate_lease_redis else None)
        #: The broker on its own Redis without persistence (no AOF, no RDB): restarted empty.
        self.broker_redis = (RedisServer(port=free_port(), dir=self.run_dir / "redis-broker")
                             if separate_broker_redis else None)
        self.slots = [Slot(i, pool, c) for i, (pool, c) in enumerate(pools or pools_for(workers))]
        self.prefetch = prefetch
        self.visibility_timeout = visibility_timeout
        self.lock = threading.RLock()
        self.log: list[dict] = []
        self.t0 = time.time()
        self._threads: list[threading.Thread] = []
        self._redis_lock = threading.Lock()
        self._stopping = threading.Event()

    # -- environment ----------------------------------------------------------

    @property
    def redis_base(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}"

    def env(self, worker: str = "harness") -> dict:
        env = {"CHAOS_MODE": self.mode, "CHAOS_REDIS_URL": self.redis_base,
               "CHAOS_HISTORY_DIR": str(self.history_dir), "CHAOS_WORKER": worker,
               "CHAOS_TTL": str(self.ttl), "CHAOS_VISIBILITY_TIMEOUT": str(self.visibility_timeout),
               "CHAOS_PREFETCH": str(self.prefetch)}
        if self.lease_redis is not None:
            env["CHAOS_LEASES_URL"] = f"redis://127.0.0.1:{self.lease_redis.port}/0"
        if self.broker_redis is not None:
            env["CHAOS_BROKER_URL"] = self.broker_url
        return env

    @property
    def broker_url(self) -> str:
        from chaos.app import BROKER_DB
        if self.broker_redis is not None:
            return f"redis://127.0.0.1:{self.broker_redis.port}/0"
        return f"{self.redis_base}/{BROKER_DB}"

    @property
    def servers(self) -> list[RedisServer]:
        return [s for s in (self.redis, self.lease_redis, self.broker_redis) if s is not None]

    def client_env(self) -> dict:
        """The harness's own env: same settings, no history."""
        env = self.env("harness")
        env.pop("CHAOS_HISTORY_DIR")
        return env

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        for server in self.servers:
            server.start()
        threads = [threading.Thread(target=self._start_slot, args=(slot,)) for slot in self.slots]
        [t.start() for t in threads]
        [t.join() for t in threads]
        missing = [s.index for s in self.slots if s.state != "up"]
        if missing:
            raise RuntimeError(f"chaos workers in slots {missing} did not start; see {self.log_dir}")
        self._supervisor = threading.Thread(target=self._supervise, name="chaos-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        """Restart a worker that exits on its own, as systemd or Kubernetes would.

        Celery 5.7 workers sometimes exit when Redis restarts under them (an
        ``AttributeError`` in kombu while the consumer closes the broken
        connection: "Unrecoverable error"); docs/chaos.md says more.
        """
        while not self._stopping.wait(0.5):
            for s in self.slots:
                with self.lock:
                    worker = s.worker
                    exited = (s.state == "up" and worker is not None and worker.proc is not None
                              and worker.proc.poll() is not None)
                    if exited:
                        s.state = "down"
                if exited:
                    assert worker is not None and worker.proc is not None
                    self._record("worker_exited", slot=s.index, worker=s.name, rc=worker.proc.returncode,
                                 pids=[worker.pid])
                    worker.kill()
                    self._spawn(self._respawn, s, 1.0)

    def _start_slot(self, slot: Slot, attempts: int = 3) -> None:
        for attempt in range(attempts):
            with self.lock:
                if slot.state in ("up", "starting") and slot.worker is not None and attempt == 0:
                    return  # another thread (heal, the supervisor) got there first
                slot.generation += 1
                worker = testing.Worker(APP, name=slot.name, env={"LEASES_TEST_POOL": slot.pool,
                                                                  **self.env(slot.name)},
                                        pool=slot.pool, concurrency=slot.concurrency, log_dir=self.log_dir,
                                        cwd=ROOT, pythonpath=[str(ROOT)])
                slot.worker = worker
                slot.state = "starting"
            try:
                worker.start(timeout=60)
            except Exception as exc:  # noqa: BLE001 - logged, tried again
                self._record("worker_start_failed", slot=slot.index, worker=slot.name, error=repr(exc)[:300])
                worker.kill()
                continue
            with self.lock:
                slot.state = "up"
                slot.wake.clear()
            self._record("worker_started", slot=slot.index, worker=slot.name, pids=[worker.pid])
            return
        with self.lock:
            slot.state = "down"

    def shutdown(self) -> None:
        self._stopping.set()
        for slot in self.slots:
            slot.wake.set()
        for t in list(self._threads):
            t.join(60)
        for slot in self.slots:
            if slot.worker is not None:
                try:
                    slot.worker.signal(signal.SIGCONT)
                except (ProcessLookupError, AssertionError):
                    pass
                slot.worker.kill()
        for server in self.servers:
            server.stop()

    # -- the fault log ----------------------------------------------------------

    def _record(self, what: str, **fields: Any) -> dict:
        now = time.time()
        entry = {"t": now, "rel": round(now - self.t0, 3), "what": what, **fields}
        with self.lock:
            self.log.append(entry)
        logger.info("%7.2fs %s %s", now - self.t0, what,
                    " ".join(f"{k}={v}" for k, v in fields.items()))
        return entry

    def _spawn(self, target, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        with self.lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    # -- choosing a target ------------------------------------------------------

    def _pick(self, slot: int, pool: str | None = None) -> Slot | None:
        """The slot if it is up (and of ``pool``), else the next one that is; None if none is."""
        n = len(self.slots)
        for k in range(n):
            s = self.slots[(slot + k) % n]
            if s.state == "up" and (pool is None or s.pool == pool):
                return s
        return None

    @staticmethod
    def _pids(worker: testing.Worker) -> list[int]:
        try:
            return [worker.pid, *worker.children()]
        except Exception:  # noqa: BLE001 - best effort, for the log
            return [worker.pid]

    # -- faults -----------------------------------------------------------------

    def kill_worker(self, slot: int, down_for: float) -> None:
        """SIGKILL a worker's main process (prefork children die with it); a new one starts later."""
        with self.lock:
            s = self._pick(slot)
            if s is None:
                self._record("kill_worker", slot=slot, skipped="no worker up")
                return
            s.state = "down"
            worker = s.worker
        assert worker is not None
        pids = self._pids(worker)
        self._record("kill_worker", slot=s.index, worker=s.name, pids=pids)
        try:
            worker.signal(signal.SIGKILL, main_only=True)
            worker.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.2)
        worker.kill()  # anything left of the group (pdeathsig should have taken the children)
        self._spawn(self._respawn, s, down_for)

    def _respawn(self, s: Slot, after: float) -> None:
        s.wake.wait(after)
        if s.state == "down":
            self._start_slot(s)

    def kill_child(self, slot: int, pick: int) -> None:
        """SIGKILL one pool child of a prefork worker (the worker itself survives)."""
        with self.lock:
            s = self._pick(slot, pool="prefork")
            if s is None:
                self._record("kill_child", slot=slot, skipped="no prefork worker up")
                return
            worker = s.worker
        assert worker is not None
        children = worker.children()
        if not children:
            self._record("kill_child", slot=s.index, worker=s.name, skipped="no children")
            return
        child = children[pick % len(children)]
        self._record("kill_child", slot=s.index, worker=s.name, pids=[child])
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop_worker(self, slot: int, seconds: float) -> None:
        """SIGSTOP a whole worker (main process and children) for ``seconds``, then SIGCONT."""
        with self.lock:
            s = self._pick(slot)
            if s is None:
                self._record("stop_worker", slot=slot, skipped="no worker up")
                return
            s.state = "stopped"
            worker = s.worker
        assert worker is not None
        pids = self._pids(worker)
        self._record("stop_worker", slot=s.index, worker=s.name, pids=pids, seconds=seconds)
        worker.signal(signal.SIGSTOP)
        self._spawn(self._cont, s, worker, seconds)

    def _cont(self, s: Slot, worker: testing.Worker, seconds: float) -> None:
        s.wake.wait(seconds)
        try:
            worker.signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
        with self.lock:
            if s.state == "stopped" and s.worker is worker:
                s.state = "up"
        self._record("cont_worker", slot=s.index, worker=s.name, pids=[worker.pid])

    def restart_worker(self, slot: int) -> None:
        """Warm shutdown (SIGTERM: running tasks finish), then a new worker in the slot."""
        with self.lock:
            s = self._pick(slot)
            if s is None:
                self._record("restart_worker", slot=slot, skipped="no worker up")
                return
            s.state = "restarting"
            worker = s.worker
        assert worker is not None
        self._record("restart_worker", slot=s.index, worker=s.name, pids=self._pids(worker))
        self._spawn(self._restart, s, worker)

    def _restart(self, s: Slot, worker: testing.Worker) -> None:
        worker.stop(timeout=30)
        self._record("worker_stopped", slot=s.index, worker=s.name, rc=worker.proc.returncode)
        self._start_slot(s)

    def redis_restart(self, variant: str, down_for: float, server: RedisServer | None = None) -> None:
        """Stop Redis (SIGTERM, or SIGKILL for a crash), keep it down ``down_for`` s, start it again."""
        server = server or self.redis
        if not self._redis_lock.acquire(blocking=False):
            self._record("redis_restart", skipped="redis busy with another fault")
            return
        try:
            self._record("redis_restart", variant=variant, port=server.port, seconds=down_for,
                         appendonly=server.appendonly)
            if variant == "crash":
                server.kill()
            else:
                server.stop()
            time.sleep(down_for)
            server.start()
            self._record("redis_started", port=server.port)
        finally:
            self._redis_lock.release()

    def broker_loss(self, down_for: float, hold: float = 1.5) -> None:
        """SIGKILL the broker's own redis-server (no persistence), start it again empty: every
        message waiting in it, and plain mode's unacked ones, is gone.

        The workers that are up are held (SIGSTOP) for ``hold`` s first, less than the lease
        ttl, so the submitter's tasks pile up in the queue as behind a busy pool: the loss
        then takes waiting tasks, not only an empty queue."""
        server = self.broker_redis
        if server is None:
            self._record("broker_loss", skipped="no broker server of its own")
            return
        if not self._redis_lock.acquire(blocking=False):
            self._record("broker_loss", skipped="redis busy with another fault")
            return
        with self.lock:
            held = [(s, s.worker) for s in self.slots if s.state == "up" and s.worker is not None]
            for s, _ in held:
                s.state = "stopped"
        try:
            for _, worker in held:
                worker.signal(signal.SIGSTOP)
            self._stopping.wait(hold)
            waiting = self._queue_length(server)
            self._record("broker_loss", port=server.port, seconds=down_for, waiting=waiting,
                         held=[s.name for s, _ in held])
            server.kill()
            time.sleep(down_for)
            server.start()
            self._record("redis_started", port=server.port)
        finally:
            for s, worker in held:
                try:
                    worker.signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                with self.lock:
                    if s.state == "stopped" and s.worker is worker:
                        s.state = "up"
            self._redis_lock.release()

    @staticmethod
    def _queue_length(server: RedisServer) -> int | None:
        from chaos.app import QUEUE
        try:
            client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)
            try:
                return int(client.llen(QUEUE))
            finally:
                client.close()
        except redis.RedisError:
            return None

    def server(self, name: str) -> RedisServer:
        """"main" (broker, results, sink) or "leases" (the lease store; main if it has none)."""
        return self.lease_redis if name == "leases" and self.lease_redis is not None else self.redis

    def redis_pause(self, seconds: float, server: RedisServer | None = None) -> None:
        """``CLIENT PAUSE <ms> ALL``: every client's commands wait; the pause ends by itself."""
        server = server or self.redis
        if not self._redis_lock.acquire(blocking=False):
            self._record("redis_pause", skipped="redis busy with another fault")
            return
        try:
            client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
            try:
                client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
            finally:
                client.close()
            self._record("redis_pause", seconds=seconds, port=server.port)
        except redis.RedisError as exc:
            self._record("redis_pause", skipped=repr(exc))
        finally:
            self._redis_lock.release()

    def lease_store_pause(self, seconds: float) -> None:
        """SIGSTOP the lease store's redis-server for ``seconds`` (past the ttl), then SIGCONT.

        Unlike ``CLIENT PAUSE``, the frozen server accepts nothing and answers nothing, yet
        keeps every command already in its sockets and runs them when it resumes: a finish
        that timed out on the worker's side is applied later (issue #14, item 2).
        """
        server = self.lease_redis
        if server is None or self.mode != "leases":
            self._record("lease_store_pause", skipped="no lease store of its own")
            return
        if not self._redis_lock.acquire(blocking=False):
            self._record("lease_store_pause", skipped="redis busy with another fault")
            return
        try:
            pid = server.process.pid
            self._record("lease_store_pause", port=server.port, seconds=seconds, pids=[pid])
            os.kill(pid, signal.SIGSTOP)
            try:
                self._stopping.wait(seconds)
            finally:
                os.kill(pid, signal.SIGCONT)
            self._record("lease_store_resumed", port=server.port)
        finally:
            self._redis_lock.release()

    def publish_malformed(self, variant: str, copies: int) -> None:
        """Publish ``copies`` raw messages of the ``variant`` kind (chaos.faults.MALFORMED) to the
        chaos queue, as a buggy or hostile client could: they are not tasks the run expects."""
        import json
        import uuid

        from kombu import Connection

        from chaos.app import QUEUE, TASK_NAME
        from chaos.faults import MALFORMED
        ids = []
        with Connection(self.broker_url, connect_timeout=3) as conn:
            producer = conn.Producer(serializer="json")
            for _ in range(copies):
                headers = {"lang": "py", "task": TASK_NAME, "id": f"malformed-{uuid.uuid4().hex[:8]}",
                           "root_id": None, "parent_id": None, "group": None, "retries": 0,
                           "eta": None, "expires": None, "argsrepr": "(-1, 0.1)", "kwargsrepr": "{}",
                           "origin": "chaos-malformed", "ignore_result": False,
                           "timelimit": [None, None], **MALFORMED[variant]}
                body = json.dumps([[-1, 0.1], {}, {"callbacks": None, "errbacks": None,
                                                   "chain": None, "chord": None}])
                producer.publish(body, exchange="", routing_key=QUEUE, headers=headers,
                                 content_type="application/json", content_encoding="utf-8",
                                 retry=True, retry_policy={"max_retries": 3})
                ids.append(repr(headers["id"]))
        self._record("malformed", variant=variant, ids=ids)

    # -- the end of the fault window ----------------------------------------------

    def heal(self, timeout: float = 90.0) -> None:
        """End every fault now: resume stopped workers, unpause and start Redis, fill every slot."""
        for slot in self.slots:
            slot.wake.set()
        with self._redis_lock:
            for server in self.servers:
                if not server.running:
                    server.start()
            for server in self.servers:
                try:
                    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=10)
                    client.execute_command("CLIENT", "UNPAUSE")
                    client.close()
                except redis.RedisError:
                    pass
        deadline = time.monotonic() + timeout
        for t in list(self._threads):
            t.join(max(0.1, deadline - time.monotonic()))
        for s in self.slots:
            if s.state != "up":
                self._start_slot(s)
        self._record("healed", slots={s.index: s.state for s in self.slots})

    def workers_alive(self) -> list[str]:
        return [s.name for s in self.slots if s.state == "up"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
