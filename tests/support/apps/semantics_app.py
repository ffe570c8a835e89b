"""tests/support/apps/leased_app.py's app, with log lines that name their logger.

Used by tests/worker/test_recovery_semantics.py, which reads a worker's log to check
which logger said what (and at which level).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Mapping

from celery_leases import LeasedTask
from celery_leases.protocol.connection import connect
from tests.support.apps.leased_app import create_app as _create_app

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
    prefix = env.get("LEASES_TEST_PREFIX", "leases-test")
    sink = connect(env.get("LEASES_TEST_HISTORY_URL") or app.conf.leases_redis_url)

    @app.task(base=LeasedTask, bind=True, shared=False)
    def instant_pill(self):
        """Kills its whole worker at once: before its start mark can reach the store."""
        sink.rpush(f"{prefix}:history", f"start|{self.request.id}|{os.getpid()}|token={self.lease.token}")
        os.killpg(os.getpgid(0), signal.SIGKILL)
        time.sleep(5)

    return app


app = create_app(os.environ)
