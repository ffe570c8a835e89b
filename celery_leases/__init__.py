"""celery-leases: renewable task ownership with fencing tokens for Celery."""
from __future__ import annotations

from .codes import Code
from .exceptions import (ConfigurationError, CorruptRecord, LeaseError, LeaseExpired,
                         LeaseLost, LeaseUnavailable, StaleFence)
from .store import Acquisition, Claim, LeaseRecord, LeaseStore, RecoveryReport

__version__ = "0.1.0"

__all__ = [
    "Code", "LeaseStore", "LeaseRecord", "Acquisition", "Claim", "RecoveryReport",
    "LeaseError", "LeaseLost", "LeaseExpired", "LeaseUnavailable", "CorruptRecord",
    "ConfigurationError", "StaleFence",
]
