"""examples/payments/run.py, the one-command payments example, run as a user would run it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "examples" / "payments" / "run.py"


def living_processes_of(workdir: str) -> list[int]:
    """Pids of live (not zombie) processes whose environment mentions run.py's work directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if workdir.encode() in (entry / "environ").read_bytes() and \
                    (entry / "stat").read_text().split(")")[-1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def assert_all_gone(output: str) -> None:
    """Every process group run.py reported, and every process it started at all, has exited."""
    groups = [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]
    assert groups, "run.py reported no processes"
    deadline = time.monotonic() + 5
    for pgid in groups:
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process group {pgid} still alive after run.py exited"
            time.sleep(0.05)
    workdir = re.search(r"files in (\S+)", output).group(1)
    if Path("/proc/self/environ").exists():
        assert living_processes_of(workdir) == [], f"processes of {workdir} left running"


def test_the_payments_example_charges_once_and_refuses_the_paused_worker():
    # When the example runs end to end
    proc = subprocess.run([sys.executable, str(RUN)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    out = proc.stdout
    # Then it succeeds, with exactly one charge and the paused worker's write refused
    assert proc.returncode == 0, out + proc.stderr
    assert "[ok] exactly one card charge" in out
    assert "[ok] A's late fenced write was refused" in out
    assert re.search(r"worker A's late write was refused: fenced write to orders\.id='order-1001' "
                     r"with token \d+ refused", out), out
    assert "FAILED" not in out
    # And every process it started is gone
    assert_all_gone(out)


def test_the_payments_example_cleans_up_on_ctrl_c():
    # Given the example running, with worker A paused mid-charge
    proc = subprocess.Popen([sys.executable, str(RUN)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "paused it with SIGSTOP" in line:
                break
        else:
            raise AssertionError("".join(lines))
        # When the user presses Ctrl-C
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    # Then it stops every process it started and exits with 130
    assert proc.returncode == 130, out
    assert "stopped every process this example started" in out
    assert_all_gone(out)
