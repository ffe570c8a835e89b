"""The script-cost benchmark runs end to end under valgrind (a smoke test, not a timed one)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_script_cost_counts_each_phase_and_prints_the_ratio_to_kombus_acks(tmp_path: Path) -> None:
    # Given a few tasks, When the benchmark counts the server's instructions per phase
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "script_cost.py"), "-n", "20",
                          "--json", str(tmp_path / "cost.json")],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # Then every phase was counted (a phase whose switch-on came late would read ~0)
    per = json.loads((tmp_path / "cost.json").read_text())["instructions_per_task"]
    for phase in ("enqueue", "acquire", "finish", "finish, no result", "kombu ack bookkeeping"):
        assert per[phase] > 1000, (phase, per)
    # And a script call costs more than the bare EVALSHA it is built on
    assert per["finish, no result"] > per["EVALSHA return 1"] > per["PING"]
    assert "/ kombu acks" in out.stdout


def test_script_cost_wall_reads_the_servers_time_per_task_beside_the_floor(tmp_path: Path) -> None:
    # Given one round of the wall-clock part (a plain redis-server, INFO commandstats)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "script_cost.py"), "-n", "20", "--wall", "1",
                          "--json", str(tmp_path / "cost.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # Then the lease, its commands alone and the packed design each read a server time per task
    wall = json.loads((tmp_path / "cost.json").read_text())["usec_per_task"]
    lease, floor = wall["lease (acquire + finish, no result)"][0], wall["floor: their commands alone"][0]
    assert lease > 0 and floor > 0 and wall["packed record, commands alone (weighed)"][0] > 0, wall
    # And the target is judged (which of lease and floor is cheaper is the benchmark's finding, read
    # over several rounds: one round of wall-clock time on a shared machine cannot order them)
    assert "server time per task" in out.stdout and "target: a lease's acquire + finish" in out.stdout
