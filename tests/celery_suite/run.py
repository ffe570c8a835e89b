"""Celery's own integration tests, plain and then with every task leased.

``make celery-suite`` (all of ``t/integration/test_tasks.py`` and
``test_canvas.py``) and the quick sample in ``make test`` run this. It fetches
the sdist of the installed Celery (``pip download --no-binary :all:``), starts
a throwaway redis-server as broker, backend and lease store (Celery's test
settings default to the machine's shared 6379 and to RabbitMQ: both are
pointed at it), runs the tests once plain and once with
``tests.celery_suite.leased`` loaded, prints both summaries, and lists the
tests that fail only when leased. Exit status 1 when that list is not empty
(or a run did not produce results).

    python -m tests.celery_suite.run                    # the full two files
    python -m tests.celery_suite.run -k test_retry      # a selection (pytest -k)
    python -m tests.celery_suite.run --sample           # the quick sample
    python -m tests.celery_suite.run --mode leased-first  # leased; plain only for its failures
    python -m tests.celery_suite.run --mode leased t/integration/test_tasks.py::test_retry
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

from celery_leases.testing.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".celery-suite"
FILES = ("t/integration/test_tasks.py", "t/integration/test_canvas.py")
#: Plugins the suite's tests need (markers, ordering); installed on first use.
NEEDS = ("pytest-rerunfailures", "pytest-timeout", "pytest-order", "pytest-subtests", "pydantic")
#: The quick sample: retries, chains, groups and chords (a few minutes).
SAMPLE = " or ".join((
    "test_retry", "test_task_retried", "test_replace_chain_with_empty_chain",  # retries, replace
    "test_simple_chain", "test_chain_on_error", "test_group_results_in_chain",  # chains
    "test_callback_called_by_group", "test_nested_group", "test_group_lone",  # groups
    "test_add_to_chord", "test_empty_header_chord", "test_chord_on_error",  # chords
    "test_error_propagates_to_chord_from_simple",
))


def sdist(celery_version: str) -> Path:
    """The unpacked sdist of ``celery_version`` (downloaded once into .celery-suite/)."""
    target = CACHE / f"celery-{celery_version}"
    if (target / "t" / "integration").is_dir():
        return target
    CACHE.mkdir(exist_ok=True)
    pip("download", "-q", "--no-deps", "--no-binary", ":all:", f"celery=={celery_version}", "-d", str(CACHE))
    archive = next(CACHE.glob(f"celery-{celery_version}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return target


def ensure_plugins() -> None:
    missing = []
    for name in NEEDS:
        try:
            version(name)
        except Exception:  # noqa: BLE001 - not installed
            missing.append(name)
    if missing:
        pip("install", "-q", *missing)


def pip(*args: str, tries: int = 3, pause: float = 10.0) -> None:
    """Run pip; the registry's connection breaks now and then mid-download (an IncompleteRead
    of a build dependency), so it gets ``tries`` tries, ``pause`` seconds apart."""
    for attempt in range(1, tries + 1):
        if subprocess.run([sys.executable, "-m", "pip", *args]).returncode == 0:
            return
        if attempt < tries:
            time.sleep(pause)
    raise SystemExit(f"pip {' '.join(args)}: failed {tries} times")


def run(mode: str, tree: Path, redis_port: int, targets: list[str], keyword: str | None,
        out: Path) -> tuple[dict[str, str], float]:
    """One pytest run of Celery's tests; {test id: outcome} and wall seconds."""
    env = dict(os.environ)
    url = f"redis://127.0.0.1:{redis_port}"
    env.update(TEST_BROKER=f"{url}/0", TEST_BACKEND=f"{url}/1", REDIS_HOST="127.0.0.1",
               REDIS_PORT=str(redis_port), PYTHONPATH=os.pathsep.join(
                   p for p in (str(ROOT), str(tree), env.get("PYTHONPATH", "")) if p))
    env.pop("LEASES_TEST_REDIS_URL", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-p", "no:celery_leases", "-p", "celery.contrib.pytest", "-o", "addopts=",
           "--timeout=300", f"--junitxml={out}", "--rootdir", str(tree)]
    if mode == "leased":
        cmd += ["-p", "tests.celery_suite.leased"]
    if keyword:
        cmd += ["-k", keyword]
    started = time.monotonic()
    subprocess.run(cmd + targets, cwd=tree, env=env)
    elapsed = time.monotonic() - started
    return (outcomes(out) if out.exists() else {}), elapsed


