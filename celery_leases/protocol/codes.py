"""Return codes of the Lua scripts: the only copy (each script's header lists its subset).

``tests/protocol/test_scripts_contract.py`` checks every header against this enum.
"""
from __future__ import annotations

import enum


class Code(enum.IntEnum):
    #: acquire: a fresh record, or the rightful next owner (recovered message, next retry).
    ACQUIRED = 1
    #: acquire: the previous owner's lease had expired; this delivery took it over.
    TAKEN_OVER = 2
    #: acquire: another owner holds a live lease; do not run the body.
    BUSY = 3
    #: acquire/finish/renew: the record is terminal (succeeded, failed, revoked, dead).
    FINISHED = 4
    #: acquire: the message is an older copy (generation or attempt) than the record.
    STALE = 5
    #: acquire/recover: the task used up max_recoveries and is now dead.
    DEAD = 6
    #: finish/renew/progress: the caller's token or owner is no longer current.
    LOST = 7
    #: finish/renew/progress: there is no record for this task id.
    MISSING = 8
    #: renew: the task did not report progress within its progress timeout.
    STALLED = 9
    #: finish/renew/progress/release: the transition was applied.
    OK = 10
    #: recover: the lease was claimed and must now be re-published.
    RECOVERED = 11
    #: fenced_write: refused; a newer token was already accepted for the resource.
    STALE_FENCE = 12
    #: complete_step: the step was already recorded (by this or an earlier owner).
    STEP_DONE = 13
    #: any script: a key or field it reads is not what the protocol wrote (a non-number,
    #: an unknown state, a key of the wrong type); nothing was written. The reply names
    #: the key and the field: {CORRUPT, key, field, detail}.
    CORRUPT = 14
    #: acquire: the caller left the message out (its publisher recorded it) and the store
    #: does not hold that publish's message; nothing was written. LeaseStore.acquire then
    #: sends the acquire again with the message: no caller sees this code.
    NO_MESSAGE = 15
    #: finish: the call reached the server after its not-after moment (its caller had
    #: given up waiting): nothing was changed. Numbered apart from the codes above.
    LATE = 20

    @property
    def reason(self) -> str:
        """Why a lease or a transition was refused, in words (LeaseLost.reason, lease_lost's reason).

        The one mapping from code to reason; a code without a phrase of its own
        reads as its lower-case name, so a new code never raises here.
        """
        return _REASONS.get(self, self.name.lower())

    @property
    def words(self) -> str:
        """The same answer as a phrase, for log lines, ``lease_lost``'s reason and the
        ``reason`` label of ``celery_leases_lost_total``; a code without a phrase reads as its
        name (``CORRUPT``)."""
        return _WORDS.get(self, self.name)


#: Code -> reason (see ``Code.reason``).
_REASONS = {
    Code.LOST: "lost",
    Code.MISSING: "missing",
    Code.FINISHED: "finished",
    Code.STALLED: "no progress within the progress timeout",
    Code.LATE: "late: the finish reached the store after its not-after moment",
}


#: Code -> phrase (see ``Code.words``): why a delivery is not run, or why a held lease was lost.
_WORDS = {
    Code.BUSY: "a live lease is held",
    Code.FINISHED: "the task already finished",
    Code.STALE: "stale copy of the message",
    Code.DEAD: "the task used up its recoveries",
    Code.LOST: "taken over by another owner",
    Code.STALLED: "no progress within the progress timeout",
    Code.MISSING: "record missing",
}


#: Lease states, as stored in the record's ``state`` field. ``queued``: recorded at
#: publish (publish tracking, enqueue.lua), not yet acquired by any worker.
QUEUED, ACTIVE, RECOVERING = "queued", "active", "recovering"
SUCCEEDED, FAILED, DEAD, REVOKED = "succeeded", "failed", "dead", "revoked"
TERMINAL_STATES = frozenset({SUCCEEDED, FAILED, DEAD, REVOKED})
STATES = (QUEUED, ACTIVE, RECOVERING, SUCCEEDED, FAILED, DEAD, REVOKED)

#: Outcomes accepted by ``finish``; ``retry`` hands the lease to the next attempt.
OUTCOMES = ("succeeded", "failed", "revoked", "retry")
