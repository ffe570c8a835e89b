"""What the store reads and hands back: lease records, acquisitions, claims, parked deliveries.

Plain values parsed from script replies and hashes; a field that does not parse
raises CorruptRecord naming the key and the field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..exceptions import CorruptRecord
from .codes import QUEUED, STATES, Code

__all__ = ["LeaseRecord", "Acquisition", "Claim", "RecoveryReport", "Parked", "acquisition_of",
           "raise_if_corrupt", "INT_FIELDS"]

#: Numeric fields of a lease record (HMGET'd by ``records``, parsed as int by ``LeaseRecord.parse``).
INT_FIELDS = ("token", "ttl", "generation", "recoveries", "attempt",
              "progress_timeout", "progress_deadline", "acquired_at", "finished_at",
              "revoke_requested", "unstarted_recoveries", "waited_deaths")


@dataclass(frozen=True)
class LeaseRecord:
    """A snapshot of one task's lease. Times are server-clock milliseconds."""

    task_id: str
    state: str
    token: int
    owner: str
    #: Server-clock ms when the lease is due for recovery (0: not in the deadline index).
    deadline: int
    recoveries: int
    generation: int = 0
    attempt: int = 0
    ttl: int = 0
    name: str = ""
    acquired_at: int = 0
    finished_at: int = 0
    progress_timeout: int = 0
    progress_deadline: int = 0
    #: Server-clock ms of a revoke that came while an owner ran the task (0: none).
    revoke_requested: int = 0
    #: (token, owner, acquired_at) of the last owners, oldest first.
    history: tuple = ()
    has_message: bool = False
    #: False while the owner has not reported that the body started (mark_started):
    #: its death then counts no recovery, only an unstarted one. Always False for a
    #: queued record (no worker has it).
    started: bool = True
    #: Recoveries whose blame was uncertain (never marked started, or a death shared with
    #: other tasks of a threads, gevent or eventlet worker): bounded separately.
    unstarted_recoveries: int = 0
    #: True once a death's blame was uncertain: every later run of the task is isolated.
    isolate: bool = False
    #: Deaths of its worker while the isolated task had not started (it waited for its turn):
    #: never its own, so not charged; bounded separately.
    waited_deaths: int = 0

    @classmethod
    def parse(cls, task_id: str, key: str, raw: Mapping[bytes, bytes], deadline: int = 0,
              has_message: bool = False) -> "LeaseRecord":
        data = {k.decode(): v for k, v in raw.items()}
        values: dict[str, Any] = {}
        for name in INT_FIELDS:
            try:
                values[name] = int(data.get(name, b"0") or 0)
            except ValueError:
                raise CorruptRecord(f"lease record {key} of task {task_id}: field {name} is not a "
                                    f"number: {data[name]!r}", key, name) from None
        try:
            state = data["state"].decode()
        except (KeyError, UnicodeDecodeError) as exc:
            raise CorruptRecord(f"lease record {key} of task {task_id}: field state is "
                                f"missing or unreadable: {exc!r}", key, "state") from None
        if state not in STATES:  # as the scripts' validation: one of the seven, or corrupt
            raise CorruptRecord(f"lease record {key} of task {task_id}: field state is {state!r}, "
                                f"not a known state", key, "state")
        history = []
        try:
            for name, entry in data.items():
                if name.startswith("h:"):
                    token, rest = entry.decode().split("@", 1)
                    owner, at = rest.rsplit("@", 1)
                    history.append((int(token), owner, int(at)))
        except ValueError:
            raise CorruptRecord(f"lease record {key} of task {task_id}: a history field is corrupt") from None
        history.sort()
        return cls(task_id=task_id, state=state, owner=(data.get("owner") or b"").decode(),
                   deadline=deadline,
                   name=(data.get("name") or b"").decode(), history=tuple(history),
                   has_message=has_message, started=state != QUEUED and data.get("started") != b"0",
                   isolate=data.get("isolate") == b"1",
                   **values)


@dataclass(frozen=True)
class Acquisition:
    """What ``acquire`` decided for one delivery."""

    code: Code
    token: int
    generation: int
    recoveries: int
    state: str
    #: True when the task's blame for an earlier death was uncertain: the owner runs it
    #: alone, marked started before its body (``mark_started(alone=True)``).
    isolate: bool = False

    @property
    def owned(self) -> bool:
        """True when the caller now owns the lease and may run the task."""
        return self.code in (Code.ACQUIRED, Code.TAKEN_OVER)


