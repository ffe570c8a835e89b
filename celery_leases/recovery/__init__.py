"""Recovery, the Celery side. The pass itself (which leases are claimed, which are dead) is
the store's: ``celery_leases.protocol.recovery``. This package turns its answers into
Celery's actions and says when a pass runs:

- ``recoverer.py``: ``Recoverer``, a claim re-published, ``LeaseExpired`` stored for a dead task;
- ``parking.py``: a delivery that must never run, kept and dead-lettered;
- ``messages.py``: the envelope kept with a lease, the raw re-publish;
- ``beat.py``: the ``celery_leases.recover`` task and its beat entry;
- ``fallback.py``: passes the workers run themselves, without beat.
"""
from .recoverer import Recoverer

__all__ = ["Recoverer"]
