"""Real ``celery worker`` subprocesses for integration tests.

Each worker runs ``tests/apps/leased_app.py`` (or another app module) with its
environment; tests SIGKILL, SIGSTOP and SIGCONT them like an operator or the
kernel would.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from celery_leases.processes import wait_for as _wait_for


ROOT = Path(__file__).resolve().parent.parent
CELERY = str(Path(sys.executable).with_name("celery"))


class Worker:
    def __init__(self, name: str, env: dict, *, pool: str = "prefork", concurrency: int = 2,
                 app: str = "tests.apps.leased_app", log_dir: Path, extra: tuple = ()) -> None:
        self.name, self.pool, self.concurrency = name, pool, concurrency
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "LEASES_TEST_POOL": pool, **env}
        self.log_path = Path(log_dir) / f"worker-{name}.log"
        # A unique node name: RabbitMQ keeps a dead node's exclusive pidbox queue for a while.
        node = f"{name}-{os.urandom(3).hex()}@%h"
        self.args = [CELERY, "-A", app, "worker", "-P", pool, "-c", str(concurrency),
                     "-n", node, "-l", "info", "--without-mingle", "--without-gossip",
                     *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "Worker":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT), start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b" ready." in self.log_path.read_bytes():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def signal(self, sig: int, main_only: bool = False) -> None:
        """Signal the whole worker (main process and pool children), or its main process only."""
        if main_only:
            os.kill(self.pid, sig)
        else:
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the main process and its pool children at once (a host or OOM kill)."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            self._log.close()
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL if it does not exit."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            self._log.close()
            return
        try:
            os.killpg(self.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        except ProcessLookupError:
            pass
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` after ``timeout``."""
    return _wait_for(predicate, timeout, what, interval=interval)


def starts(history, task_id: str) -> list:
    """The ``start`` events of ``task_id`` in a test's history (tests/conftest.py ``history``)."""
    return [h for h in history() if h[0] == "start" and h[1] == task_id]


def stale_owner_race(a: "Worker", start_b, store, history, task_id: str, first, timeout: float = 20):
    """The seed's race: worker A, running ``task_id`` (its start event ``first``), is paused
    (SIGSTOP) past its ttl; recovery re-publishes the task and worker B (``start_b()``)
    runs the copy with a higher token; A is resumed and finishes its body.

    Returns (B, B's start event); the caller checks whose outcome stands.
    """
    a.signal(signal.SIGSTOP)
    try:
        b = start_b()
        _wait_for(lambda: store.expired(), 10, what="A's lease to expire")
        assert store.recover().recovered == 1
        _wait_for(lambda: len(starts(history, task_id)) == 2, timeout, what="B to start the copy")
        second = starts(history, task_id)[1]
        assert int(second[3]["token"]) > int(first[3]["token"])
    finally:
        a.signal(signal.SIGCONT)
    _wait_for(lambda: [h for h in history() if h[0] == "end" and h[2] == first[2]], 15,
              what="A to finish its body")
    return b, second