def durations(junit: Path) -> dict[str, float]:
    """{test id: seconds} of one run (call plus fixtures, as junit records it)."""
    return {f"{case.get('classname')}::{case.get('name')}": float(case.get("time") or 0.0)
            for case in ET.parse(junit).getroot().iter("testcase")}


def slower_when_leased(plain: Path, leased: Path, top: int = 15) -> list[tuple[str, float, float]]:
    """The tests whose leased run took longest over their plain run: (id, plain s, leased s)."""
    before, after = durations(plain), durations(leased)
    rows = [(t, before[t], s) for t, s in after.items() if t in before]
    return sorted(rows, key=lambda row: row[2] - row[1], reverse=True)[:top]


def node_id(test: str) -> str:
    """A junit test id (``t.integration.test_canvas.test_chord::name``) as a pytest node id."""
    classname, _, name = test.partition("::")
    parts = classname.split(".")
    module, rest = parts[:3], parts[3:]  # t.integration.<file>: every test file lives there
    return "::".join(["/".join(module) + ".py", *rest, name])


def outcomes(junit: Path) -> dict[str, str]:
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            results[name] = "failed"
        elif case.find("skipped") is not None:
            results[name] = "skipped"
        else:
            results[name] = "passed"
    return results


def summary(results: dict[str, str]) -> str:
    counts = {k: sum(1 for v in results.values() if v == k) for k in ("passed", "failed", "skipped")}
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"test files or ids (default: {' '.join(FILES)})")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--sample", action="store_true", help="the quick sample (retry, chain, group, chord)")
    parser.add_argument("--mode", choices=("both", "plain", "leased", "leased-first"), default="both",
                        help="leased-first: the leased run, then plain only for the tests that "
                             "failed leased (what make test's sample does: half the time)")
    args = parser.parse_args(argv)
    celery_version = version("celery")
    tree = sdist(celery_version)
    ensure_plugins()
    targets = args.targets or list(FILES)
    keyword = SAMPLE if args.sample else args.keyword
    modes = {"both": ("plain", "leased"), "leased-first": ("leased", "plain")}.get(args.mode, (args.mode,))
    lazy = args.mode == "leased-first"
    results: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="celery-suite-") as tmp:
        walls: dict[str, float] = {}
        for mode in modes:
            if lazy and mode == "plain":
                # Only what failed leased is asked of plain Celery: does it fail there too?
                failed = sorted(t for t, o in results["leased"].items() if o == "failed")
                if not failed:
                    results["plain"], walls["plain"] = {}, 0.0
                    break
                targets, keyword = [node_id(t) for t in failed], None
            # A fresh server per run: nothing of the plain run is left for the leased one.
            server = RedisServer(dir=Path(tmp) / mode).start()
            try:
                # Kept in .celery-suite/ so a run's per-test times can be compared afterwards.
                results[mode], elapsed = run(mode, tree, server.port, targets, keyword,
                                             CACHE / f"last-{mode}.xml")
                walls[mode] = elapsed
            finally:
                server.stop()
            print(f"\ncelery {celery_version} {mode}: {summary(results[mode])} in {elapsed / 60:.1f} min",
                  flush=True)
    status = 0
    for mode in modes:
        if not results.get(mode) and not (lazy and mode == "plain"):
            print(f"{mode}: no results (the run did not start?)")
            status = 1
    if len(modes) == 2 and status == 0:
        plain, leased = results["plain"], results["leased"]
        if not lazy:
            print(f"wall time leased/plain: {walls['leased'] / walls['plain']:.2f}")
            print("slowest when leased (plain s -> leased s):")
            for test, before, after in slower_when_leased(CACHE / "last-plain.xml",
                                                          CACHE / "last-leased.xml"):
                print(f"  {before:7.2f} -> {after:7.2f}  {test}")
        only_leased = sorted(t for t, o in leased.items() if o == "failed" and plain.get(t) != "failed")
        both = sorted(t for t, o in leased.items() if o == "failed" and plain.get(t) == "failed")
        if both:
            print("failing plain as well (not counted):\n  " + "\n  ".join(both))
        if only_leased:
            print("FAILING ONLY WHEN LEASED:\n  " + "\n  ".join(only_leased))
            status = 1
        else:
            print("no test fails only when leased")
    return status


if __name__ == "__main__":
    sys.exit(main())
