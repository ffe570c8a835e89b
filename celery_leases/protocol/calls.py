"""The one script runner: EVALSHA, its NOSCRIPT fallback and its error map, in one place.

Every script call of the package goes through here: a single call (on the
process's own connection when that is safe, transport/direct.py), many calls pipelined
into one round trip per server (one per master on a cluster), and a command
packed for a caller that writes its own socket (the worker's acquirer), whose
reply comes back here. A server that lost its script cache (restart, SCRIPT
FLUSH, failover) answers NOSCRIPT; ``reload`` then sends the source once,
which also caches it again. Redis errors become the LeaseErrors of errors.py,
named after the script and what it was doing; a refused transition becomes
LeaseLost with ``Code.reason`` (``raise_unless_ok``).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Sequence

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from ..exceptions import LeaseError, LeaseLost
from .codes import Code
from .connection import describe
from .errors import lease_error
from .transport.direct import DirectCaller
from .transport.direct import supported as direct_supported
from .transport.resp import pack

if TYPE_CHECKING:
    from .scripts import Script

__all__ = ["ScriptCalls", "call_script", "reload", "raise_unless_ok", "ms", "compact_json"]

#: (keys, args) of one script call.
Call = tuple[Sequence[Any], Sequence[Any]]

#: One encoder for every stored envelope: json.dumps with separators builds a new one per call.
compact_json = json.JSONEncoder(separators=(",", ":")).encode


def ms(seconds: float) -> int:
    """Seconds as the whole milliseconds the scripts take (never negative)."""
    return max(0, int(round(seconds * 1000)))


def reload(client: Any, script: "Script", keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """The script sent as source (EVAL): the answer to NOSCRIPT, which caches it again."""
    return client.eval(script.source, len(keys), *keys, *args)


def call_script(client: Any, script: "Script", keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """EVALSHA through redis-py, with the NOSCRIPT fallback (no error mapping: see ScriptCalls)."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return reload(client, script, keys, args)


def raise_unless_ok(code: Code, task_id: str, token: int, state: str = "") -> None:
    """The one place a refused transition becomes an exception (LeaseLost with the code's reason)."""
    if code is Code.OK:
        return
    reason = f"already finished ({state})" if code is Code.FINISHED and state else code.reason
    raise LeaseLost(task_id, token, reason)


