"""Exceptions of the package as a result backend stores and rebuilds them (Celery's own serialization)."""
from __future__ import annotations

import json
from celery import Celery
from celery_leases import LeaseExpired

def test_a_lease_expired_rebuilt_by_the_result_backend_reads_as_it_was_stored():
    app = Celery("t", backend="cache+memory://")
    backend = app.backend
    stored = backend.prepare_exception(LeaseExpired("abc", 3))
    rebuilt = backend.exception_to_python(json.loads(json.dumps(stored)))
    assert isinstance(rebuilt, LeaseExpired)
    assert (rebuilt.task_id, rebuilt.recoveries) == ("abc", 3)
    assert str(rebuilt) == str(LeaseExpired("abc", 3))
    assert str(rebuilt).count("abandoned") == 1
