"""Redis clients for the lease store, built from ``leases_redis_url``.

One place decides what a URL means, so the worker, the CLI, the startup
checks and ``LeaseStore.from_url`` all connect the same way:

- ``redis://``, ``rediss://`` (TLS), ``unix://``: one server (redis-py's own
  URL parsing: ACL user and password, ``db``, ``ssl_*`` query options);
- ``sentinel://``: the master a set of Sentinels names (see ``_sentinel``);
- ``redis+cluster://``, ``rediss+cluster://``: a Redis Cluster (see ``_cluster``).

``redact`` is the only way a URL reaches a log line, an error or CLI output.
Knows nothing of Celery.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import redis

from .exceptions import ConfigurationError

__all__ = ["connect", "redact", "describe", "SCHEMES"]


def _single(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    return redis.Redis.from_url(url, **kwargs)


def _sentinel(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    raise ConfigurationError(f"leases_redis_url {redact(url)}: Sentinel URLs are not supported yet")


def _cluster(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    raise ConfigurationError(f"leases_redis_url {redact(url)}: Redis Cluster URLs are not supported yet")


_FACTORIES: "dict[str, Callable[[str, Mapping[str, Any], dict], Any]]" = {
    "redis": _single, "rediss": _single, "unix": _single, "redis+socket": _single,
    "sentinel": _sentinel,
    "redis+cluster": _cluster, "rediss+cluster": _cluster,
}

#: URL schemes ``leases_redis_url`` accepts.
SCHEMES = tuple(_FACTORIES)


def scheme(url: str) -> str:
    """The scheme of ``url`` (of its first part, for ``;``-separated Sentinel lists)."""
    return urlsplit(str(url).split(";")[0].strip()).scheme


def connect(url: str, *, transport_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """A redis-py client (``Redis`` or ``RedisCluster``) for ``url``.

    ``kwargs`` (socket timeouts, health checks) go to every connection the
    client makes; ``transport_options`` are the kombu-style options a URL
    alone cannot carry (Sentinel's ``master_name``, ``sentinel_kwargs``).
    """
    factory = _FACTORIES.get(scheme(url))
    if factory is None:
        raise ConfigurationError(
            f"leases_redis_url must be a Redis URL ({', '.join(s + '://' for s in SCHEMES)}), "
            f"got {redact(url)!r}")
    return factory(url, transport_options or {}, dict(kwargs))


def redact(url: Any) -> str:
    """``url`` with every password replaced by ``***`` (each part of a ``;`` list)."""
    if not url:
        return repr(url)
    parts = []
    for part in str(url).split(";"):
        try:
            split = urlsplit(part.strip())
            password = split.password
        except ValueError:
            parts.append("<unparseable URL>")
            continue
        if password:
            userinfo, _, hostinfo = split.netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            split = split._replace(netloc=f"{user}:***@{hostinfo}")
        parts.append(split.geturl())
    return ";".join(parts)


def describe(client: Any) -> str:
    """Where ``client`` connects (host:port/db), never its password."""
    pool = getattr(client, "connection_pool", None)
    kw = getattr(pool, "connection_kwargs", None) or {}
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
