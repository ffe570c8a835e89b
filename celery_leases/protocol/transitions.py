"""The typed boundary of the store's two busiest transitions, and the KEYS/ARGV built from it.

``AcquireRequest`` is one acquire (``LeaseStore.acquire``'s arguments),
``FinishRequest`` one finish. The functions here turn them into the script, KEYS
and ARGV of acquire.lua / reassert.lua / acquire_many.lua and finish.lua /
hand_over.lua, in the layout of each script's header: the only place those
layouts are built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from .calls import compact_json, ms
from .codes import OUTCOMES
from .core import StoreCore, one_task
from . import unwritten
from .scripts import Script, scripts
from .transport.resp import segments

__all__ = ["AcquireRequest", "FinishRequest", "acquire_request", "ACQUIRE_KEYS", "ACQUIRE_ARGS"]

#: Keys and arguments of one acquire (acquire.lua's header): acquire_many takes them in blocks.
ACQUIRE_KEYS, ACQUIRE_ARGS = 6, 15
#: Keys and arguments of a finish without its optional tail (finish.lua's header): finish_many
#: takes them in blocks.
FINISH_KEYS, FINISH_ARGS = 5, 6


@dataclass(frozen=True)
class AcquireRequest:
    """One acquire of ``task_id``'s lease by ``owner``, for one delivery of its message.

    The fields are ``LeaseStore.acquire``'s arguments (see its docstring); None for
    ``ttl`` and ``max_recoveries`` takes the store's.
    """

    task_id: str
    owner: str
    ttl: float | None = None
    generation: int = 0
    attempt: int = 0
    max_recoveries: int | None = None
    progress_timeout: float = 0
    name: str = ""
    body: bytes = b""
    envelope: Mapping | None = None
    reassert: int = 0
    publish: str = ""
    recorded: bool = False
    shared: bool = False

    def replace(self, **changes: Any) -> "AcquireRequest":
        return dataclasses.replace(self, **changes)


#: What the store's acquire_many / acquire_parts take for one acquire: a request, or its
#: keyword arguments (``task_id`` and ``owner`` included), as callers built them before.
AcquireLike = Union[AcquireRequest, Mapping[str, Any]]


def acquire_request(call: AcquireLike) -> AcquireRequest:
    """``call`` as an AcquireRequest (TypeError for a keyword acquire does not take)."""
    return call if isinstance(call, AcquireRequest) else AcquireRequest(**call)


@dataclass(frozen=True)
class FinishRequest:
    """The owner's outcome of one execution: ``LeaseStore.finish``'s arguments (see there)."""

    task_id: str
    owner: str
    token: int
    outcome: str
    next_attempt: int = 0
    retry_grace: float | None = None
    write: tuple[str, bytes | str, int] | None = None
    not_after: int = 0
    kept: bytes | None = None
    kept_due: float = 0.0
    written: Sequence[str] = ()


def acquire_call(core: StoreCore, req: AcquireRequest) -> tuple[Script, list, list]:
    """The script, KEYS and ARGV of an acquire: acquire.lua, or reassert.lua for ``reassert``."""
    task_id, keys_of = req.task_id, core.keys
    # (The wire would carry 1.5 as "1.5": a wrong id, not a task's.)
    key, shard = keys_of.record(one_task(task_id)), keys_of.shard_for(task_id)
    keys = [key, shard.deadlines, shard.sequence, shard.stats, keys_of.message(task_id)]
    if not req.reassert:
        keys.append(shard.queued)  # a record queued at publish leaves this index (acquire.lua)
    # A recorded message is left out (acquire.lua ARGV[14]); a re-assert always sends it.
    omit = bool(req.recorded and req.publish and not req.reassert)
    args = [task_id, req.owner, ms(core.settings.ttl if req.ttl is None else req.ttl), int(req.generation),
            int(req.attempt), core.settings.max_recoveries if req.max_recoveries is None else int(req.max_recoveries),
            ms(req.progress_timeout), req.name, b"" if omit else req.body,
            "" if omit or req.envelope is None else compact_json(req.envelope)]
    if req.reassert:
        return scripts.reassert, keys, [*args, int(req.reassert)]
    return scripts.acquire, keys, [*args, ms(core.settings.retention), core.clock_tokens, req.publish or "",
                                   1 if omit else 0, 1 if req.shared else 0]


def shared_acquire(core: StoreCore, req: AcquireRequest) -> tuple[list, list]:
    """One acquire's keys and arguments as acquire_many takes them (acquire.lua's)."""
    script, keys, args = acquire_call(core, req)
    if script is not scripts.acquire:
        raise ValueError(f"task {req.task_id!r}: a re-assert cannot share an acquire_many call")
    return keys, args


def many_frame(core: StoreCore, n: int, owner: str,
               starts: Mapping[str, int] | None) -> tuple[list, list]:
    """acquire_many's keys after the acquires' (the marks': their shard's stats hash, then
    each record) and its arguments before theirs (n, m, owner, the m tokens): its header's
    layout, in this one place."""
    if not starts:
        return [], [n, 0, ""]
    first = next(iter(starts))
    tokens = [int(token) for token in starts.values()]
    return ([core.keys.shard_for(first).stats, *(core.keys.record(t) for t in starts)],
            [n, len(tokens), owner, *tokens])


def acquire_many_call(core: StoreCore, reqs: Sequence[AcquireLike], owner: str,
                      starts: Mapping[str, int] | None) -> tuple[list, list]:
    """KEYS and ARGV of acquire_many.lua: every acquire's block, then the marks'."""
    keys: list = []
    args: list = []
    for req in reqs:
        one_keys, one_args = shared_acquire(core, acquire_request(req))
        keys += one_keys
        args += one_args
    mark_keys, head = many_frame(core, len(reqs), owner, starts)
    return keys + mark_keys, head + args


def acquire_parts(core: StoreCore, req: AcquireRequest) -> tuple[bytes, bytes]:
    """One acquire's keys and arguments, packed, for ``acquire_many_command``."""
    keys, args = shared_acquire(core, req)
    return segments(keys), segments(args)


