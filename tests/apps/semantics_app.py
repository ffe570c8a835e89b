"""tests/apps/leased_app.py's app, with log lines that name their logger.

Used by tests/test_recovery_semantics.py, which reads a worker's log to check
which logger said what (and at which level).
"""
from __future__ import annotations

import os
from typing import Mapping

from tests.apps.leased_app import create_app as _create_app

LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: %(message)s"


def create_app(env: Mapping[str, str]):
    app = _create_app(env)
    app.conf.worker_log_format = LOG_FORMAT
    app.conf.worker_task_log_format = LOG_FORMAT
    return app


app = create_app(os.environ)