class ScriptCalls:
    """Script calls on one client (a server, or a Redis Cluster), errors named after ``description``."""

    def __init__(self, client: redis.Redis, description: str | None = None) -> None:
        self.client = client
        self.description = description or describe(client)
        self.cluster = hasattr(client, "get_node_from_key")
        #: Single calls skip redis-py's per-call work where that is safe (transport/direct.py).
        self.direct = DirectCaller(client) if direct_supported(client) else None

    def error(self, script: "Script", exc: BaseException, what: str) -> BaseException:
        """The LeaseError a Redis error of ``script`` becomes (anything else unchanged): errors.py."""
        return lease_error(exc, f"{script.name} ({what})", self.description)

    def _raise(self, script: "Script", exc: BaseException, what: str) -> None:
        error = self.error(script, exc, what)
        if error is exc:
            raise exc
        raise error from exc

    def run(self, script: "Script", keys: Sequence[Any], args: Sequence[Any], what: str) -> Any:
        """Run a script, turning Redis errors into LeaseErrors that name what failed."""
        try:
            direct = self.direct
            if direct is not None:
                try:
                    return direct.call(script.sha, keys, args)
                except NoScriptError:
                    return reload(self.client, script, keys, args)
            return call_script(self.client, script, keys, args)
        except Exception as exc:
            self._raise(script, exc, what)

    def read(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` (plain commands, no script), its Redis errors mapped the same way."""
        try:
            return fn()
        except Exception as exc:
            error = lease_error(exc, what, self.description)
            if error is exc:
                raise
            raise error from exc

    def reply(self, script: "Script", keys: Sequence[Any], args: Sequence[Any], raw: Any,
              what: str) -> Any:
        """The reply ``raw`` to an EVALSHA of ``script`` sent elsewhere, as ``run`` would give it.

        NOSCRIPT is answered by running the call again here (which loads the
        script); an error reply raises as ``run`` raises it.
        """
        if isinstance(raw, NoScriptError):
            return self.run(script, keys, args, what)
        if isinstance(raw, Exception):
            error = self.error(script, raw, what)
            raise error if isinstance(error, LeaseError) else LeaseError(f"{script.name} ({what}): {raw!r}")
        return raw

    def run_many(self, script: "Script", calls: Sequence[Call], what: str) -> list:
        """Run ``script`` once per (keys, args), pipelined into one round trip per server.

        Each call touches one shard, so each is legal on a cluster; a cluster
        pipeline sends each node its calls together. A call that finds its
        script not cached (NOSCRIPT) is repeated alone, which loads it.
        """
        if len(calls) == 1:
            keys, args = calls[0]
            return [self.run(script, keys, args, what)]
        if self.cluster:
            return self._run_many_cluster(script, calls, what)
        try:
            if self.direct is not None:
                results = self.direct.call_many(script.sha, calls)
            else:
                pipe = self.client.pipeline(transaction=False)
                for keys, args in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                results = pipe.execute(raise_on_error=False)
        except Exception as exc:
            self._raise(script, exc, what)
        out = []
        for (keys, args), result in zip(calls, results):
            if isinstance(result, NoScriptError):
                result = self.run(script, keys, args, what)
            elif isinstance(result, Exception):
                raise self.error(script, result, what) from result
            out.append(result)
        return out

    def run_each(self, calls: Sequence[tuple["Script", Sequence[Any], Sequence[Any]]], what: str) -> list:
        """Different scripts' calls in one write to a single server: each reply raw, for
        ``reply`` to take (an error reply is its exception, not raised); an error of the
        whole write raises, mapped as ``read`` maps it."""
        def send() -> list:
            if self.direct is not None:
                return self.direct.send([pack("EVALSHA", script.sha, len(keys), *keys, *args)
                                         for script, keys, args in calls])
            pipe = self.client.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return pipe.execute(raise_on_error=False)
        return self.read(send, what)

    def _run_many_cluster(self, script: "Script", calls: Sequence[Call], what: str) -> list:
        """``run_many`` on a cluster: one pipeline per master, on its own connection.

        redis-py's cluster pipeline refuses EVALSHA, so the calls are grouped
        by the master that serves their slot (as the client last saw the
        slot map). A call that meets a redirection (MOVED, ASK, a failover
        under way) or an error of its node's connection is repeated alone
        through the cluster client, which follows the new map and retries.
        Every master gets its calls even when one fails; then the first
        error is raised.
        """
        cluster: Any = self.client
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i, (keys, _) in enumerate(calls):
            try:
                node = cluster.get_node_from_key(keys[0])
            except Exception:  # noqa: BLE001 - slot not covered now: the lone call reports it
                node = None
            name = getattr(node, "name", "")
            nodes[name] = node
            by_node.setdefault(name, []).append(i)
        out: list[Any] = [None] * len(calls)
        first_error: LeaseError | None = None
        for name, indexes in by_node.items():
            results: list[Any] = [None] * len(indexes)
            node = nodes[name]
            if node is not None:
                try:
                    pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
                    for i in indexes:
                        keys, args = calls[i]
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    results = pipe.execute(raise_on_error=False)
                except Exception:  # noqa: BLE001 - each call is repeated alone below
                    results = [None] * len(indexes)
            for i, result in zip(indexes, results):
                try:
                    if result is None or isinstance(result, (NoScriptError, RedisConnectionError)) or (
                            isinstance(result, ResponseError) and _redirected(result)):
                        keys, args = calls[i]
                        result = self.run(script, keys, args, what)
                    elif isinstance(result, Exception):
                        raise self.error(script, result, what) from result
                except LeaseError as exc:
                    # The other masters' calls still run (a heartbeat still
                    # renews the shards that answer); the first error is raised.
                    first_error = first_error or exc
                out[i] = result
        if first_error is not None:
            raise first_error
        return out


def _redirected(error: Exception) -> bool:
    """True for a cluster's "ask that other node" answers (the slot moved, a failover)."""
    text = str(error)
    return text.startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")) or \
        type(error).__name__ in ("MovedError", "AskError", "TryAgainError", "ClusterDownError",
                                 "MasterDownError")
