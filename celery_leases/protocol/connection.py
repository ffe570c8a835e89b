"""Redis clients for the lease store, built from ``leases_redis_url``.

One place decides what a URL means, so the worker, the CLI, the startup
checks and ``LeaseStore.from_url`` all connect the same way:

- ``redis://``, ``rediss://`` (TLS), ``unix://`` (``redis+socket://``, kombu's
  name for it): one server (redis-py's own URL parsing: ACL user and password,
  ``db``, ``ssl_*`` query options);
- ``sentinel://``: the master a set of Sentinels names (see ``_sentinel``);
- ``redis+cluster://``, ``rediss+cluster://``: a Redis Cluster (see ``_cluster``).

``redact`` is the only way a URL reaches a log line, an error or CLI output.
Knows nothing of Celery.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs, unquote, urlsplit

import redis

from ..exceptions import ConfigurationError, LeaseUnavailable

__all__ = ["connect", "redact", "describe", "SCHEMES"]


def _single(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    if scheme(url) == "redis+socket":  # kombu's name for a Unix socket; redis-py knows unix://
        url = "unix://" + url.split("://", 1)[1]
    return redis.Redis.from_url(url, **kwargs)


#: Sentinel's port when a ``sentinel://`` part names none.
SENTINEL_PORT = 26379


def url_error(url: str, exc: Exception) -> str:
    """Why ``url`` does not parse, without echoing a parser message that may quote a piece
    of a password (an unencoded "/" in a password turns its tail into the "port")."""
    if redact(url) != str(url).strip():
        return ("is not a valid URL (check the port and query options, and that special "
                "characters in the password are %-encoded)")
    return f"is not a valid URL: {exc}"


def sentinel_params(url: str, options: Any,
                    setting: str = "leases_redis_transport_options") -> dict[str, Any]:
    """Check and take apart a Sentinel URL and its transport options; connects to nothing.

    ``sentinel://[user:password@]host:port[/db][?options];sentinel://host2:port2;...``
    as kombu reads it: every part names one Sentinel; the first part carries
    the data node's credentials, db and redis-py query options. The master
    name and Sentinel's own connection options (``sentinel_kwargs``: its
    password, TLS) come from the transport options, since a URL cannot hold
    them. Errors name ``setting`` (the dict the options came from).
    """
    sentinels: list[tuple[str, int]] = []
    node: dict[str, Any] | None = None
    for number, part in enumerate((p.strip() for p in str(url).split(";")), 1):
        if not part:
            continue
        where = f"leases_redis_url {redact(url)}, part {number}"
        try:
            split = urlsplit(part)
            host, port = split.hostname, split.port or SENTINEL_PORT
            # redis-py's own parser reads the credentials, db and query options.
            params = redis.connection.parse_url("redis://" + part.split("://", 1)[-1])
        except ValueError as exc:
            raise ConfigurationError(f"{where} {url_error(part, exc)}") from None
        if split.scheme != "sentinel" or not host:
            raise ConfigurationError(
                f"{where}: every part of a Sentinel URL must be sentinel://host:port "
                f"(parts separated by ';')")
        sentinels.append((host, port))
        params.pop("host", None)
        params.pop("port", None)
        if node is None:
            node = params
        elif params and params != node:
            raise ConfigurationError(
                f"{where}: only the first sentinel:// part sets the password, db and options "
                f"(as kombu reads it); this part sets different ones")
    if not sentinels or node is None:
        raise ConfigurationError(f"leases_redis_url {redact(url)} names no Sentinel")

    if not isinstance(options, Mapping):
        raise ConfigurationError(f"{setting} must be a dict, got {type(options).__name__}")
    master = options.get("master_name")
    if not isinstance(master, str) or not master:
        raise ConfigurationError(
            f"{setting} has no master_name (got {master!r}): leases_redis_url is a Sentinel URL, "
            f"so set {setting} = {{'master_name': NAME}}, NAME as in the Sentinels' "
            f"'sentinel monitor NAME ...' line")
    sentinel_kwargs = options.get("sentinel_kwargs")
    if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
        raise ConfigurationError(
            f"{setting}['sentinel_kwargs'] must be a dict of connection options for the "
            f"Sentinels (password, ssl, ...), got {type(sentinel_kwargs).__name__}")
    min_others = options.get("min_other_sentinels", 0)
    if not isinstance(min_others, int) or isinstance(min_others, bool) or min_others < 0:
        raise ConfigurationError(
            f"{setting}['min_other_sentinels'] must be a non-negative integer, got {min_others!r}")
    return {"sentinels": sentinels, "master_name": master, "node": node,
            "sentinel_kwargs": dict(sentinel_kwargs or {}), "min_other_sentinels": min_others}


def _sentinel(url: str, options: Mapping[str, Any], kwargs: dict) -> Any:
    """The current master of ``master_name``: the client asks the Sentinels again after a
    connection error or a READONLY reply, so it follows a failover."""
    from redis.sentinel import Sentinel

    params = sentinel_params(url, options)
    # Timeouts reach the Sentinels too, so a dead Sentinel cannot hang a
    # discovery; the user's sentinel_kwargs win.
    sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    sentinel_kwargs.update(params["sentinel_kwargs"])
    manager = Sentinel(params["sentinels"], min_other_sentinels=params["min_other_sentinels"],
                       sentinel_kwargs=sentinel_kwargs, **{**kwargs, **params["node"]})
    return manager.master_for(params["master_name"])


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


#: scheme://user:password@rest, the password up to the LAST "@" of the part: a password
#: with an unencoded "/", "?" or "#" (which urlsplit would cut short) is still hidden whole.
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*):(?P<password>.*)@(?P<rest>[^@]*)$",
                       re.DOTALL)


def redact(url: Any) -> str:
    """``url`` with every password replaced by ``***`` (each part of a ``;`` list).

    Errs on the side of hiding: anything between ``user:`` and the last ``@``
    of a part is taken for a password.
    """
    if not url:
        return repr(url)
    parts = []
    for part in str(url).split(";"):
        match = _USERINFO.match(part.strip())
        if match and match["password"]:
            part = f"{match['head']}:***@{match['rest']}"
        parts.append(part.strip())
    return ";".join(parts)


def describe(client: Any) -> str:
    """Where ``client`` connects (scheme, user, host:port/db), never its password."""
    nodes = getattr(client, "nodes_manager", None)
    if nodes is not None:  # a RedisCluster: the nodes it knows (all, once discovered)
        names = sorted(n.name for n in nodes.startup_nodes.values())
        shown = ",".join(names[:3]) + (f",+{len(names) - 3} more" if len(names) > 3 else "")
        ssl = nodes.connection_kwargs.get("ssl") if hasattr(nodes, "connection_kwargs") else False
        return f"{'rediss' if ssl else 'redis'}+cluster://{shown}"
    pool = getattr(client, "connection_pool", None)
    kw = getattr(pool, "connection_kwargs", None) or {}
    if "path" in kw:
        return f"unix://{kw['path']}"
    db = kw.get("db", 0)
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None:
        via = ", ".join("{host}:{port}".format_map(s.connection_pool.connection_kwargs)
                        for s in manager.sentinels)
        return f"Sentinel master {getattr(pool, 'service_name', '?')}/{db} (via {via})"
    connection_class = getattr(pool, "connection_class", None)
    tls = isinstance(connection_class, type) and issubclass(connection_class, redis.SSLConnection)
    user = f"{kw['username']}@" if kw.get("username") else ""
    return f"{'rediss' if tls else 'redis'}://{user}{kw.get('host', '?')}:{kw.get('port', '?')}/{db}"
