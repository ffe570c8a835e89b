"""Processes the tests start: a script in a fresh interpreter, and a one-command example
(examples/*), with the checks that it left no process and no files behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def run_fresh(script: str, *, timeout: float = 60) -> str:
    """Run ``script`` with ``python -c`` in a fresh interpreter and return its stdout.

    For what the suite's own process cannot show: it has imported and patched
    everything already. AssertionError, with the script's stderr, when it exits non-zero.
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


def living_processes_of(workdir: str) -> list[int]:
    """Pids of live (not zombie) processes whose environment mentions the example's work directory."""
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
    """Every process group the example reported, and every process it started at all, has exited;
    its work directory (``files in DIR``) is removed unless it said it kept its logs there."""
    groups = [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]
    assert groups, "the example reported no processes"
    deadline = time.monotonic() + 5
    for pgid in groups:
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"process group {pgid} still alive after the example exited"
            time.sleep(0.05)
    workdir = re.search(r"files in (\S+)", output).group(1)
    if Path("/proc/self/environ").exists():
        assert living_processes_of(workdir) == [], f"processes of {workdir} left running"
    assert not Path(workdir).exists() or "logs kept in" in output


def interrupt_when(command: list[str], marker: str, **popen: object) -> tuple[int, str]:
    """Run ``command`` until a line of its output contains ``marker``, then press Ctrl-C
    (SIGINT) and wait up to 30 s for it to exit; return (exit code, all its output).

    AssertionError, with the output, when it exits without printing ``marker``.
    """
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                break
        else:
            raise AssertionError("".join(lines))
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + rest
