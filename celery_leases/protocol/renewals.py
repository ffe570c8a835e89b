"""The worker's batch transitions: many leases, one script call per shard (or per lease).

``renew_many`` (each heartbeat tick), ``release`` (a dead pool child's or a
warm shutdown's leases made due now), ``mark_started`` (bodies that began
running) and ``finish_many`` (outcomes nobody waits for, sent in the
background: one finish_many.lua call on a single server, else one finish.lua
call each). The calls go out pipelined: one round trip to a single server, one
per master on a cluster (calls.py).
"""
from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Collection, Mapping, Sequence

from ..exceptions import LeaseError
from .calls import ms, raise_unless_ok
from .codes import Code
from .core import StoreCore
from .records import Acquisition, raise_if_corrupt
from .scripts import scripts
from .transitions import AcquireRequest, FinishRequest, acquire_call, finish_call, finish_many_call

__all__ = ["renew_many", "release", "mark_started", "finish_many", "acquire_with_finishes", "finishes_call",
           "finishes_reply"]

logger = logging.getLogger("celery_leases.store")


def renew_many(core: StoreCore, owner: str, leases: Mapping[str, int], *, ttl: float | None = None,
               check_progress: bool = False) -> dict[str, Code]:
    """Renew leases ``owner`` holds, all with the same ``ttl``, in one call per shard.

    Returns the leases not renewed, with why. ``check_progress`` enforces
    progress deadlines (leases of tasks with a progress timeout). With
    several shards the per-shard calls go out pipelined: one round trip to
    a single server, one per master on a cluster.
    """
    if not leases:
        return {}
    # A large renewal allocates tens of thousands of short-lived objects; a
    # cyclic GC pass triggered in the middle of it doubled its latency. The
    # collection is deferred until the call is done (never skipped).
    pause_gc = len(leases) >= 1000 and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        ttl_ms, progress = ms(core.settings.ttl if ttl is None else ttl), 1 if check_progress else 0
        calls = []
        groups = core.keys.by_shard(leases) if core.shards > 1 else {0: list(leases)}
        for index, task_ids in groups.items():
            shard = core.keys.shard(index)
            start = shard.record_prefix()
            calls.append(([shard.deadlines, shard.stats, *(start + t for t in task_ids)],
                          [owner, ttl_ms, progress, len(start), *(leases[t] for t in task_ids)]))
        out: dict[str, Code] = {}
        results = core.calls.run_many(scripts.renew_many, calls, f"{len(leases)} leases of {owner}")
        for task_ids, flat in zip(groups.values(), results):
            if flat and flat[0] == Code.CORRUPT:
                # The shard's deadline index itself: none of its leases can be renewed.
                logger.error("lease heartbeat of %s: %s field %s %s; its %d lease(s) are not "
                             "renewed", owner, flat[1].decode(), flat[2].decode(), flat[3].decode(),
                             len(task_ids))
                out.update(dict.fromkeys(task_ids, Code.CORRUPT))
                continue
            i = 0
            while i < len(flat):
                task_id, code = flat[i].decode(), Code(flat[i + 1])
                out[task_id] = code
                i += 2
                if code is Code.CORRUPT:
                    # One record: that task's lease is not renewed (lost); the rest were.
                    logger.error("lease of task %s not renewed: its record %s field %s; it is "
                                 "treated as lost and recovery parks it", task_id,
                                 core.keys.record(task_id), flat[i].decode())
                    i += 1
        return out
    finally:
        if pause_gc:
            gc.enable()


def release(core: StoreCore, owner: str, leases: Mapping[str, int], *, started: Collection[str] = (),
            hand_back: bool = False) -> int:
    """Make these leases due now so they are recovered without waiting out the ttl.

    release.lua decides from each record whether the release costs a recovery
    (its body started) or not; ``started`` names the leases whose start the
    caller knows and whose start mark may not have reached the record yet (it
    rides with the release). ``hand_back``: the body gave the task back on
    purpose (Celery's Reject(requeue=True)), never a death.
    """
    if not leases:
        return 0
    calls = []
    for index, task_ids in core.keys.by_shard(leases).items():
        keys = [core.keys.shard(index).deadlines]
        args: list[Any] = [owner, 1 if hand_back else 0]
        for task_id in task_ids:
            keys.append(core.keys.record(task_id))
            args += [task_id, int(leases[task_id]), 1 if task_id in started else 0]
        calls.append((keys, args))
    released = 0
    for reply in core.calls.run_many(scripts.release, calls, f"{len(leases)} leases of {owner}"):
        raise_if_corrupt(reply, f"releasing leases of {owner}")
        released += int(reply[1])
        for task_id, what in zip(reply[2::2], reply[3::2]):
            logger.error("lease of task %s not released: its record %s field %s",
                         task_id.decode(), core.keys.record(task_id.decode()), what.decode())
    return released


def mark_started(core: StoreCore, owner: str, leases: Mapping[str, int], *, alone: bool = False) -> int:
    """Record that the bodies of these leases started running; returns how many were marked.

    Only a started lease counts a recovery when its owner dies: prefetched
    tasks of a dead worker are not charged for its death (mark_started.lua).
    """
    if not leases:
        return 0
    calls = []
    for index, task_ids in core.keys.by_shard(leases).items():
        calls.append(([core.keys.shard(index).stats, *(core.keys.record(t) for t in task_ids)],
                      [owner, 1 if alone else 0, *(int(leases[t]) for t in task_ids)]))
    return sum(int(n) for n in core.calls.run_many(scripts.mark_started, calls,
                                              f"start marks of {len(leases)} leases of {owner}"))


