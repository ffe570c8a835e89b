"""Write the compatibility table of docs/compatibility.md from a ``make matrix`` run.

Usage: ``python -m tests.support.matrix_report RESULTS_DIR DOC``. RESULTS_DIR holds one
junit XML per Celery env (tests/deployments/test_matrix.py, with the installed versions as
suite properties) and tox's ``--result-json`` file (``tox.json``) with every
env's exit status. Only the part of DOC between the two markers is replaced;
the prose around it (the reasons behind failures) is written by hand.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

BEGIN = "<!-- matrix:begin (written by tests/support/matrix_report.py; edit around it) -->"
END = "<!-- matrix:end -->"
CELL = re.compile(r"^(?P<check>test_\w+)\[(?P<pool>\w+)-(?P<broker>\w+)\]$")
POOL_ORDER = ["prefork", "threads", "solo", "gevent", "eventlet"]
BROKER_NAMES = {"redis": "Redis", "amqp": "RabbitMQ"}
CHECKS = {
    "test_leased_task_runs_once_and_finishes_with_its_token": "once",
    "test_task_longer_than_its_ttl_keeps_its_lease": "heartbeat",
    "test_stale_owner_outcome_is_refused": "stale",
    "test_killed_pool_child_is_released_and_recovered": "child-kill",
    "test_retry_hands_the_lease_to_the_next_attempt": "retry",
}
VERSIONED = ("celery", "kombu", "billiard", "redis", "amqp", "gevent", "eventlet")


def _message(element: ET.Element) -> str:
    text = element.get("message") or (element.text or "")
    text = text.strip().splitlines()[0] if text.strip() else ""
    for prefix in ("Skipped: ", "not supported: ", "not applicable: "):
        text = text.removeprefix(prefix)
    return text.replace("|", "\\|")[:160]


def read_env(path: Path) -> dict:
    """One tox env's junit file -> versions, cells {(pool, broker): {check: (status, note, secs)}}."""
    suite = ET.parse(path).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    versions = {p.get("name", "").removeprefix("version."): p.get("value", "")
                for p in suite.iter("property")}
    cells: dict = defaultdict(dict)
    for case in suite.iter("testcase"):
        match = CELL.match(case.get("name", ""))
        if not match:
            continue
        status, note = "pass", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                status, note = {"failure": "fail", "error": "fail", "skipped": "skip"}[tag], _message(found)
                break
        check = CHECKS.get(match["check"], match["check"])
        cells[(match["pool"], match["broker"])][check] = (status, note, float(case.get("time", 0)))
    return {"versions": versions, "cells": cells}


def summarise(checks: dict) -> tuple[str, str, float]:
    """A cell's verdict, its detail, and its run time."""
    seconds = sum(secs for _, _, secs in checks.values())
    failed = {c: note for c, (s, note, _) in checks.items() if s == "fail"}
    skipped = {c: note for c, (s, note, _) in checks.items() if s == "skip"}
    passed = [c for c, (s, _, _) in checks.items() if s == "pass"]
    if failed:
        detail = "; ".join(f"{c}: {note}" for c, note in failed.items())
        return "**fail**", detail, seconds
    if not passed:
        reasons = sorted(set(skipped.values()))
        return "not supported", "; ".join(reasons), seconds
    detail = f"{len(passed)}/{len(checks)} checks"
    if skipped:
        detail += "; " + "; ".join(f"{c} n/a: {note}" for c, note in skipped.items())
    return "pass", detail, seconds


def render(results_dir: Path, commit: str, today: str) -> str:
    envs = {p.stem: read_env(p) for p in sorted(results_dir.glob("celery*.xml"))}
    lines = [BEGIN, "",
             f"Run of {today} at commit `{commit}` (`make matrix`; Python "
             f"{sys.version.split()[0]}, redis-server from the machine, RabbitMQ on loopback).", ""]
    tox_json = results_dir / "tox.json"
    if tox_json.exists():
        data = json.loads(tox_json.read_text())
        # Every env's own exit status: a celery env whose cells all passed can
        # still fail (pytest crashing at session end), and must show it.
        lines += ["| env | result |", "|---|---|"]
        testenvs = data.get("testenvs", {})
        for name in [n for n in ("lint", "type", "docs") if n in testenvs] + sorted(
                n for n in testenvs if n.startswith("celery")):
            env = testenvs[name]
            ok = env.get("result", {}).get("success")
            code = env.get("result", {}).get("exit_code")
            lines.append(f"| {name} | {'pass' if ok else f'**fail** (exit {code})'} |")
        lines.append("")
    lines += ["Installed in each env:", "",
              "| env | " + " | ".join(VERSIONED) + " |",
              "|---|" + "---|" * len(VERSIONED)]
    for name, env in envs.items():
        lines.append(f"| {name} | " + " | ".join(env["versions"].get(p, "?") for p in VERSIONED) + " |")
    lines += ["", "Checks per cell: " + ", ".join(f"`{v}`" for v in CHECKS.values())
              + " (see tests/deployments/test_matrix.py).", "",
              "| Celery | pool | broker | result | detail | time (s) |", "|---|---|---|---|---|---|"]
    for name, env in envs.items():
        celery = env["versions"].get("celery", name)
        order = sorted(env["cells"], key=lambda cell: (POOL_ORDER.index(cell[0])
                                                       if cell[0] in POOL_ORDER else 99, cell[1] != "redis"))
        for pool, broker in order:
            verdict, detail, seconds = summarise(env["cells"][(pool, broker)])
            lines.append(f"| {celery} | {pool} | {BROKER_NAMES.get(broker, broker)} | {verdict} | "
                         f"{detail} | {seconds:.0f} |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    results_dir, doc = Path(argv[0]), Path(argv[1])
    if not list(results_dir.glob("celery*.xml")):
        print(f"{results_dir}: no celery*.xml junit files (run make matrix first)", file=sys.stderr)
        return 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        commit += " + uncommitted changes"
    table = render(results_dir, commit, datetime.now(timezone.utc).strftime("%Y-%m-%d"))
    text = doc.read_text() if doc.exists() else f"# Compatibility\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        print(f"{doc}: the markers {BEGIN!r} and {END!r} are missing", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(head + table + tail)
    print(f"{doc}: table written from {results_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
