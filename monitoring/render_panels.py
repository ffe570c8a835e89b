#!/usr/bin/env python
"""Render the dashboard's main panels from a real workload: docs/_static/dashboard.png.

    .venv/bin/pip install matplotlib        # once; not a test dependency
    .venv/bin/python monitoring/render_panels.py [--out docs/_static/dashboard.png] [--samples FILE]

It starts a throwaway redis-server and two real ``celery worker`` processes
(this file is also their app: ``-A render_panels``) that call
``enable_prometheus(app)`` and serve ``/metrics``; sends a stream of leased
tasks; SIGSTOPs worker A longer than the ttl (its leases are taken over, its
late outcomes refused), later SIGKILLs it while it runs tasks that allow no
recovery (they are declared dead) and starts it again. It pauses A twice;
the known label values are exported at 0 from the start, so ``rate()`` sees
the first pause in the labelled counters too. Every 2 s it scrapes
both workers' ``/metrics``, then computes what the dashboard's queries compute
(``rate()`` over a window, counter resets handled, summed like the ``sum by``
of each panel) and plots it with matplotlib. About two minutes; every process
it starts is stopped on the way out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from celery import Celery
from celery.signals import worker_init

import celery_leases
from celery_leases import LeasedTask

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TTL = 3.0
SCRAPE_EVERY = 2.0
RATE_WINDOW = 20.0            #: seconds of the plotted rate(): longer than a pause plus a scrape, as
                              #: $__rate_interval (4 scrapes at least) is on the dashboard

# Set by main() to its throwaway server; the default is a port nothing listens on, so
# importing this file never reaches another Redis.
REDIS_URL = os.environ.get("RENDER_REDIS_URL", "redis://127.0.0.1:1/0")
app = Celery("render_panels", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue="render-panels", leases_key_prefix="render-panels",
    leases_ttl=TTL, leases_recovery_interval=1.0, leases_max_recoveries=3,
    task_acks_late=True, worker_prefetch_multiplier=1, result_expires=600,
    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
)
celery_leases.install(app)


@worker_init.connect
def _serve_metrics(**kwargs) -> None:
    """In each worker (threads pool: one process), export the metrics on RENDER_METRICS_PORT."""
    import prometheus_client

    from celery_leases.ops.metrics import enable_prometheus
    enable_prometheus(app)
    prometheus_client.start_http_server(int(os.environ["RENDER_METRICS_PORT"]), addr="127.0.0.1")


@app.task(base=LeasedTask, name="render_panels.work")
def work(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.task(base=LeasedTask, name="render_panels.fragile", lease_max_recoveries=0)
def fragile(seconds: float) -> float:
    """A task allowed no recovery: if its worker dies, it is declared dead."""
    time.sleep(seconds)
    return seconds


# -- the run ------------------------------------------------------------------


@dataclass
class Scrapes:
    samples: list[tuple[float, str, str, tuple, float]]     #: t, worker, sample name, labels, value
    events: list[tuple[float, str]]                         #: t, what was done to a worker


class Run:
    def __init__(self, workdir: Path) -> None:
        from celery_leases.testing.servers import RedisServer, free_port
        self.workdir = workdir
        self.redis = RedisServer().start()
        self.ports = {"A": free_port(), "B": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.samples: list[tuple[float, str, str, tuple, float]] = []   # t, worker, name, labels, value
        self.events: list[tuple[float, str]] = []
        self.t0 = time.monotonic()
        self.stopping = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start_worker(self, name: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]),
               "RENDER_REDIS_URL": self.redis.url, "RENDER_METRICS_PORT": str(self.ports[name])}
        log = open(self.workdir / f"worker-{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "render_panels", "worker", "-P", "threads", "-c", "4",
             "-n", f"{name}@%h", "-l", "info", "--without-mingle", "--without-gossip"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(HERE), start_new_session=True)
        deadline = time.monotonic() + 60
        while b" ready." not in (self.workdir / f"worker-{name}.log").read_bytes():
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n"
                                   f"{(self.workdir / f'worker-{name}.log').read_text()[-3000:]}")
            time.sleep(0.1)

    def signal(self, name: str, sig: int, event: str | None = None) -> None:
        os.killpg(self.procs[name].pid, sig)
        if event:
            self.events.append((self.now(), event))

    def scrape(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families
        while not self.stopping.wait(SCRAPE_EVERY):
            t = self.now()
            for name, port in self.ports.items():
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
                except OSError:
                    continue            # paused, killed or not started: a missed scrape, as in Prometheus
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name.startswith("celery_leases_"):
                            self.samples.append((t, name, s.name, tuple(sorted(s.labels.items())), s.value))

    def produce(self, tasks, until: float) -> None:
        rng = random.Random(1)
        while self.now() < until and not self.stopping.is_set():
            tasks.work.delay(round(rng.uniform(1.5, 4.0), 2))
            time.sleep(0.4)

    def stop(self) -> None:
        self.stopping.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
                proc.wait()
        self.redis.cleanup()


def run_workload() -> Scrapes:
    workdir = Path(tempfile.mkdtemp(prefix="render-panels-"))
    run = Run(workdir)
    try:
        # The app as the workers import it (not __main__'s copy), on the throwaway server.
        os.environ["RENDER_REDIS_URL"] = run.redis.url
        sys.path.insert(0, str(HERE))
        import render_panels as tasks

        run.start_worker("A")
        run.start_worker("B")
        run.t0 = time.monotonic()
        threading.Thread(target=run.scrape, daemon=True).start()
        producer = threading.Thread(target=run.produce, args=(tasks, 110.0), daemon=True)
        producer.start()
        # Two pauses: a labelled series (lost, refused, taken_over="true") is created by
        # its first increment, which rate() cannot see; the second pause shows in it.
        for start in (20, 45):
            time.sleep(max(0.0, start - run.now()))
            run.signal("A", signal.SIGSTOP, "A paused (SIGSTOP)")
            time.sleep(3 * TTL)
            run.signal("A", signal.SIGCONT, "A resumed")
        time.sleep(max(0.0, 72 - run.now()))
        for _ in range(6):
            tasks.fragile.delay(20.0)
        time.sleep(4)
        run.signal("A", signal.SIGKILL, "A killed (SIGKILL)")
        run.procs["A"].wait()
        time.sleep(6)
        run.start_worker("A")
        run.events.append((run.now(), "A restarted"))
        producer.join()
        time.sleep(15)
    finally:
        run.stop()
    (workdir / "samples.json").write_text(json.dumps({"samples": run.samples, "events": run.events}))
    print(f"{len(run.samples)} samples scraped; worker logs and samples.json in {workdir}")
    return Scrapes(run.samples, run.events)


def load_samples(path: Path) -> Scrapes:
    """A run's scraped samples read back (--samples), to re-plot without running again."""
    data = json.loads(path.read_text())
    return Scrapes([(t, w, n, tuple(tuple(kv) for kv in labels), v) for t, w, n, labels, v in data["samples"]],
                   [tuple(e) for e in data["events"]])