@dataclass
class Claim:
    """A lease claimed by a recovery pass: its message must be re-published."""

    task_id: str
    code: Code
    generation: int
    recoveries: int
    name: str
    body: bytes
    envelope: dict
    #: Set when the stored message cannot be used (e.g. a corrupt envelope).
    error: Exception | None = None


@dataclass
class RecoveryReport:
    """Counts of one recovery pass."""

    recovered: int = 0
    dead: int = 0
    publish_failed: int = 0
    #: Claims whose record (or message hash) was corrupt: taken out of the index and parked.
    corrupt: int = 0
    errors: list = field(default_factory=list)
    #: Queued tasks re-published because no worker acquired them in time (queued.py).
    undelivered: int = 0
    #: Queued tasks past their expires: revoked instead of re-published.
    undelivered_expired: int = 0
    #: True when the pass ran the undelivered step (publish tracking on): as_dict shows its counts.
    tracked: bool = False
    #: Kept results recovery wrote because their process died before Celery did (unwritten.py);
    #: None when the pass ran no such step (a store without the Celery wiring).
    results_written: int | None = None

    def __iadd__(self, other: "RecoveryReport") -> "RecoveryReport":
        self.recovered += other.recovered
        self.dead += other.dead
        self.publish_failed += other.publish_failed
        self.corrupt += other.corrupt
        self.undelivered += other.undelivered
        self.undelivered_expired += other.undelivered_expired
        self.tracked = self.tracked or other.tracked
        if other.results_written is not None:
            self.results_written = (self.results_written or 0) + other.results_written
        self.errors.extend(other.errors)
        return self

    def as_dict(self) -> dict:
        out = {"recovered": self.recovered, "dead": self.dead,
               "publish_failed": self.publish_failed, "corrupt": self.corrupt}
        if self.tracked:
            out.update(undelivered=self.undelivered, undelivered_expired=self.undelivered_expired)
        if self.results_written is not None:
            out["results_written"] = self.results_written
        return out


@dataclass(frozen=True)
class Parked:
    """A delivery parked instead of run (``LeaseStore.park``), kept for an operator."""

    task_id: str
    reason: str
    #: Server-clock ms of the (last) parking.
    parked_at: int
    name: str = ""
    #: The key and field that were corrupt ('' when the cause was not a key).
    key: str = ""
    field: str = ""
    #: Times this task id was parked (a replayed delivery that is parked again counts on).
    count: int = 1
    #: The message: empty in ``parked()`` listings (see body_size), filled by ``unpark``.
    body: bytes = b""
    envelope: dict = dataclasses.field(default_factory=dict)
    body_size: int = 0

    @classmethod
    def parse(cls, task_id: str, meta: bytes, body: bytes = b"") -> "Parked":
        try:
            data = json.loads(meta.decode("utf-8", "surrogateescape"))
            envelope = json.loads(data.get("envelope") or "{}")
        except ValueError as exc:
            raise CorruptRecord(f"parked entry of task {task_id} is not JSON: {exc}") from None
        return cls(task_id=task_id, reason=str(data.get("reason", "")),
                   parked_at=int(data.get("parked_at") or 0), name=str(data.get("name", "")),
                   key=str(data.get("key", "")), field=str(data.get("field", "")),
                   count=int(data.get("count") or 1), body=body,
                   envelope=envelope if isinstance(envelope, dict) else {},
                   body_size=int(data.get("body_size") or len(body)))


#: Parked entries are kept this long (seconds) and at most this many: an operator


def acquisition_of(raw: Sequence[Any]) -> Acquisition:
    """acquire.lua's reply as an Acquisition; a CORRUPT answer raises CorruptRecord naming key and field."""
    raise_if_corrupt(raw, "acquire")
    code, token, gen, recoveries, state = raw[:5]
    return Acquisition(Code(code), int(token), int(gen), int(recoveries), state.decode(),
                       isolate=len(raw) > 5 and int(raw[5]) == 1)


def raise_if_corrupt(reply: Any, what: str) -> None:
    """A script's CORRUPT answer {CORRUPT, key, field, detail} as CorruptRecord naming key and field."""
    if isinstance(reply, list) and reply and reply[0] == Code.CORRUPT:
        key, fld, detail = (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                            for v in reply[1:4])
        raise CorruptRecord(f"{what}: {key} field {fld} {detail}; nothing was written", key, fld)
