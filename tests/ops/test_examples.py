"""The examples' one commands, run as a user would run them (non-TTY), against the session's Redis.

Each example gets ``REDIS_URL`` = the session's server, so none starts a server
of its own; they isolate themselves with a random key prefix and queue.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import redis

from tests.support.processes import assert_all_gone, interrupt_when

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(script: Path, *args: str, env: dict, cwd: Path, timeout: float = 120) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def example_env(redis_url: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    if redis_url:
        env["REDIS_URL"] = redis_url
    return env


# -- examples/quickstart/demo.py (make demo) ----------------------------------------

DEMO = EXAMPLES / "quickstart" / "demo.py"


def test_the_quickstart_demo_loses_nothing_and_refuses_the_stale_outcome(redis_server_url, tmp_path):
    # When the demo runs without a terminal, on the session's Redis
    timeline = tmp_path / "timeline.svg"
    code, out = run_example(DEMO, "--timeline", str(timeline), env=example_env(redis_server_url),
                            cwd=tmp_path)
    # Then it exits 0 with every task accounted for: recovered, one accepted outcome, none lost
    assert code == 0, out
    assert re.search(r"^  tasks:\s+6$", out, re.MULTILINE), out
    assert re.search(r"^  recoveries:\s+4 ", out, re.MULTILINE), out
    refused = re.search(r"^  refused outcomes:\s+(\d+) ", out, re.MULTILINE)
    assert refused and int(refused.group(1)) >= 1, out
    assert re.search(r"^  accepted outcomes:\s+6 \(exactly one per task\)$", out, re.MULTILINE), out
    assert re.search(r"^  lost:\s+0$", out, re.MULTILINE), out
    assert "OK: lost = 0, exactly one accepted outcome per task" in out
    # And what it says about beat is what its settings do: the workers recover, beat has no
    # entry and is not started
    import importlib.util
    from celery_leases.config import get_config
    spec = importlib.util.spec_from_file_location("quickstart_app", EXAMPLES / "quickstart" / "app.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    config = get_config(quickstart.app)
    assert config.worker_recovery and quickstart.app.conf.beat_schedule == {}
    assert (f"recovery: the workers run a pass every {config.recovery_interval:g}s "
            f"(leases_worker_recovery); no beat entry, no celery beat needed") in out
    assert "celery beat started" not in out and "beat running" not in out
    # And it told the story: A killed, B stopped then resumed, B's outcome refused
    assert "SIGKILL worker A, holding 2 task(s)" in out
    assert "SIGSTOP worker B, holding 2 task(s)" in out
    assert re.search(r"SIGCONT worker B after \d+\.\ds", out), out
    assert re.search(r"worker B's outcome of task [0-9a-f]{8} \(token \d+\) REFUSED", out), out
    # And without a terminal it printed snapshots of the table, not escape codes
    assert "\x1b[" not in out
    assert len(re.findall(r"^\[\s*\d+\.\ds\] workers: ", out, re.MULTILINE)) >= 2, out
    assert re.search(r"^  [0-9a-f]{8}  succeeded  C .*refused \(B, token \d+\)$", out, re.MULTILINE), out
    # And it wrote the timeline where asked, a well-formed SVG with the refusal marked
    assert f"timeline: {timeline.resolve()}" in out
    root = ET.parse(timeline).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert "refused" in timeline.read_text()
    # And it removed its lease keys and its queue from the shared Redis
    prefix = re.search(r"key prefix and queue (quickstart-[0-9a-f]{8})", out).group(1)
    client = redis.Redis.from_url(redis_server_url)
    try:
        assert list(client.scan_iter(match=f"{{{prefix}}}:*")) == []
        assert not client.exists(prefix)
    finally:
        client.close()
    # And every process it started is gone
    assert "stopped every process this demo started" in out
    assert_all_gone(out)


def test_the_quickstart_demo_cleans_up_on_ctrl_c(redis_server_url, tmp_path):
    # Given the demo running, with worker A killed and worker B stopped
    # When the user presses Ctrl-C
    code, out = interrupt_when([sys.executable, str(DEMO), "--timeline", str(tmp_path / "t.svg")],
                               "SIGSTOP worker B", cwd=tmp_path, env=example_env(redis_server_url))
    # Then it stops every process it started (the stopped one too) and exits with 130
    assert code == 130, out
    assert "stopped every process this demo started" in out
    assert_all_gone(out)


# -- examples/beat/run.py -------------------------------------------------------------


def test_the_beat_example_runs_the_leased_periodic_task_and_schedules_recovery(redis_server_url, tmp_path):
    # When the beat example runs
    code, out = run_example(EXAMPLES / "beat" / "run.py", env=example_env(redis_server_url), cwd=tmp_path)
    # Then the schedule holds the project's entry and the recovery entry install() added
    assert code == 0, out
    assert re.search(r"^  send-report\s+task app\.send_report\s+every 2s", out, re.MULTILINE), out
    assert re.search(r"^  celery_leases\.recover\s+task celery_leases\.recover\s+every 2s\s+"
                     r"\(added by celery_leases\.install\(app\)\)", out, re.MULTILINE), out
    # And the periodic task ran, each run under its own lease, and beat's recovery passes ran
    runs = re.findall(r"^  [0-9a-f-]{36}\s+(\d+)  succeeded$", out, re.MULTILINE)
    assert len(runs) >= 3 and len(set(runs)) == len(runs), out
    assert "[ok] a worker ran beat's recovery passes" in out
    assert "FAILED" not in out
    # And every process it started is gone
    assert_all_gone(out)


# -- examples/django/run.py -----------------------------------------------------------

DJANGO = EXAMPLES / "django" / "run.py"


def test_the_django_example_reads_the_celery_leases_settings(redis_server_url, tmp_path):
    # When the Django example runs, with a lease store to check
    code, out = run_example(DJANGO, env=example_env(redis_server_url), cwd=tmp_path, timeout=60)
    # Then the CELERY_LEASES_* settings are in effect, and the rest are defaults
    assert code == 0, out
    assert re.search(r"^  CELERY_LEASES_TTL\s+60\.0\s+proj/settings\.py$", out, re.MULTILINE), out
    assert re.search(r"^  CELERY_LEASES_KEY_PREFIX\s+'proj'\s+proj/settings\.py$", out, re.MULTILINE), out
    assert re.search(r"^  CELERY_LEASES_HEARTBEAT_INTERVAL\s+20\.0\s+default: ttl / 3$", out, re.MULTILINE), out
    assert re.search(r"^  CELERY_LEASES_RETENTION\s+86400\.0\s+default$", out, re.MULTILINE), out
    # (the workers run the recovery passes by default, so beat gets no entry of its own)
    assert "no celery_leases.recover entry: the workers run the recovery passes" in out, out
    # And a task's own lease options win
    assert re.search(r"proj\.tasks\.rebuild_search_index: ttl 300s, .*progress timeout 120s", out), out
    assert re.search(r"proj\.tasks\.send_invoice: ttl 60s, ", out), out
    # And the lease store answers at REDIS_URL
    assert "lease store reachable at redis://" in out
    assert "OK: the CELERY_LEASES_* settings are valid." in out


def test_the_django_example_needs_no_redis(tmp_path):
    code, out = run_example(DJANGO, env=example_env(None), cwd=tmp_path, timeout=60)
    assert code == 0, out
    assert "lease store" not in out
    assert "OK: the CELERY_LEASES_* settings are valid." in out
