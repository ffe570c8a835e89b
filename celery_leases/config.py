"""Settings, read once per app into one LeaseConfig.

Precedence: task attribute or ``@app.task(lease_ttl=...)`` option > ``app.conf``
``leases_*`` > default (``defaults.py``). ``app.conf`` lookups honour a
``config_from_object(..., namespace="CELERY")`` namespace, so Django projects
write ``CELERY_LEASES_TTL``.
"""
from __future__ import annotations

import re
import weakref
import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Mapping

from . import defaults
from .connection import SCHEMES as _SCHEMES
from .connection import redact as _redact
from .connection import scheme as _scheme
from .connection import sentinel_params as _sentinel_params
from .exceptions import ConfigurationError


#: Per-task overrides: task attribute name -> LeaseConfig field.
TASK_OPTIONS = {
    "lease_ttl": "ttl",
    "lease_heartbeat_interval": "heartbeat_interval",
    "lease_max_recoveries": "max_recoveries",
    "lease_progress_timeout": "progress_timeout",
    "lease_on_lost": "on_lost",
}


@dataclass(frozen=True)
class LeaseConfig:
    # Not in repr: URLs and options can hold passwords (connection.redact is the way out).
    redis_url: str = dataclasses.field(repr=False)
    key_prefix: str = defaults.KEY_PREFIX
    ttl: float = defaults.TTL
    heartbeat_interval: float = defaults.TTL / 3
    recovery_interval: float = defaults.RECOVERY_INTERVAL
    max_recoveries: int = defaults.MAX_RECOVERIES
    progress_timeout: float | None = defaults.PROGRESS_TIMEOUT
    retention: float = defaults.RETENTION
    publish_grace: float = defaults.PUBLISH_GRACE
    recover_batch: int = defaults.RECOVER_BATCH
    shards: int = defaults.SHARDS
    on_lost: str = defaults.ON_LOST
    dead_letter_queue: str | None = defaults.DEAD_LETTER_QUEUE
    unavailable_retry_delay: float = defaults.UNAVAILABLE_RETRY_DELAY
    worker_recovery: bool = defaults.WORKER_RECOVERY
    #: None: add the beat entry only when worker_recovery is off (install.beat_entry_wanted).
    beat_schedule: bool | None = defaults.BEAT_SCHEDULE
    #: kombu-style options for redis_url (Sentinel's master_name, sentinel_kwargs).
    redis_transport_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    #: The setting redis_transport_options came from, for error messages.
    transport_options_setting: str = dataclasses.field(default="leases_redis_transport_options", repr=False)

    def validate(self, where: str = "leases_") -> "LeaseConfig":
        """Raise ConfigurationError naming the first invalid setting."""
        def name(field: str) -> str:
            return f"{where}{field}"

        for field in ("ttl", "heartbeat_interval", "recovery_interval", "retention",
                      "publish_grace", "unavailable_retry_delay"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"{name(field)} must be a positive number of seconds, got {value!r}")
        if self.heartbeat_interval >= self.ttl:
            raise ConfigurationError(
                f"{name('heartbeat_interval')} ({self.heartbeat_interval}) must be below "
                f"{name('ttl')} ({self.ttl}); ttl / 3 is a safe choice")
        if self.progress_timeout is not None and (
                not isinstance(self.progress_timeout, (int, float)) or self.progress_timeout <= 0):
            raise ConfigurationError(
                f"{name('progress_timeout')} must be None or a positive number of seconds, "
                f"got {self.progress_timeout!r}")
        for field in ("max_recoveries", "recover_batch"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if field == "max_recoveries" else 1):
                raise ConfigurationError(f"{name(field)} must be a non-negative integer, got {value!r}")
        if not isinstance(self.shards, int) or isinstance(self.shards, bool) or self.shards < 1:
            raise ConfigurationError(f"{name('shards')} must be an integer >= 1, got {self.shards!r}")
        if self.on_lost not in ("flag", "terminate"):
            raise ConfigurationError(f"{name('on_lost')} must be 'flag' or 'terminate', got {self.on_lost!r}")
        scheme = _scheme(self.redis_url or "")
        if scheme not in _SCHEMES:
            raise ConfigurationError(
                f"leases_redis_url must be a Redis URL ({', '.join(s + '://' for s in _SCHEMES)}), "
                f"got {_redact(self.redis_url)!r}")
        options, source = self.redis_transport_options, self.transport_options_setting
        if not isinstance(options, Mapping):
            raise ConfigurationError(f"{source} must be a dict, got {type(options).__name__}")
        if scheme == "sentinel":
            try:
                _sentinel_params(self.redis_url, options, source)
            except ConfigurationError as exc:
                if source == "leases_redis_transport_options":
                    raise
                raise ConfigurationError(
                    f"{exc} ({source} applies because leases_redis_url is the "
                    f"{source.replace('_transport_options', '')} URL; set "
                    f"leases_redis_transport_options to give the lease store its own)") from None
        return self

    def for_task(self, task: Any) -> "LeaseConfig":
        """This config with the task's ``lease_*`` overrides applied (validated)."""
        changes = {}
        for attr, field in TASK_OPTIONS.items():
            value = getattr(task, attr, None)
            if value is not None:
                changes[field] = value
        if not changes:
            return self
        if "ttl" in changes and "heartbeat_interval" not in changes:
            changes["heartbeat_interval"] = min(self.heartbeat_interval, changes["ttl"] / 3)
        try:
            return replace(self, **changes).validate(where=f"task {task.name}: lease_")
        except ConfigurationError:
            raise


