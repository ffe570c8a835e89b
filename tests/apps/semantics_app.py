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
    retries = env.get("LEASES_TEST_PUBLISH_RETRIES")
    if retries:
        # Celery gives up on a publish after these retries (the default, 3, lasts
        # about 20 s against a refused broker port): tests keep their outages short.
        app.conf.task_publish_retry_policy = {"max_retries": int(retries), "interval_start": 0,
                                              "interval_step": 0.2, "interval_max": 0.2}
    return app


app = create_app(os.environ)
