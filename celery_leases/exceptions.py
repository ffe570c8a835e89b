"""The one exception hierarchy of celery-leases: everything is a LeaseError.

Free of Celery imports so the store can use it on its own.
"""
from __future__ import annotations

__all__ = [
    "LeaseError", "LeaseLost", "LeaseExpired", "LeaseUnavailable",
    "CorruptRecord", "ConfigurationError", "StaleFence", "DeliveryParked",
]


class LeaseError(Exception):
    """Base of every error raised by celery-leases.

    An error with fields keeps them, not its text, as its ``args``: a result
    backend stores ``args`` and rebuilds the error as ``cls(*args)`` for the
    waiter, so the fields and the type come back, and the text does not double.
    """


class LeaseLost(LeaseError):
    """Raised when the caller no longer owns the lease it acts under."""

    def __init__(self, task_id: str, token: int | None = None, reason: str = "lost"):
        self.task_id, self.token, self.reason = task_id, token, reason
        super().__init__(task_id, token, reason)

    def __str__(self) -> str:
        return f"lease of task {self.task_id} (token {self.token}) is {self.reason}"

    def __reduce__(self):
        return (self.__class__, (self.task_id, self.token, self.reason))


class LeaseExpired(LeaseError):
    """Stored as the failure of a task given up after too many recoveries."""

    def __init__(self, task_id: str = "?", recoveries: int = 0):
        self.task_id, self.recoveries = task_id, recoveries
        super().__init__(task_id, recoveries)

    def __str__(self) -> str:
        return (f"task {self.task_id} was abandoned by its worker {self.recoveries} time(s) "
                f"and reached leases_max_recoveries; it is dead")

    def __reduce__(self):
        return (self.__class__, (self.task_id, self.recoveries))


class LeaseUnavailable(LeaseError):
    """Raised when the lease store cannot be reached or answers with an error."""


class CorruptRecord(LeaseError):
    """Raised when a key holds something that is not a valid lease record.

    ``key`` and ``field`` name what is corrupt when the script said so
    (``field`` is ``type`` for a key of the wrong type).
    """

    def __init__(self, message: str = "", key: str = "", field: str = ""):
        self.message, self.key, self.field = message, key, field
        super().__init__(message, key, field)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (self.__class__, (self.message, self.key, self.field))


class DeliveryParked(LeaseError):
    """Stored as the failure of a delivery that was parked instead of run (see docs/recovery.md).

    Raised for permanent errors (a corrupt record, a malformed message): the
    message is kept for an operator (``celery leases parked`` / ``replay``).
    """

    def __init__(self, task_id: str = "?", reason: str = "", key: str = "", field: str = ""):
        self.task_id, self.reason, self.key, self.field = task_id, reason, key, field
        super().__init__(task_id, reason, key, field)

    def __str__(self) -> str:
        where = f" (key {self.key or '?'}, field {self.field or '?'})"
        return (f"delivery of task {self.task_id} parked{where}: {self.reason}; see `celery leases "
                f"parked`, replay with `celery leases replay {self.task_id}`")

    def __reduce__(self):
        return (self.__class__, (self.task_id, self.reason, self.key, self.field))


class ConfigurationError(LeaseError, ValueError):
    """Raised when a ``leases_*`` setting or a ``lease_*`` task option is invalid."""


class StaleFence(LeaseError):
    """Raised when a fenced write carries a token older than one already accepted."""

    def __init__(self, resource: str, token: int, current: int | None):
        self.resource, self.token, self.current = resource, token, current
        super().__init__(resource, token, current)

    def __str__(self) -> str:
        return (f"fenced write to {self.resource} with token {self.token} refused: "
                f"token {self.current} was already accepted")

    def __reduce__(self):
        return (self.__class__, (self.resource, self.token, self.current))