_configs: "weakref.WeakKeyDictionary[Any, LeaseConfig]" = weakref.WeakKeyDictionary()


def get_config(app: Any, **overrides: Any) -> LeaseConfig:
    """The app's LeaseConfig, built and validated on first use."""
    config = _configs.get(app)
    if config is None or overrides:
        config = _configs[app] = build_config(app, **overrides)
    return config


def build_config(app: Any, **overrides: Any) -> LeaseConfig:
    try:
        return _build_config(app, **overrides)
    except ConfigurationError as exc:
        namespace = getattr(app, "namespace", None)
        if not namespace:
            raise
        # Name the setting as the user wrote it (Django: CELERY_LEASES_TTL).
        message = re.sub(r"\bleases_(\w+)",
                         lambda m: f"{namespace.upper()}_LEASES_{m.group(1).upper()}", str(exc))
        raise ConfigurationError(message) from None


def _build_config(app: Any, **overrides: Any) -> LeaseConfig:
    conf = app.conf

    def setting(field: str, default: Any) -> Any:
        if field in overrides:
            return overrides[field]
        value = conf.get(f"leases_{field}")
        return default if value is None else value

    ttl = _number(setting("ttl", defaults.TTL), "leases_ttl")
    interval = setting("heartbeat_interval", None)
    redis_url = setting("redis_url", None) or _fallback_url(conf)
    options, source = _transport_options(conf, redis_url, setting("redis_transport_options", None))
    config = LeaseConfig(
        redis_url=redis_url,
        redis_transport_options=options,
        transport_options_setting=source,
        key_prefix=setting("key_prefix", defaults.KEY_PREFIX),
        ttl=ttl,
        heartbeat_interval=(_number(interval, "leases_heartbeat_interval")
                            if interval is not None else ttl / 3),
        recovery_interval=_number(setting("recovery_interval", defaults.RECOVERY_INTERVAL),
                                  "leases_recovery_interval"),
        max_recoveries=_integer(setting("max_recoveries", defaults.MAX_RECOVERIES),
                                "leases_max_recoveries"),
        progress_timeout=(None if setting("progress_timeout", None) is None else
                          _number(setting("progress_timeout", None), "leases_progress_timeout")),
        retention=_number(setting("retention", defaults.RETENTION), "leases_retention"),
        publish_grace=_number(setting("publish_grace", defaults.PUBLISH_GRACE), "leases_publish_grace"),
        recover_batch=_integer(setting("recover_batch", defaults.RECOVER_BATCH), "leases_recover_batch"),
        shards=_shards(setting("shards", defaults.SHARDS)),
        on_lost=setting("on_lost", defaults.ON_LOST),
        dead_letter_queue=setting("dead_letter_queue", defaults.DEAD_LETTER_QUEUE),
        unavailable_retry_delay=_number(setting("unavailable_retry_delay", defaults.UNAVAILABLE_RETRY_DELAY),
                                        "leases_unavailable_retry_delay"),
        worker_recovery=_boolean(setting("worker_recovery", defaults.WORKER_RECOVERY), "leases_worker_recovery"),
        beat_schedule=_optional_boolean(setting("beat_schedule", defaults.BEAT_SCHEDULE),
                                        "leases_beat_schedule"),
    )
    return config.validate()


