"""tests/support/matrix_report.py turns a matrix run's junit files into the table of docs/compatibility.md."""
from __future__ import annotations

import json

import pytest

from tests.support import matrix_report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<properties>
  <property name="version.celery" value="5.3.6"/><property name="version.kombu" value="5.3.7"/>
  <property name="version.billiard" value="4.2.1"/><property name="version.redis" value="5.3.1"/>
</properties>
<testcase name="test_leased_task_runs_once_and_finishes_with_its_token[prefork-redis]" time="2.5"/>
<testcase name="test_killed_pool_child_is_released_and_recovered[threads-redis]" time="0.1">
  <skipped type="pytest.skip" message="not applicable: the threads pool runs tasks in the worker's process">x</skipped>
</testcase>
<testcase name="test_retry_hands_the_lease_to_the_next_attempt[threads-redis]" time="3.0"/>
<testcase name="test_retry_hands_the_lease_to_the_next_attempt[eventlet-amqp]" time="0.0">
  <skipped type="pytest.skip" message="not supported: celery 5.3.6 has no eventlet pool">x</skipped>
</testcase>
<testcase name="test_stale_owner_outcome_is_refused[prefork-amqp]" time="30.0">
  <failure message="AssertionError: timed out after 20s waiting for B | to start">trace</failure>
</testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def results(tmp_path):
    (tmp_path / "celery53.xml").write_text(JUNIT)
    (tmp_path / "tox.json").write_text(json.dumps({"testenvs": {
        "lint": {"result": {"success": False, "exit_code": 1}},
        "type": {"result": {"success": True, "exit_code": 0}},
        "celery53": {"result": {"success": False, "exit_code": 1}},
        ".pkg": {"result": {"success": True, "exit_code": 0}}}}))
    return tmp_path


def rows(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if len(cells) == 6 and cells[0] == "5.3.6":
            out[(cells[1], cells[2])] = cells[3:]
    return out


def test_each_cell_gets_its_verdict_and_reason(results):
    table = rows(matrix_report.render(results, "abc1234", "2026-01-01"))
    assert table[("prefork", "Redis")][:2] == ["pass", "1/1 checks"]
    verdict, detail, _ = table[("threads", "Redis")]
    assert verdict == "pass" and "child-kill n/a: the threads pool runs tasks" in detail
    assert table[("eventlet", "RabbitMQ")][:2] == ["not supported", "celery 5.3.6 has no eventlet pool"]
    verdict, detail, seconds = table[("prefork", "RabbitMQ")]
    assert verdict == "**fail**" and detail.startswith("stale: AssertionError: timed out")
    assert "\\|" in detail and seconds == "30"  # a pipe in a message cannot break the table


def test_versions_commit_and_tool_envs_are_reported(results):
    text = matrix_report.render(results, "abc1234", "2026-01-01")
    assert "2026-01-01 at commit `abc1234`" in text
    assert "| celery53 | 5.3.6 | 5.3.7 | 4.2.1 | 5.3.1 | ? | ? | ? |" in text
    assert "| lint | **fail** (exit 1) |" in text and "| type | pass |" in text
    assert "| celery53 | **fail** (exit 1) |" in text and ".pkg" not in text


def test_only_the_marked_part_of_the_page_is_rewritten(results, tmp_path):
    doc = tmp_path / "compatibility.md"
    doc.write_text(f"# Title\n\nintro\n\n{matrix_report.BEGIN}\nold table\n{matrix_report.END}\n\nfindings\n")
    assert matrix_report.main([str(results), str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nintro\n\n") and text.endswith("\n\nfindings\n")
    assert "old table" not in text and "| 5.3.6 | prefork | Redis | pass |" in text


def test_missing_results_or_markers_are_errors(tmp_path, capsys):
    doc = tmp_path / "compatibility.md"
    doc.write_text("no markers\n")
    assert matrix_report.main([str(tmp_path), str(doc)]) == 1
    assert "no celery*.xml junit files" in capsys.readouterr().err
    (tmp_path / "celery57.xml").write_text(JUNIT)
    assert matrix_report.main([str(tmp_path), str(doc)]) == 1
    assert "markers" in capsys.readouterr().err
