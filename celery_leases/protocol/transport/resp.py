"""The Redis protocol (RESP2, and what RESP3 adds to it), packed and parsed by hand.

For the direct path (direct.py), the publish line (line.py) and the worker's acquirer.

The acquirer writes its commands and reads their replies on a socket of its
own, from the event loop, several at a time; redis-py's connection objects
read one reply per call and poll the socket between them. Only what a Lua
script's reply can hold is decoded: integers, bulk and simple strings,
arrays, nulls and errors. ``Scanner`` finds where a reply ends as its bytes
arrive, each byte looked at once, so a reply read in many pieces (500 message
bodies of a recovery claim) is parsed once, not once per read.
"""
from __future__ import annotations

from typing import Any

from redis.exceptions import BusyLoadingError, NoScriptError, ReadOnlyError, ResponseError

#: Error replies whose first word names redis-py's exception class for them (the rest are ResponseError).
ERRORS: dict[bytes, type[Exception]] = {
    b"NOSCRIPT": NoScriptError, b"LOADING": BusyLoadingError, b"READONLY": ReadOnlyError,
}


class Incomplete(Exception):
    """The buffer ends before the reply does: read more."""


#: Short str argument -> its packed bulk string. Most of a call's strings come back in
#: every call (the script's SHA, shard keys, the owner, a task name); a task's own (its id
#: and keys) fill the cache until it is cleared, which costs one encoding of the others
#: again. Longer strings (an envelope, a result) are packed each time: at most
#: _PACKED_MAX entries of at most _PACKED_LEN characters are ever held.
_packed: dict[str, bytes] = {}
_PACKED_MAX, _PACKED_LEN = 2048, 128


def pack(*args: Any) -> bytes:
    """One command; the arguments are str, bytes, int or float (as redis-py sends them)."""
    return b"*%d\r\n" % len(args) + segments(args)


def segments(args: Any) -> bytes:
    """The arguments of a command packed without its array header: pieces of a command
    joined later (acquire_many's keys and arguments, job by job)."""
    out: list[bytes] = []
    append, packed = out.append, _packed
    for arg in args:
        kind = type(arg)
        if kind is str and len(arg) <= _PACKED_LEN:
            segment = packed.get(arg)
            if segment is None:
                data = arg.encode()
                segment = b"$%d\r\n%s\r\n" % (len(data), data)
                if len(packed) >= _PACKED_MAX:
                    packed.clear()
                packed[arg] = segment
            append(segment)
            continue
        if kind is bytes:
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:
            data = bytes(arg)
        append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int]:
    """The reply starting at ``pos`` and where the next one starts; Incomplete if cut short.

    An error reply is returned (not raised) as its exception, as redis-py's
    pipelines do, so one failed call does not hide the replies after it.
    """
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    kind, line, after = buf[pos], buf[pos + 1:end], end + 2
    if kind == 0x3A:  # ':' integer
        return int(line), after
    if kind == 0x24:  # '$' bulk string
        size = int(line)
        if size < 0:
            return None, after
        stop = after + size
        if len(buf) < stop + 2:
            raise Incomplete
        return bytes(buf[after:stop]), stop + 2
    if kind == 0x2A:  # '*' array
        size = int(line)
        if size < 0:
            return None, after
        items = []
        for _ in range(size):
            item, after = parse(buf, after)
            items.append(item)
        return items, after
    if kind == 0x2B:  # '+' simple string
        return bytes(line), after
    if kind == 0x2D:  # '-' error
        text = bytes(line).decode("utf-8", "replace")
        return ERRORS.get(bytes(line).split(b" ", 1)[0], ResponseError)(text), after
    if kind == 0x5F:  # '_' RESP3 null
        return None, after
    raise ResponseError(f"unexpected reply type {chr(kind)!r} from Redis: {bytes(buf[pos:end])!r}")


class Scanner:
    """Where the reply (or the first ``replies`` replies) at the start of a growing buffer
    ends, resumed from where it stopped.

    ``end(buf)`` after each read: None until the whole reply is in, then the
    offset after it. Only headers are looked at (a bulk string's body is
    skipped by its length), so the cost over all reads is linear in the reply.
    """

    __slots__ = ("pos", "pending")

    def __init__(self, replies: int = 1) -> None:
        #: Offset of the next element header to read.
        self.pos = 0
        #: Elements still to come at each open array depth (the replies themselves first).
        self.pending = [replies]

    def end(self, buf: bytes | bytearray) -> int | None:
        pending = self.pending
        while pending:
            pos = self.pos
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            kind, after = buf[pos], line_end + 2
            size = 0
            if kind in (0x24, 0x2A):  # '$' bulk string, '*' array: a length follows
                size = int(buf[pos + 1:line_end])
                if kind == 0x24 and size >= 0:
                    after += size + 2
                    if len(buf) < after:
                        return None
            self.pos = after
            pending[-1] -= 1
            if kind == 0x2A and size > 0:
                pending.append(size)
            while pending and pending[-1] == 0:
                pending.pop()
        return self.pos


__all__ = ["pack", "parse", "Incomplete", "ERRORS", "Scanner"]