class _Pending(dict):
    """The settings an unconfigured app already has (Celery(...) arguments, conf.update())."""


def validate_pending(app: Any) -> None:
    """Validate the leases settings known before the app reads its configuration.

    Reading ``app.conf`` now would load the configuration too early (before a
    later ``config_from_object``), so only what is already set is checked; a
    missing Redis URL is left to the worker's start-up check.
    """
    pending = _Pending(getattr(app, "_preconf", None) or {})
    if not any(key.startswith("leases_") for key in pending):
        return
    if not pending.get("leases_redis_url"):
        try:
            _fallback_url(pending)
        except ConfigurationError:
            pending["leases_redis_url"] = "redis://unset"
    url = pending.get("leases_redis_url") or _fallback_url(pending)
    if _scheme(url) == "sentinel" and _transport_options(
            pending, url, pending.get("leases_redis_transport_options"))[0] == {}:
        # The master name may come with a later config_from_object; the worker checks it.
        pending["leases_redis_transport_options"] = {"master_name": "unset"}
    build_config(_AppLike(pending))


class _AppLike:
    def __init__(self, conf: dict) -> None:
        self.conf = conf


def _fallback_url(conf: Any) -> str:
    """A Redis broker or result backend URL, when leases_redis_url is not set."""
    for name in ("broker_url", "result_backend"):
        url = conf.get(name)
        if isinstance(url, str) and _scheme(url) in _SCHEMES:
            return url
    raise ConfigurationError(
        "leases_redis_url is not set and neither broker_url nor result_backend is a Redis URL; "
        "set leases_redis_url (CELERY_LEASES_REDIS_URL under Django)")


#: Celery settings whose transport options go with the URL of the same prefix.
_TRANSPORT_OPTIONS = {"broker_url": "broker_transport_options",
                      "result_backend": "result_backend_transport_options"}


def _transport_options(conf: Any, url: str, explicit: Any) -> tuple[Any, str]:
    """The transport options of the lease store's URL, and the setting they came from.

    ``leases_redis_transport_options`` when set; otherwise, when the lease store
    uses the broker's (or result backend's) URL, that URL's own transport
    options, so a Sentinel broker's ``master_name`` serves the leases too.
    """
    if explicit is not None:
        return explicit, "leases_redis_transport_options"
    for url_setting, options_setting in _TRANSPORT_OPTIONS.items():
        if conf.get(url_setting) == url:
            return conf.get(options_setting) or {}, options_setting
    return {}, "leases_redis_transport_options"


def _number(value: Any, name: str) -> float:
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}") from None
    if result <= 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    return result


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigurationError(f"{name} must be an integer, got {value!r}")
    try:
        result = int(value)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer, got {value!r}") from None
    if result < 0:
        raise ConfigurationError(f"{name} must not be negative, got {value!r}")
    return result


def _shards(value: Any) -> int:
    result = _integer(value, "leases_shards")
    if result < 1:
        raise ConfigurationError(f"leases_shards must be an integer >= 1, got {value!r}")
    return result


def _boolean(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigurationError(f"{name} must be a boolean, got {value!r}")


def _optional_boolean(value: Any, name: str) -> bool | None:
    return None if value is None else _boolean(value, name)