def finish_many(core: StoreCore, reqs: Sequence[FinishRequest]) -> list[LeaseError | None]:
    """Finish each of ``reqs`` (terminal outcomes, finish.lua), pipelined into one round trip
    per server; for each, None when accepted, else why not (LeaseLost, CorruptRecord).

    Raises what ``calls.run_many`` raises (LeaseUnavailable: no answer) for the whole
    batch: every finish is safe to send again (finish.lua answers OK to its own copy).
    """
    calls = _finish_calls(reqs, core)
    what = f"{len(reqs)} finishes"
    one = one_finish_call(core, reqs, calls) if len(calls) > 1 else None
    if one is not None:
        replies = _many_replies(core, reqs, core.calls.run(*one, what), what)
    else:  # a cluster, or a finish with its optional tail: finish.lua calls, pipelined
        replies = core.calls.run_many(scripts.finish, calls, what)
    return _answers(reqs, replies)


def acquire_with_finishes(core: StoreCore, req: AcquireRequest, finishes: Sequence[FinishRequest],
                          acquired: Callable[[Any, AcquireRequest], Acquisition]) -> tuple[Any, Any]:
    """The acquire ``req`` with ``finishes`` riding in the same write to a single server, the
    finishes first (a solo worker's finishes nobody waits for, worker/background.py).

    Returns the Acquisition or the LeaseError of the acquire, and the finishes' answers
    (as ``finish_many``'s) or the LeaseError of them all; an error of the write is both
    (each is safe to send again). ``acquired(raw, req)`` reads the acquire's reply. On a
    cluster, or with a finish that has its optional tail, the two go one after the other.
    """
    what = f"the acquire of task {req.task_id} with {len(finishes)} finish(es)"
    one = one_finish_call(core, finishes, _finish_calls(finishes, core)) if finishes else None
    if one is None:
        answers: Any = []
        if finishes:
            try:
                answers = finish_many(core, finishes)
            except LeaseError as exc:
                answers = exc
        try:
            return core.acquire_request(req), answers  # type: ignore[attr-defined]
        except LeaseError as exc:
            return exc, answers
    try:
        raw_finish, raw_acquire = core.calls.run_each([one, acquire_call(core, req)], what)
    except LeaseError as exc:
        return exc, exc
    try:
        acq: Any = acquired(raw_acquire, req)
    except LeaseError as exc:
        acq = exc
    try:
        answers = finishes_reply(core, finishes, one, raw_finish, what)
    except LeaseError as exc:
        answers = exc
    except Exception as exc:  # noqa: BLE001 - an answer we cannot read: the caller asks again
        answers = LeaseError(f"{what}: unreadable finishes' reply {raw_finish!r}: {exc!r}")
    return acq, answers


def finishes_call(core: StoreCore, reqs: Sequence[FinishRequest]) -> tuple[Any, list, list] | None:
    """The one script call that finishes ``reqs`` on a single server, for a caller that
    sends it in a write of its own (the worker's acquirer); None where it cannot be one call."""
    return one_finish_call(core, reqs, _finish_calls(reqs, core))


def finishes_reply(core: StoreCore, reqs: Sequence[FinishRequest], one: tuple[Any, list, list],
                   raw: Any, what: str) -> list[LeaseError | None]:
    """The answers, as ``finish_many``'s, in ``raw``: the reply read for ``one``
    (``finishes_call``). NOSCRIPT runs the call again here; an error of the whole call raises."""
    raw = core.calls.reply(one[0], one[1], one[2], raw, what)
    return _answers(reqs, [raw] if len(reqs) == 1 else _many_replies(core, reqs, raw, what))


def one_finish_call(core: StoreCore, reqs: Sequence[FinishRequest],
                    calls: Sequence[tuple[list, list]]) -> tuple[Any, list, list] | None:
    """The one script call (finish.lua for one, finish_many.lua for several) that finishes
    ``reqs`` on a single server; None on a cluster or when a finish has its optional tail."""
    if core.calls.cluster:
        return None
    if len(calls) == 1:
        return (scripts.finish, *calls[0])
    many = finish_many_call(calls)
    return None if many is None else (scripts.finish_many, *many)


def _finish_calls(reqs: Sequence[FinishRequest], core: StoreCore) -> list[tuple[list, list]]:
    calls = []
    for req in reqs:
        script, keys, args = finish_call(core, req)
        if script is not scripts.finish:
            raise ValueError(f"finish_many: task {req.task_id}: a retry hand-over is finished alone")
        calls.append((keys, args))
    return calls


def _answers(reqs: Sequence[FinishRequest], replies: Sequence[Any]) -> list[LeaseError | None]:
    out: list[LeaseError | None] = []
    for req, reply in zip(reqs, replies):
        try:
            raise_if_corrupt(reply, f"finish of task {req.task_id}")
            code, _, state = reply
            raise_unless_ok(Code(code), req.task_id, req.token, state.decode())
        except LeaseError as exc:
            out.append(exc)
        else:
            out.append(None)
    return out


def _many_replies(core: StoreCore, reqs: Sequence[FinishRequest], replies: Any, what: str) -> list:
    """finish_many.lua's reply to ``reqs``, one per finish. An error of one finish raises for
    all (naming its task), as a pipeline of finish.lua calls does: each finish is safe to
    send again."""
    if not isinstance(replies, list) or len(replies) != len(reqs):
        raise LeaseError(f"finish_many on {core.calls.description}: {len(reqs)} finish(es) answered "
                         f"{replies!r}")
    for req, reply in zip(reqs, replies):
        if isinstance(reply, Exception):
            where = f"finish of task {req.task_id}, one of {what}"
            error = core.calls.error(scripts.finish_many, reply, where)
            raise error if isinstance(error, LeaseError) else LeaseError(
                f"finish_many ({where}) on {core.calls.description}: {reply!r}")
    return replies
