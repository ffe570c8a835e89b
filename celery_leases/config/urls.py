"""The one rule of a lease store URL: what ``install()``, the worker and the CLI accept.

``redis_url_error(url, setting)`` is the only place that decides whether a URL
can be the lease store's; every entry point reaches it through the settings
(``celery_leases.config``: ``install(app)``, the worker's start-up check, every
``celery leases`` command, the first publish). Its message names the setting
(``leases_redis_url``, or the broker or backend setting the lease store fell
back to), every accepted scheme, what is wrong, and the value with its password
masked (``connection.redact``).

The accepted schemes are the ones the connection code dispatches on
(``protocol/connection.py``: ``SCHEMES``); this module adds what the parsers
below it would let through or misread: a missing ``//`` (``redis:/host``), an
empty host (an unset variable in ``redis://${HOST}:6379``: redis-py would
quietly connect to localhost), a port that is not 1-65535, a database that is
not a number (redis-py would quietly use database 0, or read ``/2/3`` as 23).
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis

from ..protocol.connection import _CLUSTER_QUERY_OPTIONS, SCHEMES, redact, scheme

__all__ = ["ACCEPTED", "check_redis_url", "redis_url_error"]

#: The schemes as the messages list them.
ACCEPTED = ", ".join(f"{s}://" for s in SCHEMES)

_SOCKET_SCHEMES = ("unix", "redis+socket")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: What an operator should write, by scheme, in a message about a malformed URL.
_FORMS = {
    "redis": "redis://[user:password@]host[:port][/db]",
    "rediss": "rediss://[user:password@]host[:port][/db]",
    "unix": "unix://[user:password@]/path/to/redis.sock[?db=N]",
    "redis+socket": "redis+socket:///path/to/redis.sock[?db=N]",
    "sentinel": "sentinel://[user:password@]host:port[/db];sentinel://host2:port2...",
    "redis+cluster": "redis+cluster://[user:password@]host:port[,host:port...]",
    "rediss+cluster": "rediss+cluster://[user:password@]host:port[,host:port...]",
}


class _Bad(Exception):
    """What is wrong with a URL; never quotes a piece of it (it may be a piece of a password)."""


def redis_url_error(url: Any, setting: str = "leases_redis_url") -> str | None:
    """Why ``url`` cannot be the lease store's URL (one line naming ``setting``, the accepted
    schemes and the masked value), or None when it can."""
    try:
        _check(url)
    except _Bad as exc:
        why = str(exc)
        if isinstance(url, str) and url.strip():
            if redact(url) != url.strip() and not why.startswith("the scheme"):
                why += " (a '/', '?', '#' or '@' in the password must be %-encoded)"
            shown = repr(redact(url))
        else:
            shown = f"{url!r} ({type(url).__name__})"
        return f"{setting} must be a Redis URL ({ACCEPTED}): {why}; got {shown}"
    return None


def check_redis_url(url: Any, setting: str = "leases_redis_url") -> None:
    """Raise ConfigurationError (``redis_url_error``'s message) unless ``url`` is a lease store URL."""
    message = redis_url_error(url, setting)
    if message is not None:
        from ..exceptions import ConfigurationError
        raise ConfigurationError(message)


def _check(url: Any) -> None:
    if not isinstance(url, str) or not url.strip():
        raise _Bad("it is not a URL")
    name = scheme(url)
    if name not in SCHEMES:
        raise _Bad(f"the scheme {name!r} is not one of them" if name else "it has no scheme")
    if name == "sentinel":
        parts = [p.strip() for p in url.split(";") if p.strip()]
        for number, part in enumerate(parts, 1):
            where = f"part {number}: " if len(parts) > 1 else ""
            if scheme(part) != "sentinel":
                raise _Bad(f"{where}every part of a Sentinel URL is sentinel://host:port "
                           f"(parts separated by ';')")
            _server(part, name, where)
        return
    if name in _CLUSTER_SCHEMES:
        _cluster(url, name)
        return
    _server(url.strip(), name, "")


def _slashes(url: str, name: str, where: str) -> str:
    """The URL after ``scheme://``; a missing ``//`` is an error."""
    head, sep, rest = url.partition("://")
    if not sep or "/" in head:
        raise _Bad(f"{where}'{name}:' must be followed by '//': {_FORMS[name]}")
    return rest


def _port(text: str, where: str) -> None:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise _Bad(f"{where}the port must be a number from 1 to 65535")


def _server(url: str, name: str, where: str) -> None:
    """One server: redis://, rediss://, unix://, redis+socket://, or one sentinel:// part."""
    _slashes(url, name, where)
    split = urlsplit(url)
    if name in _SOCKET_SCHEMES:
        if split.path in ("", "/"):
            raise _Bad(f"{where}no socket path: {_FORMS[name]}")
        url = "unix://" + url.split("://", 1)[1]
    else:
        host_port = split.netloc.rpartition("@")[2]
        if host_port.startswith("["):  # [IPv6]:port
            host, _, port = host_port[1:].partition("]")
            port = port[1:] if port.startswith(":") else port
        else:
            host, _, port = host_port.partition(":")
        if not host:
            raise _Bad(f"{where}no host (an empty host is often an unset variable): {_FORMS[name]}")
        if port or host_port.endswith(":"):
            _port(port, where)
        path = split.path
        if path not in ("", "/") and not (path[1:].isascii() and path[1:].isdigit()):
            raise _Bad(f"{where}the database must be a number (the path after the host: /0, /1, ...)")
    try:
        # redis-py's own parser: the query options (db, ssl_*, timeouts) and the credentials.
        redis.connection.parse_url(url if name != "sentinel" else "redis://" + url.split("://", 1)[1])
    except ValueError as exc:
        raise _Bad(f"{where}{_parser_message(url, exc)}") from None


def _parser_message(url: str, exc: ValueError) -> str:
    """redis-py's reason, unless the URL holds a password (its text may quote a piece of it)."""
    if redact(url) != url.strip():
        return "it does not parse (check the query options)"
    return str(exc).rstrip(".")


def _cluster(url: str, name: str) -> None:
    rest = _slashes(url.strip(), name, "")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise _Bad("a Redis Cluster has only database 0 (no path, '/' or '/0')")
    nodes = [n.strip() for n in netloc.rpartition("@")[2].split(",") if n.strip()]
    if not nodes:
        raise _Bad(f"no node: {_FORMS[name]}")
    for node in nodes:
        if node.startswith("["):
            host, _, port = node[1:].partition("]")
            port = port[1:] if port.startswith(":") else port
        else:
            host, _, port = node.rpartition(":") if ":" in node else (node, "", "")
        if not host:
            raise _Bad(f"a node has no host (an empty host is often an unset variable): {_FORMS[name]}")
        if port or node.endswith(":"):
            _port(port, "")
    for option in (o.partition("=")[0] for o in query.split("&") if o):
        if option not in _CLUSTER_QUERY_OPTIONS:
            named = "" if redact(url) != url.strip() else f" {option!r}"
            raise _Bad(f"unknown option{named} for a Redis Cluster URL "
                       f"(known: {', '.join(_CLUSTER_QUERY_OPTIONS)})")
