"""monitoring/: the Grafana dashboard and the Prometheus alert rules.

Every metric a panel or a rule names is one celery_leases/metrics.py
registers; the rules pass ``promtool check rules`` and their unit tests
``promtool test rules``; every alert has a case that fires and one that must
not; the dashboard's queries parse as PromQL and every panel has a data source,
a title and a query; docs/operations.md has a row for each alert and panel.
promtool comes from Debian's ``prometheus`` package
(``make promtool``, which ``make test`` runs first); under CI=true a missing
promtool fails the test instead of skipping it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from celery import Celery

pytest.importorskip("prometheus_client", reason="pip install -e '.[test]' installs prometheus-client")
from prometheus_client import CollectorRegistry  # noqa: E402

from celery_leases.ops.metrics import LeaseMetrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "celery-leases.json"
RULES = MONITORING / "prometheus" / "celery-leases.rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "celery-leases.rules.test.yml"

#: Metrics the dashboard and rules may name before metrics.py registers them,
#: each with why. Remove an entry once metrics.py has the metric (a test says so).
NOT_YET_REGISTERED: dict[str, str] = {}

METRIC = re.compile(r"\bcelery_leases_[a-z_]+")
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
#: Grafana's variables, replaced by values so a panel's query is plain PromQL.
GRAFANA_VARS = {"$__rate_interval": "5m", "$heartbeat_interval": "10", "$job": ".*"}


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def registered_metrics() -> set[str]:
    """Names of the metric families LeaseMetrics registers (without exposition suffixes)."""
    registry = CollectorRegistry()
    metrics = LeaseMetrics(Celery("monitoring-test", set_as_current=False), registry)
    try:
        return {base_name(family.name) for family in registry.collect()}
    finally:
        metrics.disable()


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    """Every panel, rows' nested panels included."""
    found = []
    for panel in dashboard()["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return [p for p in found if p.get("type") != "row"]


def panel_exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", []) if t.get("expr")]


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = ("promtool not found: `make promtool` installs it (Debian's prometheus package, "
                   "apt-get install --no-install-recommends prometheus)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120,
                          cwd=RULES.parent, check=False)


def test_every_metric_named_by_a_panel_or_a_rule_is_registered_by_metrics_py():
    registered = registered_metrics()
    named = {}
    for where, exprs in (("dashboard", panel_exprs()), ("rules", [r["expr"] for r in rules()])):
        for expr in exprs:
            for name in METRIC.findall(expr):
                named.setdefault(base_name(name), where)
    unknown = {name: where for name, where in named.items()
               if name not in registered and name not in NOT_YET_REGISTERED}
    assert not unknown, (f"{unknown}: not metrics of celery_leases/metrics.py (it registers "
                         f"{sorted(registered)}); fix the query or add the metric")


def test_every_label_a_query_groups_or_matches_by_is_one_the_metrics_have():
    # The metrics' own labels, plus those Prometheus adds (job, instance) and le of a histogram.
    registry = CollectorRegistry()
    metrics = LeaseMetrics(Celery("monitoring-test", set_as_current=False), registry)
    try:
        known = {"job", "instance", "le"}
        for collector in vars(metrics).values():
            known.update(getattr(collector, "_labelnames", ()))
    finally:
        metrics.disable()
    for expr in panel_exprs() + [r["expr"] for r in rules()]:
        used = {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
                for label in group.split(",") if label.strip()}
        used |= set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", expr))
        assert used <= known, f"{sorted(used - known)}: no metric of metrics.py has these labels ({expr})"


def test_the_allow_list_names_only_metrics_not_yet_registered():
    stale = sorted(set(NOT_YET_REGISTERED) & registered_metrics())
    assert not stale, (f"{stale}: celery_leases/metrics.py registers these now; remove them from "
                       "NOT_YET_REGISTERED in tests/ops/test_monitoring.py")


def test_promtool_check_rules_passes():
    result = run_promtool("check", "rules", RULES.name)
    assert result.returncode == 0, f"promtool check rules {RULES}:\n{result.stdout}{result.stderr}"


def test_promtool_unit_tests_of_the_rules_pass():
    result = run_promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, f"promtool test rules {RULE_TESTS}:\n{result.stdout}{result.stderr}"


def test_every_rule_is_an_alert_with_for_severity_summary_and_description():
    for rule in rules():
        name = rule.get("alert")
        assert name, f"{RULES}: a rule without alert: {rule}"
        assert rule.get("for"), f"{RULES}: alert {name} has no for:"
        assert rule.get("labels", {}).get("severity") in {"critical", "warning", "info"}, \
            f"{RULES}: alert {name}: severity label must be critical, warning or info"
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), \
            f"{RULES}: alert {name} needs summary and description annotations"


def test_every_alert_has_a_case_that_fires_and_one_that_must_not():
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    for name in (rule["alert"] for rule in rules()):
        assert name in fires, f"{RULE_TESTS}: no case where {name} fires"
        assert name in quiet, f"{RULE_TESTS}: no case where {name} must not fire"


def test_every_panel_has_a_datasource_a_title_and_a_query():
    board = dashboard()
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert panels(), f"{DASHBOARD}: no panels"
    ids = [p.get("id") for p in panels()]
    assert len(set(ids)) == len(ids), f"{DASHBOARD}: panel ids repeat: {ids}"
    for panel in panels():
        title = panel.get("title")
        assert title, f"{DASHBOARD}: a panel without a title (id {panel.get('id')})"
        assert panel.get("datasource", {}).get("uid") == "${datasource}", \
            f"{DASHBOARD}: panel {title!r} must use the ${{datasource}} variable"
        targets = [t for t in panel.get("targets", []) if t.get("expr")]
        assert targets, f"{DASHBOARD}: panel {title!r} has no query"


def test_the_dashboard_queries_parse_as_promql(tmp_path):
    # promtool has no query parser of its own: check the queries as recording rules.
    exprs = []
    for expr in panel_exprs():
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{DASHBOARD}: a variable GRAFANA_VARS does not know in {expr!r}"
        exprs.append(expr)
    records = [{"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, f"{DASHBOARD}: a query is not valid PromQL:\n{result.stdout}{result.stderr}"


def test_the_operations_page_explains_every_alert_and_panel():
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("## Dashboards and alerts", 1)[-1].split("\n## ", 1)[0]
    missing = [f"alert {rule['alert']}" for rule in rules() if f"`{rule['alert']}`" not in section]
    missing += [f"panel {p['title']!r}" for p in panels() if f"| {p['title']} |" not in section]
    assert not missing, f"docs/operations.md, Dashboards and alerts: add rows for {missing}"
    assert "](../monitoring/README.md)" in section and "](_static/dashboard.png)" in section
