"""Signals sent by celery-leases (celery.utils.dispatch.Signal).

Receivers cannot veto anything: like Celery's own signals, their errors are
logged and swallowed.
"""
from celery.utils.dispatch import Signal

#: Sent in the worker's main process when a delivery became the lease owner.
lease_acquired = Signal(name="lease_acquired", providing_args={"task_id", "token", "owner", "taken_over"})
#: Sent in the worker's main process when a delivery is not run because it could not
#: take the lease: ``reason`` says why (a live owner, finished, a stale copy, dead),
#: ``code`` is the store's Code, ``token`` the current owner's.
delivery_refused = Signal(name="delivery_refused", providing_args={"task_id", "reason", "code", "token"})
#: Sent in the worker's main process when a heartbeat learns a held lease was lost.
lease_lost = Signal(name="lease_lost", providing_args={"task_id", "token", "reason"})
#: Sent by the recoverer for each task it re-published.
#: ``recovered_after``: seconds from the last owner's acquisition to the re-publication
#: (None when unknown, or when no receiver was connected as the pass ran).
lease_recovered = Signal(name="lease_recovered",
                         providing_args={"task_id", "generation", "recoveries", "recovered_after"})
#: Sent by the recoverer (or a worker) when a task used up its recoveries and is dead.
lease_dead = Signal(name="lease_dead", providing_args={"task_id", "recoveries"})
#: Sent wherever a stale owner's outcome was refused.
stale_outcome_rejected = Signal(name="stale_outcome_rejected",
                                providing_args={"task_id", "token", "outcome", "reason"})
#: Sent in the worker's main process after each successful heartbeat tick:
#: how many held leases were renewed and how many were not (lost or finished).
leases_renewed = Signal(name="leases_renewed", providing_args={"owner", "renewed", "not_renewed"})
#: Sent wherever a delivery was parked instead of run (celery_leases.parking): a
#: corrupt record or a malformed message. ``sender`` is the task (or the app when
#: the task is unknown); ``key`` and ``field`` name what was corrupt ('' when not a key).
delivery_parked = Signal(name="delivery_parked", providing_args={"task_id", "reason", "key", "field"})

#: Sent in the process that ran a task whose success was accepted but whose link
#: callback or next chain step could not be published after every retry:
#: ``callback`` names it, ``error`` is the last error (the success stays stored).
callbacks_failed = Signal(name="callbacks_failed", providing_args={"task_id", "callback", "error"})
#: Sent by the recoverer for each queued task it re-published because no worker acquired
#: it within leases_delivery_timeout (publish tracking): the broker lost it, or it is
#: still waiting in a backlog longer than the timeout.
undelivered_republished = Signal(name="undelivered_republished", providing_args={"task_id", "generation"})
#: Sent by the recoverer for each result it wrote to the backend because the process that
#: finished the task (its outcome accepted) died before Celery stored the result (task/results.py).
result_written_by_recovery = Signal(name="result_written_by_recovery", providing_args={"task_id", "state"})
#: Sent in the worker's main process after every heartbeat tick: ``held`` leases the
#: tick tried to renew (0: none held, no call made), ``seconds`` the renew call took
#: (None when no call was made), ``failed`` True when the call failed (the store
#: unreachable; the leases are tried again next tick).
heartbeat_ticked = Signal(name="heartbeat_ticked", providing_args={"owner", "held", "seconds", "failed"})
#: Sent wherever a recovery pass was due (a worker's fallback thread, beat's
#: ``celery_leases.recover`` task): ``result`` is "ran", "skipped" (another recoverer
#: took this interval) or "failed" (the store did not answer); ``recoverer`` names who.
recovery_pass = Signal(name="recovery_pass", providing_args={"result", "recoverer"})
#: Sent by an outbox relay (celery_leases/outbox/relay.py) every few seconds: ``depth`` rows
#: waiting in the outbox, ``oldest_age`` the oldest one's age in seconds (None: empty), on
#: the database's clock, and ``parked`` rows in the parked table.
outbox_status = Signal(name="outbox_status", providing_args={"depth", "oldest_age", "parked"})
