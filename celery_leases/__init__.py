"""celery-leases: renewable task ownership with fencing tokens for Celery.

    import celery_leases
    celery_leases.install(app)

    @app.task(base=celery_leases.LeasedTask, bind=True)
    def charge(self, order_id): ...
"""
from __future__ import annotations

from .codes import Code
from .exceptions import (ConfigurationError, CorruptRecord, DeliveryParked, LeaseError,
                         LeaseExpired, LeaseLost, LeaseUnavailable, StaleFence)
from .fencing import fenced_get, fenced_set, fenced_update, idempotency_key
from .install import install, store
from .signals import (callbacks_failed, delivery_parked, delivery_refused, lease_acquired, lease_dead,
                      lease_lost, lease_recovered, leases_renewed, stale_outcome_rejected)
from .store import Acquisition, Claim, LeaseRecord, LeaseStore, Parked, RecoveryReport
from .task import LeasedTask, StaleOutcome

__version__ = "0.1.0"

__all__ = [
    "install", "store", "LeasedTask", "Code", "LeaseStore", "LeaseRecord", "Acquisition",
    "Claim", "RecoveryReport", "Parked", "LeaseError", "LeaseLost", "LeaseExpired", "LeaseUnavailable",
    "CorruptRecord", "DeliveryParked", "ConfigurationError", "StaleFence", "StaleOutcome",
    "lease_acquired", "lease_lost", "lease_recovered", "lease_dead", "stale_outcome_rejected",
    "leases_renewed", "delivery_refused", "delivery_parked", "callbacks_failed",
    "fenced_set", "fenced_get", "fenced_update", "idempotency_key",
]