# -- what the dashboard's queries compute ---------------------------------------


def rates(run: Scrapes, name: str, by: str | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """``sum by (by) (rate(name[RATE_WINDOW]))``; ``by="instance"`` groups by worker.

    Per series: the counter's running increase (a drop is a restart, counted
    from 0, as rate() does), its slope over the window, then summed by label.
    """
    series: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for t, worker, sample, labels, value in run.samples:
        if sample == name:
            series[(worker, labels)].append((t, value))
    grid = sorted({s[0] for s in run.samples})
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(grid))
    for (worker, labels), points in series.items():
        key = worker if by == "instance" else dict(labels).get(by, "") if by else name
        increases, total, last = [], 0.0, None
        for t, v in points:
            total += v if last is None or v < last else v - last
            last = v
            increases.append((t, total))
        for i, t in enumerate(grid):
            window = [(tt, vv) for tt, vv in increases if t - RATE_WINDOW <= tt <= t]
            if len(window) >= 2 and window[-1][0] > window[0][0]:
                out[key][i] += (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
    if not out:
        out[name] = [0.0] * len(grid)
    return {k: (grid, v) for k, v in sorted(out.items())}


def gauges(run: Scrapes, name: str) -> dict[str, tuple[list[float], list[float]]]:
    """``sum by (instance) (name)`` of a gauge: each worker's last scraped value (a missed
    scrape leaves a gap, as in Prometheus)."""
    grid = sorted({s[0] for s in run.samples})
    seen = {(t, worker): v for t, worker, sample, _, v in run.samples if sample == name}
    workers = sorted({w for _, w in seen})
    return {w: (grid, [seen.get((t, w), float("nan")) for t in grid]) for w in workers} or \
        {name: (grid, [0.0] * len(grid))}


def only(lines: dict) -> tuple[list[float], list[float]]:
    """The one line of a query without ``by``."""
    return next(iter(lines.values()))


def plot(run: Scrapes, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(13, 13), sharex=True)
    fig.suptitle("celery-leases dashboard, main panels: two real workers, their /metrics scraped "
                 f"every {SCRAPE_EVERY:g} s, rate() over {RATE_WINDOW:g} s", fontsize=11)

    def draw(ax, title, lines, unit):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, label=label, linewidth=1.4)
        for t, _ in run.events:
            ax.axvline(t, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(unit, fontsize=8)
        top = max([y for _, ys in lines.values() for y in ys if y == y] or [0])
        ax.set_ylim(0, top * 1.15 or 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")

    draw(axes[0][0], "Leases held", gauges(run, "celery_leases_held"), "leases")
    acquired = rates(run, "celery_leases_acquired_total", "taken_over")
    draw(axes[0][1], "Acquisitions", {f"taken_over={k}": v for k, v in acquired.items()}, "per s")
    draw(axes[1][0], "Leases lost, by reason", rates(run, "celery_leases_lost_total", "reason"), "per s")
    draw(axes[1][1], "Recoveries and dead tasks",
         {"recovered": only(rates(run, "celery_leases_recovered_total")),
          "dead": only(rates(run, "celery_leases_dead_total"))}, "per s")
    draw(axes[2][0], "Refused stale outcomes, by outcome",
         rates(run, "celery_leases_refused_total", "outcome"), "per s")
    xs, total = only(rates(run, "celery_leases_time_to_recovery_seconds_sum"))
    _, count = only(rates(run, "celery_leases_time_to_recovery_seconds_count"))
    mean = [s / c if c else float("nan") for s, c in zip(total, count)]
    draw(axes[2][1], "Time to recovery (mean)", {"mean": (xs, mean)}, "seconds")
    latency = {}
    renew_sum = rates(run, "celery_leases_renew_seconds_sum", "instance")
    for worker, (xs, counts) in rates(run, "celery_leases_renew_seconds_count", "instance").items():
        sums = renew_sum.get(worker, (xs, [0.0] * len(xs)))[1]
        latency[worker] = (xs, [1000 * a / c if c else float("nan") for a, c in zip(sums, counts)])
    draw(axes[3][0], "Renew latency (mean per call)", latency, "ms")
    draw(axes[3][1], "Recovery passes, by result",
         rates(run, "celery_leases_recovery_passes_total", "result"), "per s")
    for ax in axes[3]:
        ax.set_xlabel("seconds since the workload started", fontsize=8)
    top = axes[0][0].get_ylim()[1]
    for t, event in run.events:
        axes[0][0].annotate(event, (t, top), fontsize=7, rotation=90, va="top", ha="right", color="dimgrey")
    fig.text(0.01, 0.005, "Dotted lines: what was done to worker A. The known label values (lost reasons, "
             "refused outcomes, taken_over, pass results) are exported at 0 from the start, so rate() sees "
             "their first increment.", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.015, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "_static" / "dashboard.png")
    parser.add_argument("--samples", type=Path, help="plot the samples.json of an earlier run")
    args = parser.parse_args()
    plot(load_samples(args.samples) if args.samples else run_workload(), args.out)


if __name__ == "__main__":
    main()
