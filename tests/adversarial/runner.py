"""The shared runner of the adversarial scenarios: real redis-servers, real ``celery worker``s,
real waiters, and the same counts for every scenario.

A scenario builds a :class:`Run` (servers, workers, a client), submits tasks with what each
is expected to end as, drives its fault, marks the fault's end, and calls :meth:`Run.settle`,
which returns :class:`Counts`:

- **submitted**: tasks the scenario sent and expects an outcome for;
- **exactly one accepted**: the expected outcome stands, accepted once: for a success, one
  execution's ``task_success`` fired, the backend holds that execution's value and the
  lease record says ``succeeded`` with the same token; for a task expected dead or revoked,
  the backend and the record say so and no success was accepted;
- **lost**: a waiter that did not return within the bounded wait, or a task expected to
  succeed whose final outcome is not a success (its work was thrown away: declared dead,
  a FAILURE the body never raised, a record ``succeeded`` with nothing in the backend);
- **duplicates accepted**: more than one execution's success accepted;
- **waiters misled**: the first outcome a waiter received is not the one that stands at the
  end (another status, or another execution's value), or contradicts the lease record
  (FAILURE beside a ``succeeded`` lease);
- **time to settle**: seconds from the end of the fault to the last waiter's return.

Waiters are real: one pub/sub subscription per task on the result key, as
``AsyncResult.get()`` does on the Redis backend, subscribed before the task is sent;
the first ready state published (or already stored) is what the waiter got.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis

from chaos.history import by_task, read_history
from celery_leases.testing.servers import RedisServer, free_port
from tests.support.skew import skewed_env
from tests.support.workers import Worker

READY = ("SUCCESS", "FAILURE", "REVOKED")
APP = "tests.adversarial.app"


@dataclass
class Counts:
    scenario: str
    submitted: int = 0
    exactly_one: int = 0
    lost: int = 0
    duplicates: int = 0
    misled: int = 0
    settle_seconds: float | None = None
    #: Scenario-specific counts (bodies of malformed messages, extra runs, ...).
    extra: dict = field(default_factory=dict)
    #: task id -> why it was counted (lost, duplicate, misled, not exactly one).
    why: dict = field(default_factory=dict)

    HEADER = ("scenario", "submitted", "exactly one accepted", "lost", "duplicates accepted",
              "waiters misled", "time to settle")

    def row(self) -> tuple:
        settle = "-" if self.settle_seconds is None else f"{self.settle_seconds:.1f} s"
        return (self.scenario, self.submitted, self.exactly_one, self.lost, self.duplicates,
                self.misled, settle)

    def line(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.extra.items()))
        return " | ".join(str(c) for c in self.row()) + (f" | {extra}" if extra else "")

    def explain(self, limit: int = 8) -> str:
        return "\n".join(f"  {task}: {'; '.join(reasons)}"
                         for task, reasons in list(self.why.items())[:limit])

    def assert_clean(self, **extra_zero: int) -> None:
        """The promise: nothing lost, no duplicate accepted, no waiter misled, every task once."""
        problems = []
        for name in ("lost", "duplicates", "misled"):
            if getattr(self, name):
                problems.append(f"{name}={getattr(self, name)}")
        if self.exactly_one != self.submitted:
            problems.append(f"exactly one accepted {self.exactly_one} of {self.submitted}")
        for name in extra_zero:
            if self.extra.get(name):
                problems.append(f"{name}={self.extra[name]}")
        assert not problems, f"{self.scenario}: {', '.join(problems)}\n{self.line()}\n{self.explain()}"

    def as_dict(self) -> dict:
        return asdict(self)


def table(rows: list[Counts]) -> str:
    """A Markdown table of the counts, one row per scenario."""
    lines = ["| " + " | ".join(Counts.HEADER) + " | other |",
             "|" + "---|" * (len(Counts.HEADER) + 1)]
    for c in rows:
        extra = ", ".join(f"{k} {v}" for k, v in sorted(c.extra.items())) or "-"
        lines.append("| " + " | ".join(str(x) for x in c.row()) + f" | {extra} |")
    return "\n".join(lines)


class Waiters:
    """Bounded waiters on the result backend: the first ready state of each task, and when."""

    def __init__(self, url: str, key: Callable[[str], str]) -> None:
        self.url, self.key = url, key
        self._prefix = key("x")[:-1]
        #: Errors of the subscription loop (it reconnects after each; none is swallowed unseen).
        self.errors: list[str] = []
        self.first: dict[str, tuple[float, dict]] = {}
        self.seen: dict[str, list[dict]] = {}
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._pending: list[str] = []
        self._thread = threading.Thread(target=self._loop, name="adv-waiters", daemon=True)
        self._thread.start()

    def add(self, *task_ids: str) -> None:
        """Start waiting on ``task_ids``: call before the tasks are sent (returns once subscribed)."""
        with self._lock:
            self._ids.extend(task_ids)
            self._pending.extend(task_ids)
            self._subscribed.clear()
        if not self._subscribed.wait(30):
            raise RuntimeError(f"waiters: not subscribed after 30 s (errors: {self.errors[-3:]})")

    def _note(self, task_id: str, raw: Any) -> None:
        try:
            meta = json.loads(raw)
        except (TypeError, ValueError):
            return
        with self._lock:
            self.seen.setdefault(task_id, []).append(meta)
            if meta.get("status") in READY and task_id not in self.first:
                self.first[task_id] = (time.time(), meta)

    def _loop(self) -> None:
        while not self._stop.is_set():
            client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                with self._lock:
                    ids, self._pending = list(self._ids), []
                if ids:
                    pubsub.subscribe(*[self.key(i) for i in ids])
                self._catch_up(client, ids)
                self._subscribed.set()
                while not self._stop.is_set():
                    with self._lock:
                        new, self._pending = self._pending, []
                    if new:
                        pubsub.subscribe(*[self.key(i) for i in new])
                        self._catch_up(client, new)
                        self._subscribed.set()
                    message = pubsub.get_message(timeout=0.02)
                    if message and message.get("type") == "message":
                        channel = message["channel"].decode()
                        self._note(channel[len(self._prefix):], message["data"])
            except (redis.RedisError, OSError):
                time.sleep(0.3)  # the backend restarted or paused: subscribe again, read what was stored
            except Exception as exc:  # noqa: BLE001 - kept, and the loop goes on
                self.errors.append(repr(exc))
                time.sleep(0.3)
            finally:
                try:
                    pubsub.close()
                    client.close()
                except Exception:  # noqa: BLE001 - best effort
                    pass

    def _catch_up(self, client: redis.Redis, ids: list[str]) -> None:
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            for task_id, raw in zip(chunk, client.mget([self.key(t) for t in chunk])):
                if raw is not None:
                    self._note(task_id, raw)

    def wait(self, ids: list[str], deadline: float) -> None:
        while time.time() < deadline:
            with self._lock:
                if all(t in self.first for t in ids):
                    return
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Expect:
    """What a submitted task must end as: "success" (with ``seq``), "dead" or "revoked"."""
    outcome: str = "success"
    seq: int | None = None


class Run:
    """One scenario's processes: named redis-servers, workers, a client app and its waiters."""

    def __init__(self, name: str, directory: Path, *, ttl: float = 2.0,
                 records_may_vanish: bool = False, **env: str) -> None:
        self.name = name
        #: The lease store restarts empty in this scenario: a finished task may have no record.
        self.records_may_vanish = records_may_vanish
        self.dir = Path(directory) / name
        if self.dir.exists():  # a run directory used before: never mix two runs' histories
            self.dir = Path(directory) / f"{name}-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
        self.history_dir = self.dir / "history"
        self.history_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = f"adv{uuid.uuid4().hex[:6]}"
        self.ttl = ttl
        self.servers: dict[str, RedisServer] = {}
        self.workers: list[Worker] = []
        self.expect: dict[str, Expect] = {}
        self.env_base = {"ADV_PREFIX": self.prefix, "ADV_TTL": str(ttl),
                         "ADV_HISTORY_DIR": str(self.history_dir), **env}
        self.fault_end: float | None = None
        self._client: Any = None
        self.waiters: Waiters | None = None
        self._seq = 0

    # -- processes ----------------------------------------------------------

    def server(self, name: str, *, appendonly: bool = False) -> RedisServer:
        server = RedisServer(port=free_port(), dir=self.dir / f"redis-{name}", appendonly=appendonly,
                             extra_args=("--appendfsync", "always") if appendonly else ())
        server.start()
        self.servers[name] = server
        return server

    def wire(self, broker: str = "main", backend: str | None = None, leases: str | None = None,
             leases_query: str = "") -> None:
        """Which server holds the broker (db 0), the results (db 1) and the leases (db 2).

        ``leases_query``: redis-py URL options for the lease store's client (they override
        the store's own defaults), e.g. ``socket_timeout=0.5``."""
        url = lambda s, db: f"redis://127.0.0.1:{self.servers[s].port}/{db}"  # noqa: E731
        self.env_base.update(ADV_BROKER=url(broker, 0), ADV_BACKEND=url(backend or broker, 1),
                             ADV_LEASES=url(leases or backend or broker, 2)
                             + (f"?{leases_query}" if leases_query else ""))

    def worker(self, name: str, pool: str = "prefork", concurrency: int = 2, *, skew: str | None = None,
               start: bool = True, **env: str) -> Worker:
        full = {**self.env_base, "ADV_WORKER": name, "ADV_POOL": pool, **env}
        if skew is not None:
            full = skewed_env(skew, full)  # Worker puts os.environ under these, not over them
        worker = Worker(name, full, pool=pool, concurrency=concurrency, app=APP, log_dir=self.dir)
        self.workers.append(worker)
        if start:
            worker.start(timeout=60)
        return worker

    @property
    def client(self) -> Any:
        if self._client is None:
            from tests.adversarial.app import create_app
            self._client = create_app({**self.env_base, "ADV_HISTORY_DIR": ""})
            backend = self._client.backend
            self.waiters = Waiters(self.env_base["ADV_BACKEND"], backend.get_key_for_task)
        return self._client

    def store(self) -> Any:
        import celery_leases
        return celery_leases.store(self.client)

    # -- submitting ---------------------------------------------------------

    def submit(self, seconds: float = 0.0, *, task_id: str | None = None, expect: str = "success",
               name: str = "adv.work", args: tuple | None = None, **options: Any) -> str:
        """Send one task after its waiter subscribed; returns its id."""
        self._seq += 1
        task_id = task_id or f"{self.name[:12]}-{self._seq:05d}"
        seq = self._seq
        self.expect[task_id] = Expect(expect, seq if name == "adv.work" else None)
        client = self.client
        assert self.waiters is not None
        self.waiters.add(task_id)
        client.send_task(name, args=args if args is not None else (seq, seconds), task_id=task_id,
                         **options)
        return task_id

    def submit_many(self, count: int, seconds: float = 0.0) -> list[str]:
        """``count`` ``adv.work`` tasks, their waiters subscribed at once, then sent."""
        ids = []
        for _ in range(count):
            self._seq += 1
            task_id = f"{self.name[:12]}-{self._seq:05d}"
            self.expect[task_id] = Expect("success", self._seq)
            ids.append(task_id)
        client = self.client
        assert self.waiters is not None
        self.waiters.add(*ids)
        for task_id in ids:
            client.send_task("adv.work", args=(self.expect[task_id].seq, seconds), task_id=task_id)
        return ids

    def publish_raw(self, headers: dict, args: tuple = (-1, 0.0), name: str = "adv.work") -> None:
        """A message as any client could send it, bypassing Celery's checks (malformed on purpose)."""
        base = {"lang": "py", "task": name, "id": str(uuid.uuid4()), "root_id": None,
                "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
                "argsrepr": repr(args), "kwargsrepr": "{}", "origin": "adversary",
                "ignore_result": False, "timelimit": [None, None]}
        body = json.dumps([list(args), {}, {"callbacks": None, "errbacks": None, "chain": None,
                                             "chord": None}])
        with self.client.producer_or_acquire() as producer:
            producer.publish(body, exchange="", routing_key=self.prefix, headers={**base, **headers},
                             content_type="application/json", content_encoding="utf-8",
                             declare=[self.client.amqp.queues[self.prefix]] if self.prefix in
                             self.client.amqp.queues else None)

    def mark_fault_end(self) -> None:
        self.fault_end = time.time()

    # -- the history ----------------------------------------------------------

    def history(self) -> list[dict]:
        return read_history(self.history_dir)

    def starts(self) -> list[dict]:
        return [e for e in self.history() if e["ev"] == "start"]

    # -- settling ---------------------------------------------------------------

    def settle(self, timeout: float, quiet: float = 1.0) -> Counts:
        """Wait (bounded) for every waiter, then count. ``quiet``: seconds to let late duplicates
        (a resumed stale owner, a held copy) finish before the history is read."""
        assert self.waiters is not None, "nothing was submitted"
        start = self.fault_end or time.time()
        ids = list(self.expect)
        self.waiters.wait(ids, start + timeout)
        time.sleep(quiet)
        return self.count(ids, start)

    def count(self, ids: list[str], start: float) -> Counts:
        assert self.waiters is not None
        counts = Counts(self.name, submitted=len(ids))
        events = by_task(self.history())
        store = self.store()
        backend = redis.Redis.from_url(self.env_base["ADV_BACKEND"], socket_timeout=5)
        returned = []
        try:
            for task_id in ids:
                expect = self.expect[task_id]
                raw = backend.get(self.client.backend.get_key_for_task(task_id))
                final = json.loads(raw) if raw else None
                try:
                    record = store.get(task_id)
                except Exception as exc:  # noqa: BLE001 - a corrupt record is a finding, not a crash
                    record = None
                    counts.why.setdefault(task_id, []).append(f"record unreadable: {exc!r}")
                self._count_one(counts, task_id, expect, events.get(task_id, []), final, record)
                if task_id in self.waiters.first:
                    returned.append(self.waiters.first[task_id][0])
        finally:
            backend.close()
        if returned and counts.lost == 0:
            counts.settle_seconds = round(max(0.0, max(returned) - start), 2)
        return counts

    def _count_one(self, counts: Counts, task_id: str, expect: Expect, events: list[dict],
                   final: dict | None, record: Any) -> None:
        why = counts.why.setdefault(task_id, [])
        accepted = {e.get("exec") for e in events if e["ev"] == "accepted"}
        state = getattr(record, "state", None)
        status = (final or {}).get("status")
        result = (final or {}).get("result")
        if not accepted and status == "SUCCESS" and state == "succeeded" and isinstance(result, dict):
            # The "accepted" event is written by task_success, after the finish: a worker killed
            # in between (a pill's SIGKILL of a whole gevent or threads process) leaves none. The
            # record is then the witness: the execution whose token it holds was accepted.
            started = {e.get("exec") for e in events if e["ev"] == "start"}
            if (result.get("exec") in started and record is not None
                    and int(result.get("token") or -1) == int(record.token)):
                accepted = {result.get("exec")}
        got = self.waiters.first.get(task_id) if self.waiters else None
        if len(accepted) > 1:
            counts.duplicates += 1
            why.append(f"{len(accepted)} executions' successes accepted")
        if got is None:
            counts.lost += 1
            why.append(f"waiter never returned (backend {status}, lease {state})")
        elif expect.outcome == "success" and status != "SUCCESS":
            counts.lost += 1
            why.append(f"expected a success; backend {status} {str(result)[:120]}, lease {state}")
        if got is not None:
            first = got[1]
            told = first.get("status")
            # The lease is the outcome that stands: a backend that contradicts it misleads too.
            contradicts = state is not None and (
                (told == "SUCCESS" and state != "succeeded")
                or (told == "FAILURE" and state not in ("failed", "dead"))
                or (told == "REVOKED" and state != "revoked"))
            if told != status or (status == "SUCCESS" and first.get("result") != result) or contradicts:
                counts.misled += 1
                why.append(f"waiter got {told} {str(first.get('result'))[:80]}; the backend ends "
                           f"{status} {str(result)[:80]}, the lease {state}")
        ok = False
        if expect.outcome == "success":
            ok = (status == "SUCCESS" and len(accepted) == 1 and isinstance(result, dict)
                  and result.get("exec") in accepted
                  and (expect.seq is None or result.get("seq") == expect.seq)
                  and ((state == "succeeded" and int(result.get("token") or -1) == int(record.token))
                       or (record is None and self.records_may_vanish)))
        elif expect.outcome == "dead":
            ok = status == "FAILURE" and state == "dead" and not accepted
        elif expect.outcome == "revoked":
            ok = status == "REVOKED" and state in ("revoked", None) and not accepted
        if ok:
            counts.exactly_one += 1
        else:
            why.append(f"not exactly one accepted {expect.outcome}: backend {status}, lease {state}, "
                       f"{len(accepted)} accepted")
        if not why:
            counts.why.pop(task_id)

    # -- the end ------------------------------------------------------------------

    def close(self) -> None:
        for worker in self.workers:
            try:
                if worker.proc is not None and worker.proc.poll() is None:
                    worker.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            worker.kill()
        if self.waiters is not None:
            self.waiters.close()
        if self._client is not None:
            self._client.close()
        for server in self.servers.values():
            try:
                if server.running:
                    os.kill(server.process.pid, signal.SIGCONT)
            except (ProcessLookupError, AttributeError):
                pass
            server.stop()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.report()
        self.close()

    def report(self, lines: int = 60) -> None:
        """Print each worker's last log lines (pytest shows them with the failure)."""
        for worker in self.workers:
            try:
                tail = worker.log().splitlines()[-lines:]
            except OSError as exc:
                tail = [f"(log unreadable: {exc})"]
            print(f"----- {self.name}: worker {worker.name} log (last {len(tail)} lines) -----")
            print("\n".join(tail))


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def log_count(worker: Worker, text: str) -> int:
    try:
        return worker.log().count(text)
    except OSError:
        return 0


def pause(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds``, then SIGCONT (always)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


__all__ = ["Counts", "Expect", "Run", "Waiters", "log_count", "pause", "table", "wait_until"]
