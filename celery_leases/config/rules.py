"""The rule of every ``leases_*`` setting and task option, and who uses it (``SETTINGS``).

Each rule takes a value and returns it normalised, or raises ``_Invalid`` whose
message states the rule; ``celery_leases.config`` applies them and names the setting.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

from .. import defaults


#: Per-task overrides: task attribute name -> LeaseConfig field.
TASK_OPTIONS = {
    "lease_ttl": "ttl",
    "lease_heartbeat_interval": "heartbeat_interval",
    "lease_max_recoveries": "max_recoveries",
    "lease_progress_timeout": "progress_timeout",
    "lease_on_lost": "on_lost",
}


class _Invalid(Exception):
    """A value breaks its rule; the message is the rule ("must be ...")."""


# -- rules: each takes a value and returns it normalised, or raises _Invalid naming the rule.
# ``strict`` is for task options (Python code): no strings standing in for numbers.


def _seconds(value: Any, strict: bool = False) -> float:
    rule = "must be a positive number of seconds"
    if isinstance(value, bool) or (strict and not isinstance(value, (int, float))):
        raise _Invalid(rule)
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise _Invalid(rule) from None
    if not math.isfinite(result) or result <= 0:
        raise _Invalid(rule)
    return result


def _optional_seconds(value: Any, strict: bool = False) -> float | None:
    if value is None:
        return None
    try:
        return _seconds(value, strict)
    except _Invalid:
        raise _Invalid("must be None (off) or a positive number of seconds") from None


def _delivery_timeout(value: Any, strict: bool = False) -> float | None:
    # None and 0 turn publish tracking off.
    if value is None or (not isinstance(value, bool) and value in (0, "0")):
        return None
    try:
        return _seconds(value, strict)
    except _Invalid:
        raise _Invalid("must be None or 0 (off) or a positive number of seconds") from None


def _integer(minimum: int) -> Callable[[Any, bool], int]:
    rule = "must be a non-negative integer" if minimum == 0 else f"must be an integer >= {minimum}"

    def check(value: Any, strict: bool = False) -> int:
        if isinstance(value, bool) or not isinstance(value, int if strict else (int, str)):
            raise _Invalid(rule)
        try:
            result = int(value)
        except ValueError:
            raise _Invalid(rule) from None
        if result < minimum:
            raise _Invalid(rule)
        return result
    return check


def _on_lost(value: Any, strict: bool = False) -> str:
    if value not in ("flag", "terminate"):
        raise _Invalid("must be 'flag' or 'terminate'")
    return value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _boolean(value: Any, strict: bool = False) -> bool:
    if isinstance(value, bool):
        return value
    if not strict and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise _Invalid("must be a boolean")


def _key_prefix(value: Any, strict: bool = False) -> str:
    # Braces would end the hash tag every key is built in (Redis Cluster slots);
    # whitespace breaks the CLI's and operators' key patterns.
    if (not isinstance(value, str) or not value
            or any(c.isspace() or c in "{}" or not c.isprintable() for c in value)):
        raise _Invalid("must be a non-empty string without whitespace, braces or control characters")
    return value


def _queue_name(value: Any, strict: bool = False) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise _Invalid("must be None (off) or a queue name: a non-empty string without "
                       "leading or trailing whitespace")
    return value


def _port(value: Any, strict: bool = False) -> int | None:
    if value is None:
        return None
    rule = "must be None (off) or a TCP port: an integer from 1 to 65535"
    if isinstance(value, bool) or not isinstance(value, int if strict else (int, str)):
        raise _Invalid(rule)
    try:
        result = int(value)
    except ValueError:
        raise _Invalid(rule) from None
    if not 1 <= result <= 65535:
        raise _Invalid(rule)
    return result


def _host(value: Any, strict: bool = False) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() or not c.isprintable() for c in value):
        raise _Invalid("must be an address to bind to: a non-empty string without whitespace "
                       "(\"0.0.0.0\", \"127.0.0.1\", \"::\", a host name)")
    return value


def _optional_path(value: Any, strict: bool = False) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise _Invalid("must be None (off) or a file path: a non-empty string")
    return value


def _outbox_url(value: Any, strict: bool = False) -> str | None:
    if value is None:
        return None
    scheme = value.split(":", 1)[0].split("+", 1)[0].lower() if isinstance(value, str) and ":" in value else ""
    if scheme not in ("postgresql", "postgres", "sqlite", "mysql", "mariadb"):
        raise _Invalid("must be None (off) or the outbox's database: a postgresql://, sqlite:/// "
                       "or mysql:// URL")
    return value


def _table_name(value: Any, strict: bool = False) -> str:
    parts = value.split(".") if isinstance(value, str) else []
    if not 1 <= len(parts) <= 2 or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,55}", p) for p in parts):
        raise _Invalid("must be a table name, 'name' or 'schema.name', each a letter or underscore "
                       "then letters, digits or underscores (at most 56 characters)")
    return value


_CLIENT, _WORKER = "client", "worker"

#: Every ``leases_*`` setting (without the prefix): its rule, and who uses it.
#: "client" settings are what any process that talks to the lease store needs
#: (publishers, the CLI, ``store(app)``): an error in one fails at ``install()``.
#: "worker" settings are used only by workers (and beat): an error in one stops
#: the worker at start, never ``import proj`` in a process that only publishes.
#: ``redis_url`` and ``redis_transport_options`` (client) are checked together below.
SETTINGS: dict[str, tuple[Callable[..., Any] | None, str]] = {
    "redis_url": (None, _CLIENT),
    "redis_transport_options": (None, _CLIENT),
    "key_prefix": (_key_prefix, _CLIENT),
    "shards": (_integer(1), _CLIENT),
    "retention": (_seconds, _CLIENT),
    "publish_grace": (_seconds, _CLIENT),
    "recover_batch": (_integer(1), _CLIENT),
    "max_recoveries": (_integer(0), _CLIENT),
    "dead_letter_queue": (_queue_name, _CLIENT),
    "delivery_timeout": (_delivery_timeout, _CLIENT),
    "ttl": (_seconds, _WORKER),
    "heartbeat_interval": (_seconds, _WORKER),
    "recovery_interval": (_seconds, _WORKER),
    "progress_timeout": (_optional_seconds, _WORKER),
    "on_lost": (_on_lost, _WORKER),
    "unavailable_retry_delay": (_seconds, _WORKER),
    "unavailable_retry_max_delay": (_seconds, _WORKER),
    "deliveries_per_minute": (_integer(1), _WORKER),
    "worker_recovery": (_boolean, _WORKER),
    "held_deliveries": (_boolean, _WORKER),
    "background_finishes": (_boolean, _WORKER),
    "beat_schedule": (_boolean, _WORKER),
    "http_port": (_port, _WORKER),
    "http_host": (_host, _WORKER),
    "health_file": (_optional_path, _WORKER),
    "outbox_url": (_outbox_url, _WORKER),
    "outbox_table": (_table_name, _CLIENT),
    "outbox_poll_interval": (_seconds, _WORKER),
}

#: Settings whose value None, written explicitly, turns the feature off (unset: the default).
_NONE_IS_OFF = frozenset({"delivery_timeout"})

#: Defaults of the settings that have one in defaults.py (heartbeat_interval: ttl / 3).
_DEFAULTS = {
    "key_prefix": defaults.KEY_PREFIX, "shards": defaults.SHARDS, "retention": defaults.RETENTION,
    "publish_grace": defaults.PUBLISH_GRACE, "recover_batch": defaults.RECOVER_BATCH,
    "max_recoveries": defaults.MAX_RECOVERIES, "dead_letter_queue": defaults.DEAD_LETTER_QUEUE,
    "delivery_timeout": defaults.DELIVERY_TIMEOUT,
    "ttl": defaults.TTL, "heartbeat_interval": defaults.HEARTBEAT_INTERVAL,
    "recovery_interval": defaults.RECOVERY_INTERVAL, "progress_timeout": defaults.PROGRESS_TIMEOUT,
    "on_lost": defaults.ON_LOST, "unavailable_retry_delay": defaults.UNAVAILABLE_RETRY_DELAY,
    "unavailable_retry_max_delay": defaults.UNAVAILABLE_RETRY_MAX_DELAY,
    "deliveries_per_minute": defaults.DELIVERIES_PER_MINUTE,
    "worker_recovery": defaults.WORKER_RECOVERY, "beat_schedule": defaults.BEAT_SCHEDULE,
    "held_deliveries": defaults.HELD_DELIVERIES, "background_finishes": defaults.BACKGROUND_FINISHES,
    "http_port": defaults.HTTP_PORT, "http_host": defaults.HTTP_HOST, "health_file": defaults.HEALTH_FILE,
    "outbox_url": defaults.OUTBOX_URL, "outbox_table": defaults.OUTBOX_TABLE,
    "outbox_poll_interval": defaults.OUTBOX_POLL_INTERVAL,
}