def acquire_many_command(core: StoreCore, parts: Sequence[tuple[bytes, bytes]], owner: str = "",
                         starts: Mapping[str, int] | None = None) -> bytes:
    """The EVALSHA of acquire_many for acquires packed by ``acquire_parts``, and marks."""
    mark_keys, head = many_frame(core, len(parts), owner, starts)
    n_keys = ACQUIRE_KEYS * len(parts) + len(mark_keys)
    n_args = len(head) + ACQUIRE_ARGS * len(parts)
    return b"".join([b"*%d\r\n" % (3 + n_keys + n_args),
                     segments(("EVALSHA", scripts.acquire_many.sha, n_keys)),
                     *(keys for keys, _ in parts), segments(mark_keys), segments(head),
                     *(args for _, args in parts)])


def finish_call(core: StoreCore, req: FinishRequest) -> tuple[Script, list, list]:
    """The script, KEYS and ARGV of a finish: finish.lua, or hand_over.lua for a retry.

    ValueError for a request no script takes (an unknown outcome, a retry that writes
    a result, a result both written and kept).
    """
    task_id, outcome, write = req.task_id, req.outcome, req.write
    if outcome not in OUTCOMES:
        raise ValueError(f"finish: unknown outcome {outcome!r} for task {task_id}; "
                         f"expected one of {OUTCOMES}")
    keys_of = core.keys
    key, shard = keys_of.record(one_task(task_id)), keys_of.shard_for(task_id)
    if outcome == "retry":  # the hand-over to the next attempt (hand_over.lua)
        if write is not None:
            raise ValueError(f"finish: task {task_id}: a retry hand-over writes no result")
        wait = core.settings.publish_grace if req.retry_grace is None else req.retry_grace
        # With publish tracking the next attempt is due at its countdown (retry_grace is the
        # countdown plus publish_grace) and waits the delivery timeout from then.
        return scripts.hand_over, [key, shard.deadlines, shard.stats, shard.sequence, shard.queued], [
            task_id, req.owner, int(req.token), int(req.next_attempt), ms(wait), int(req.not_after),
            ms(max(0.0, wait - core.settings.publish_grace)), ms(core.settings.delivery_timeout or 0)]
    if write is not None and req.kept is not None and unwritten.writes_result(req.kept):
        raise ValueError(f"finish: task {task_id}: a result written by the finish is not kept too "
                         f"(keep only its follow-ups: unwritten.pack(write=False))")
    keys = [key, shard.deadlines, shard.stats, keys_of.message(task_id), shard.sequence]
    args: list = [task_id, req.owner, int(req.token), outcome, ms(core.settings.retention), int(req.not_after)]
    # The optional rest only as far as it is used (finish.lua's header): every key and
    # argument costs the server its time.
    riding = bool(req.kept) or bool(req.written)
    if write is not None:
        if write[1] in ("", b""):
            raise ValueError(f"finish: task {task_id}: the result written with the outcome to "
                             f"{write[0]!r} is empty")
        keys.append(write[0])
        args += [write[1], int(write[2] or 0)]
    elif riding:
        keys.append(key)  # (a placeholder: no result is written)
        args += ["", 0]
    if riding:
        keys += [shard.unwritten, shard.unwritten_results]
        args += [req.kept or "", ms(req.kept_due), *req.written]
    return scripts.finish, keys, args


def finish_many_call(calls: Sequence[tuple[list, list]]) -> tuple[list, list] | None:
    """KEYS and ARGV of finish_many.lua for finishes built by ``finish_call``, or None when
    one of them carries finish.lua's optional tail (a result written, kept or confirmed),
    which finish_many does not take."""
    if not all(len(keys) == FINISH_KEYS and len(args) == FINISH_ARGS for keys, args in calls):
        return None
    return ([key for keys, _ in calls for key in keys],
            [len(calls), *(arg for _, args in calls for arg in args)])
