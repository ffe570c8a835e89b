"""The workload and the fault schedule: both are pure functions of the seed.

The same seed gives the same tasks (ids, durations, submission times) and the
same faults (times, kinds, targets, parameters), whatever the mode. Targets are
worker *slots*; if the slot's worker is down or busy with another fault when
its turn comes, the fault goes to the next slot that is up (or is skipped and
logged), so runs of one seed match as closely as real processes allow.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

__all__ = ["KINDS", "MALFORMED", "Fault", "ScheduleParams", "Task", "make_schedule", "make_workload"]

#: Every kind of fault, with its weight in the random part of the schedule.
KINDS = {
    "kill_worker": 3,     # SIGKILL a worker's main process (its pool children die with it)
    "kill_child": 3,      # SIGKILL one pool child of a prefork worker
    "stop_worker": 3,     # SIGSTOP a whole worker past the lease ttl, then SIGCONT
    "redis_restart": 1,   # stop Redis (SIGTERM, or SIGKILL as a crash), start it again; AOF on
    "redis_pause": 2,     # CLIENT PAUSE ALL for longer than a heartbeat interval
    "restart_worker": 1,  # warm shutdown (SIGTERM), then start a new worker in the slot
    "lease_store_pause": 2,  # SIGSTOP the lease store's own redis-server past the ttl, then SIGCONT
    "malformed": 2,       # raw publishes a client could send: a bad id, non-integer headers
    "broker_loss": 1,     # SIGKILL the broker's own redis-server (no persistence), start it empty
    "kill_sender": 2,     # a process sends tasks with a transaction, SIGKILLed right after COMMIT (senders.py)
}

#: The malformed messages the ``malformed`` fault publishes (``Fault.variant`` names one):
#: header overrides of an otherwise valid ``chaos.work`` message with ``seq`` -1. None may
#: run a body; leases mode must refuse or park each (chaos.checker, "malformed bodies run").
MALFORMED = {
    "id-null": {"id": None},
    "id-float": {"id": 1.5},
    "id-lone-surrogate": {"id": "bad-\udc80-id"},
    "generation-not-int": {"lease_generation": "x"},
    "generation-list": {"lease_generation": [1]},
    "retries-not-int": {"retries": "two"},
}


@dataclass(frozen=True)
class Task:
    seq: int
    id: str
    seconds: float
    #: Seconds after the start of the fault window when the task is submitted.
    submit_at: float


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    #: Worker slot (worker faults), else -1.
    slot: int = -1
    #: Seconds the fault lasts (stop, pause), a killed worker stays down, or a Redis stays down.
    seconds: float = 0.0
    #: redis_restart: "graceful" (SIGTERM, AOF flushed) or "crash" (SIGKILL);
    #: malformed: a key of MALFORMED.
    variant: str = ""
    #: redis_restart / redis_pause: "main" (broker, results, sink) or "leases" (the lease store).
    server: str = ""
    #: kill_child: which child (index modulo the number of children).
    pick: int = 0

    def describe(self) -> str:
        parts = [f"t={self.at:7.2f}s", f"{self.kind:<14}"]
        if self.slot >= 0:
            parts.append(f"slot {self.slot}")
        if self.variant:
            parts.append(self.variant)
        if self.server:
            parts.append(f"on {self.server}")
        if self.seconds:
            parts.append(f"{self.seconds:.2f}s")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def task_seconds(rng: random.Random) -> float:
    """Mostly short tasks, some medium, a few longer than plain mode's visibility timeout."""
    r = rng.random()
    if r < 0.70:
        return round(rng.uniform(0.1, 1.0), 3)
    if r < 0.95:
        return round(rng.uniform(1.0, 4.0), 3)
    return round(rng.uniform(6.0, 10.0), 3)


def make_workload(seed: int, tasks: int, duration: float) -> list[Task]:
    """``tasks`` tasks submitted evenly over the fault window, so work is in flight when it ends."""
    rng = random.Random(f"chaos-workload:{seed}")
    return [Task(seq=i, id=f"s{seed}-{i:05d}", seconds=task_seconds(rng),
                 submit_at=round(i * duration / max(1, tasks), 3)) for i in range(tasks)]


@dataclass
class ScheduleParams:
    workers: int
    ttl: float
    #: Seconds before the first fault (workers warm up, the first tasks start).
    warmup: float = 3.0
    #: Gap between two faults: uniform in [min_gap, max_gap].
    min_gap: float = 1.5
    max_gap: float = 6.0
    kinds: dict = field(default_factory=lambda: dict(KINDS))


def make_schedule(seed: int, duration: float, params: ScheduleParams) -> list[Fault]:
    """Faults from ``warmup`` until 2 s before ``duration``; every kind occurs at least once
    (the first len(kinds) faults are one of each, in a seeded order)."""
    rng = random.Random(f"chaos-faults:{seed}")
    heartbeat = params.ttl / 3
    kinds = list(params.kinds)
    first = kinds[:]
    rng.shuffle(first)
    names, weights = zip(*params.kinds.items())
    faults: list[Fault] = []
    t = params.warmup
    while True:
        t += rng.uniform(params.min_gap, params.max_gap) if faults else 0.0
        if t > duration - 2.0:
            break
        kind = first.pop(0) if first else rng.choices(names, weights)[0]
        slot = rng.randrange(params.workers)
        if kind == "kill_worker":
            fault = Fault(t, kind, slot, seconds=round(rng.uniform(1.0, 3.0), 2))
        elif kind == "kill_child":
            fault = Fault(t, kind, slot, pick=rng.randrange(16))
        elif kind == "stop_worker":
            # Past the ttl: the lease expires and the task is recovered while the old process sleeps.
            fault = Fault(t, kind, slot, seconds=round(params.ttl + rng.uniform(1.0, 3.0), 2))
        elif kind == "redis_restart":
            fault = Fault(t, kind, seconds=round(rng.uniform(0.2, 1.5), 2),
                          variant=rng.choice(("graceful", "crash")),
                          server=rng.choice(("main", "leases")))
        elif kind == "redis_pause":
            fault = Fault(t, kind, seconds=round(heartbeat * rng.uniform(1.5, 2.5), 2),
                          server=rng.choice(("main", "leases")))
        elif kind == "lease_store_pause":
            # Past the ttl: every lease expires while the store is frozen, with the workers'
            # finishes and renewals buffered in its sockets (issue #14, item 2).
            fault = Fault(t, kind, seconds=round(params.ttl + rng.uniform(1.0, 3.0), 2))
        elif kind == "malformed":
            fault = Fault(t, kind, variant=rng.choice(sorted(MALFORMED)), pick=rng.randrange(1, 4))
        elif kind == "restart_worker":
            fault = Fault(t, kind, slot)
        elif kind == "broker_loss":
            # Every message waiting in the broker (and plain mode's unacked ones) is gone.
            fault = Fault(t, kind, seconds=round(rng.uniform(0.2, 1.0), 2))
        elif kind == "kill_sender":
            # pick: varies the sender's task durations (chaos/senders.py).
            fault = Fault(t, kind, pick=rng.randrange(4))
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        faults.append(fault)
    return faults
