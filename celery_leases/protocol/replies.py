"""The shapes the scripts' replies can take (each header's Output), for a caller that reads
raw replies off a connection of its own (the worker's acquirer): a reply that cannot be
the next call's means replies and calls are out of step.
"""
from __future__ import annotations

from typing import Any

from .codes import Code

__all__ = ["is_acquire_many_reply", "is_finishes_reply", "is_finish_reply", "is_acquire_reply"]


def is_acquire_many_reply(reply: Any, n: int) -> bool:
    """True for what acquire_many.lua can return for ``n`` acquires: an error of the
    whole call, or ``n`` acquire replies and the number of leases marked."""
    if isinstance(reply, Exception):
        return True
    return isinstance(reply, list) and len(reply) == n + 1 and type(reply[-1]) is int and \
        all(is_acquire_reply(item) for item in reply[:n])


def is_finishes_reply(reply: Any, n: int) -> bool:
    """True for what finish.lua (one finish) or finish_many.lua (``n``) can return: an error
    of the whole call, a finish's {code, token, state} or {CORRUPT, ...}, or ``n`` of those."""
    if isinstance(reply, Exception):
        return True
    if n == 1:
        return is_finish_reply(reply)
    return isinstance(reply, list) and len(reply) == n and all(
        isinstance(item, Exception) or is_finish_reply(item) for item in reply)


def is_finish_reply(reply: Any) -> bool:
    return isinstance(reply, list) and len(reply) in (3, 4) and type(reply[0]) is int


def is_acquire_reply(reply: Any) -> bool:
    """True for what acquire.lua can return: {code, token, generation, recoveries, state[, isolate]},
    {CORRUPT, key, field, detail}, or an error."""
    if isinstance(reply, Exception):
        return True
    if not isinstance(reply, list) or not reply or type(reply[0]) is not int:
        return False
    if reply[0] == Code.CORRUPT:
        return len(reply) == 4
    return (len(reply) in (5, 6) and reply[0] in _ACQUIRE_CODES and all(type(n) is int for n in reply[1:4])
            and isinstance(reply[4], bytes))


#: Codes acquire.lua answers with (its header's Output).
_ACQUIRE_CODES = frozenset({Code.ACQUIRED, Code.TAKEN_OVER, Code.BUSY, Code.FINISHED, Code.STALE,
                            Code.DEAD, Code.LOST, Code.NO_MESSAGE})
