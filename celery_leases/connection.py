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
from urllib.parse import parse_qs, unquote, urlsplit

import redis

from .exceptions import ConfigurationError, LeaseUnavailable

__all__ = ["connect", "redact", "describe", "SCHEMES"]


def _single(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    return redis.Redis.from_url(url, **kwargs)


def _sentinel(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    raise ConfigurationError(f"leases_redis_url {redact(url)}: Sentinel URLs are not supported yet")


#: Query options of a cluster URL, passed to every node connection (TLS files and checks).
_CLUSTER_QUERY_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
                          "ssl_check_hostname")


def _cluster(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    """A RedisCluster for ``redis+cluster://[user:password@]host:port[,host:port...][/]``.

    The listed nodes are only where discovery starts (CLUSTER SLOTS): one live
    node is enough (the client connects at once, and raises LeaseUnavailable
    when none answers). ``rediss+cluster://`` connects with TLS. A cluster has no
    databases, so a path other than ``/`` or ``/0`` is an error; the
    kombu-style ``transport_options`` are not used.
    """
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException

    nodes, username, password, query = _parse_cluster_url(url)
    for name, values in query.items():
        if name not in _CLUSTER_QUERY_OPTIONS:
            raise ConfigurationError(
                f"leases_redis_url {redact(url)}: unknown option {name!r} for a Redis Cluster URL "
                f"(known: {', '.join(_CLUSTER_QUERY_OPTIONS)})")
        value: Any = values[-1]
        if name == "ssl_check_hostname":
            value = value.lower() in ("1", "true", "yes", "on")
        kwargs.setdefault(name, value)
    if scheme(url) == "rediss+cluster":
        kwargs["ssl"] = True
    if username:
        kwargs["username"] = username
    if password:
        kwargs["password"] = password
    try:
        # Unlike Redis(), RedisCluster connects at once: it reads the slot map.
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes], **kwargs)
    except (redis.RedisError, RedisClusterException) as exc:
        raise LeaseUnavailable(f"leases_redis_url {redact(url)}: no node of the Redis Cluster "
                               f"gave its slot map: {exc}") from exc


def _parse_cluster_url(url: str) -> "tuple[list[tuple[str, int]], str | None, str | None, dict]":
    """(startup nodes, username, password, query) of a cluster URL; errors name the URL redacted."""
    def bad(why: str) -> ConfigurationError:
        return ConfigurationError(f"leases_redis_url {redact(url)}: {why}; expected "
                                  f"redis+cluster://[user:password@]host:port[,host:port...]")

    rest = str(url).split("://", 1)[1]
    rest, _, query_text = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise bad(f"a Redis Cluster has only database 0, got /{path}")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for part in hostlist.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [IPv6]:port
            host, _, port_text = part[1:].partition("]")
            port_text = port_text.lstrip(":")
        else:
            host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            port = int(port_text) if port_text else 6379
        except ValueError:
            raise bad(f"port {port_text!r} of node {host!r} is not a number") from None
        if not host or not 0 < port < 65536:
            raise bad(f"node {part!r} is not host:port")
        nodes.append((host, port))
    if not nodes:
        raise bad("no node given")
    return nodes, username, password, parse_qs(query_text)


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
    manager = getattr(client, "nodes_manager", None)
    if manager is not None:  # a RedisCluster: the nodes it knows (all, once discovered)
        names = sorted(n.name for n in manager.startup_nodes.values())
        shown = ",".join(names[:3]) + (f",+{len(names) - 3} more" if len(names) > 3 else "")
        ssl = manager.connection_kwargs.get("ssl") if hasattr(manager, "connection_kwargs") else False
        return f"{'rediss' if ssl else 'redis'}+cluster://{shown}"
    pool = getattr(client, "connection_pool", None)
    kw = getattr(pool, "connection_kwargs", None) or {}
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
