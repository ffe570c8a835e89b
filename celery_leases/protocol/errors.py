"""The one map from redis-py errors to LeaseErrors, for every path that talks to Redis.

The store (scripts, pipelines, reads), the direct path and the publish line (transport/), the
worker's acquirer and the fenced writes all hand their exceptions to
``lease_error``, so an error means the same thing wherever it is met:

- ``LeaseUnavailable``: the call may succeed later. Connection errors and
  timeouts (redis-py's and the socket's), ``LOADING`` (a restarted server
  reading its data), ``READONLY`` (a master demoted by a failover),
  ``MASTERDOWN`` (a replica that lost its master), ``BUSY`` (the server
  is running another script past its time limit), ``CLUSTERDOWN``,
  ``TRYAGAIN``, ``MOVED``/``ASK`` (a cluster moving slots), a slot no node
  covers.
- ``CorruptRecord``: a key of the wrong type (``WRONGTYPE``) or a script's
  ``CORRUPT`` answer (a field that fails its validation): retrying cannot help.
- ``LeaseError``: any other error reply (a script error, an unknown command).
- Anything else (a bug, a ``DataError`` for a bad argument) is returned
  unchanged, for the caller to raise as it is.

Error replies are recognised by class where redis-py gives one and by their
first word otherwise: transport/resp.py (the direct path, the publish line and
the acquirer) only knows the few classes it needs, and a script's error reply
carries the text of the command that failed inside it (``WRONGTYPE ... script: ...``).

Knows nothing of Celery.
"""
from __future__ import annotations

from redis.exceptions import ClusterError, ResponseError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..exceptions import CorruptRecord, LeaseError, LeaseUnavailable

__all__ = ["lease_error", "UNAVAILABLE_REPLIES", "CORRUPT_REPLIES"]

#: Exception classes of a call that may succeed later. ``OSError`` covers the
#: socket's own errors (``socket.timeout`` on the direct path, a refused connect).
#: ``ClusterError`` covers ClusterDownError and MasterDownError.
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, ClusterError, SlotNotCoveredError)

#: First words of error replies after which a call may succeed later.
UNAVAILABLE_REPLIES = frozenset({"LOADING", "READONLY", "MASTERDOWN", "BUSY", "CLUSTERDOWN",
                                 "TRYAGAIN", "MOVED", "ASK"})
#: Words of error replies that say a key or field holds something invalid.
CORRUPT_REPLIES = ("CORRUPT", "WRONGTYPE")


def lease_error(exc: BaseException, what: str, where: str = "") -> BaseException:
    """The LeaseError that ``exc``, met while doing ``what``, becomes (else ``exc`` itself).

    ``what`` names the operation, task and key (``"finish (task t1, key leases:lease:t1)"``);
    ``where`` the server (the store's description), when the caller knows it.
    A LeaseError passes through unchanged.
    """
    if isinstance(exc, LeaseError):
        return exc
    at = f" at {where}" if where else ""
    if isinstance(exc, ResponseError):
        text = str(exc)
        # A pipeline's error names its command first ("Command # 1 (...) of pipeline caused
        # error: BUSY ..."): the server's reply is what follows.
        reply = text.split(" caused error: ", 1)[-1] if text.startswith("Command # ") else text
        first = reply.split(" ", 1)[0]
        if first in UNAVAILABLE_REPLIES or type(exc).__name__ in ("ReadOnlyError", "AskError",
                                                                   "MovedError", "TryAgainError"):
            return LeaseUnavailable(f"lease store{at} unavailable during {what}: {text}")
        if any(word in text for word in CORRUPT_REPLIES):
            return CorruptRecord(f"{what}: {text}")
        if isinstance(exc, ClusterError):  # ClusterDownError, MasterDownError without their word
            return LeaseUnavailable(f"lease store{at} unavailable during {what}: {text}")
        return LeaseError(f"{what} failed{' on ' + where if where else ''}: {text}")
    if isinstance(exc, _UNAVAILABLE):
        return LeaseUnavailable(f"lease store{at} unreachable during {what}: {exc}")
    return exc
