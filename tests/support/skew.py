"""Processes whose wall clock is hours off: libfaketime, wall clock only.

The ``libfaketime`` wheel (a test extra, so ``make venv`` installs it) ships
``libfaketime.so.1``; ``skewed_env`` preloads it into a child process with
``FAKETIME`` set to an offset such as ``"+1h"``.

Only the wall clock is skewed (``FAKETIME_DONT_FAKE_MONOTONIC=1``). Faking the
monotonic clock too breaks Python 3.11: libfaketime 0.9.10 rewrites the
absolute deadline of ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)`` that
``time.sleep`` uses, and the sleep hangs or fails with EINVAL. A worker's wall
clock is what a misconfigured host gets wrong (NTP off, a VM restored from a
snapshot); its monotonic clock only ever measures intervals, which skew does
not change. So no C shim is needed: ``test_a_skewed_process_sleeps_normally``
proves the sleep works, and that the wall clock really is off.

Without the library the caller's test skips locally and fails under ``CI=true``
(tests/support/services.py): a clock-skew test that never runs is not a test.
"""
from __future__ import annotations

import os
from pathlib import Path

from tests.support.services import skip_or_fail

#: Where Debian's ``libfaketime`` package puts the library, if the wheel is absent.
SYSTEM_LIBRARIES = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                    "/usr/lib/faketime/libfaketime.so.1")


def faketime_library() -> str | None:
    """The absolute path of libfaketime.so.1 (the wheel's first), or None."""
    try:
        import libfaketime
    except ImportError:
        libfaketime = None
    if libfaketime is not None:
        _, env = libfaketime.get_reload_information()
        for directory in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
            path = Path(directory) / env.get("LD_PRELOAD", "libfaketime.so.1")
            if directory and path.is_file():
                return str(path)
    return next((p for p in SYSTEM_LIBRARIES if Path(p).is_file()), None)


def skewed_env(offset: str, base: dict | None = None) -> dict:
    """``base`` (default os.environ) plus what makes a child's wall clock ``offset`` off
    ("+1h", "-5h"; libfaketime's relative syntax). Skips, or fails under CI, without the library."""
    library = faketime_library()
    if library is None:
        skip_or_fail("libfaketime is not installed (make venv installs the libfaketime wheel; "
                     "or apt-get install libfaketime)")
    env = dict(os.environ if base is None else base)
    preload = " ".join(p for p in (env.get("LD_PRELOAD"), library) if p)
    env.update(LD_PRELOAD=preload, FAKETIME=offset, FAKETIME_DONT_FAKE_MONOTONIC="1",
               FAKETIME_NO_CACHE="1")
    return env
