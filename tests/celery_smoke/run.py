"""``python -m tests.celery_smoke.run [PYTEST ARGS]`` (``make smoke``): Celery's own smoke tests, leased.

Runs ``t/smoke/tests/failover/test_worker_failover.py``, ``t/smoke/tests/test_tasks.py``
and ``t/smoke/tests/test_worker.py`` of the installed Celery's sdist (fetched
once into .celery-suite/ with ``pip download --no-binary :all:``) unchanged,
through celery_leases.testing.pytest_celery: brokers, backends and workers
are local processes, every task is leased, no Docker daemon is used and
nothing touches 6379. The only addition to the tree is a conftest of
overrides (tests/celery_smoke/smoke_conftest.py). Needs pytest-celery
(``make smoke`` puts the pinned release in .pytest-celery/). Exits with
pytest's status.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import celery

from tests.celery_suite.run import sdist

HERE = Path(__file__).resolve().parent
TARGETS = ("t/smoke/tests/failover/test_worker_failover.py", "t/smoke/tests/test_tasks.py",
           "t/smoke/tests/test_worker.py")


def main(argv: list[str]) -> int:
    try:
        import pytest_celery  # noqa: F401
    except ImportError:
        print("tests.celery_smoke.run: pytest-celery is not importable: make smoke installs it, or "
              "pip install -e '.[pytest-celery]'", file=sys.stderr)
        return 2
    source = sdist(celery.__version__)
    with tempfile.TemporaryDirectory(prefix="celery-smoke-") as tmp:
        tree = Path(tmp) / source.name
        shutil.copytree(source, tree)
        override = tree / "t" / "smoke" / "tests" / "conftest.py"
        if override.exists():
            raise SystemExit(f"{override} exists in this Celery release: merge the overrides into it")
        shutil.copy(HERE / "smoke_conftest.py", override)
        paths = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
        # An unreachable daemon address: anything that still reaches for Docker fails loudly.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths),
               "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", "--timeout", "180",
                   *TARGETS, *argv]
        return subprocess.run(command, cwd=tree, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
