"""Children started in their own sessions, each logging to a file, all stopped on the way out.

:class:`Interrupts` turns Ctrl-C and SIGTERM into KeyboardInterrupt outside
its shielded blocks; :class:`Processes` starts, signals and stops named
children. The runnable examples (``examples/``) drive their workers with them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence


__all__ = ["Interrupts", "Processes"]


class Interrupts:
    """Ctrl-C and SIGTERM become KeyboardInterrupt, except inside ``shielded()``.

    Inside it they are held until the block ends, so a child can never be
    started without being registered for the cleanup, and the cleanup itself
    cannot be cut short. Installs its handlers when created.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def shielded(self, deliver: bool = True) -> Iterator[None]:
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
    """Named children in their own sessions (Ctrl-C reaches only us), all stopped by ``stop_all``.

    Each child logs (stdout and stderr) to ``workdir/NAME.log``; signals go to
    its whole process group (a worker and its pool processes). ``error`` is
    the exception ``wait_for_log`` raises.
    """

    def __init__(self, workdir: Path, interrupts: Interrupts,
                 error: Callable[[str], BaseException] = RuntimeError) -> None:
        self.workdir = Path(workdir)
        self.interrupts = interrupts
        self.error = error
        self.procs: dict[str, subprocess.Popen] = {}
        self.status: dict[str, str] = {}      #: name -> running | killed | paused

    def start(self, name: str, args: list[str], env: dict | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        with self.interrupts.shielded():
            with open(self.log_path(name), "ab") as log:
                proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[name] = proc
            self.status[name] = "running"
        return proc

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        """Signal a child's whole process group (a worker and its pool processes)."""
        os.killpg(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        """SIGKILL a child's whole process group, as a crash would."""
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait()
        self.status[name] = "killed"

    def pause(self, name: str) -> None:
        self.signal(name, signal.SIGSTOP)
        self.status[name] = "paused"

    def resume(self, name: str) -> None:
        self.signal(name, signal.SIGCONT)
        self.status[name] = "running"

    def wait_for_log(self, name: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            if self.procs[name].poll() is not None:
                raise self.error(f"{name} exited with {self.procs[name].returncode}:\n"
                                 f"{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise self.error(f"{name} did not log {text!r} within {timeout}s:\n"
                                 f"{self.log(name)[-3000:]}")
            time.sleep(0.05)

    def stop(self, names: Sequence[str]) -> None:
        """Stop these children together; idempotent.

        SIGCONT (a stopped process cannot handle SIGTERM) and SIGTERM to each
        process group, up to 10 s for a warm shutdown, then SIGKILL to the
        group (and so to any pool process left in it).
        """
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
        """Stop every child, the others first and the one named ``redis`` last; idempotent."""
        self.stop([n for n in self.procs if n != "redis"])
        self.stop(["redis"])
