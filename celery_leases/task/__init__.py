"""The task side of the wiring: what runs in the process that runs a leased task.

- ``leased.py``: ``LeasedTask``, the task base class (refuses a delivery decided at
  receipt, fences the outcome, finishes the lease);
- ``request.py``: ``LeasedRequest``, the main process's own writes fenced too;
- ``lease.py``: ``self.lease`` in a task body;
- ``results.py``: the outcome and the result written together, or kept until confirmed;
- ``callbacks.py``: link callbacks and chain steps of an accepted success;
- ``followups.py``: those and a chord member's part, kept with the finish for recovery.

``celery_leases.task.LeasedTask`` is a public path (it was the module ``task.py``).
"""
from .leased import LeasedTask, StaleOutcome

__all__ = ["LeasedTask", "StaleOutcome"]
