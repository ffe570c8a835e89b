"""Modules that moved into the layer packages still import from their old paths.

Code outside the repository imports ``celery_leases.metrics``, ``celery_leases.tracing``,
``celery_leases.checks``, ``celery_leases.task.LeasedTask`` ... (docs name them). Each old
path gives the very module at its new path (``celery_leases.MOVED``), in a fresh interpreter.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import celery_leases

PROBE = """
import importlib, json, sys
import celery_leases
out = {}
for old, new in celery_leases.MOVED.items():
    module = importlib.import_module(old)
    out[old] = [module.__name__, module is sys.modules[new]]
import celery_leases.tracing
out["attribute"] = celery_leases.tracing.enable.__module__
from celery_leases.task import LeasedTask, StaleOutcome
from celery_leases.metrics import enable_prometheus
from celery_leases.checks import FINDINGS, run_checks
from celery_leases.lease import Lease, DetachedLease
from celery_leases.parking import park_delivery
out["public"] = [LeasedTask is celery_leases.LeasedTask, StaleOutcome is celery_leases.StaleOutcome]
print(json.dumps(out))
"""


def test_every_old_module_path_is_the_module_at_its_new_path():
    # Given a fresh interpreter; When it imports every old path;
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    found = json.loads(out.strip().splitlines()[-1])
    # Then each is the module at its new path, the same object, and the public names are there.
    for old, new in celery_leases.MOVED.items():
        assert found[old] == [new, True], (old, found[old])
    assert found["attribute"] == "celery_leases.ops.tracing"
    assert found["public"] == [True, True]


def test_no_old_path_is_also_a_file():
    # An old path that is also a real module would shadow the move (the old finder never runs).
    root = celery_leases.__file__.rpartition("/")[0]
    for old in celery_leases.MOVED:
        relative = old.split(".", 1)[1].replace(".", "/")
        assert not Path(root, relative + ".py").exists(), old
