"""Settings, read once per app into one LeaseConfig.

Precedence: task attribute or ``@app.task(lease_ttl=...)`` option > ``app.conf``
``leases_*`` > default (``defaults.py``). ``app.conf`` lookups honour a
``config_from_object(..., namespace="CELERY")`` namespace, so Django projects
write ``CELERY_LEASES_TTL``.

Validation is split by who uses a setting (``SETTINGS``): an error in one a
publisher uses raises at once; an error in a worker-only one is kept in
``LeaseConfig.worker_errors`` and raised by ``get_config`` / at worker start,
so a process that only publishes never fails on it. Every rule's message
states the rule, and every error names the setting (or task and option) and
the value.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import weakref
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .. import defaults
from ..protocol.connection import SCHEMES as _SCHEMES
from ..protocol.connection import scheme as _scheme
from ..protocol.connection import sentinel_params as _sentinel_params
from ..exceptions import ConfigurationError
from .rules import _CLIENT, _DEFAULTS, _NONE_IS_OFF, _WORKER, SETTINGS, TASK_OPTIONS, _Invalid
from .urls import redis_url_error


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
    #: Publish tracking (publishing/tracking.py): seconds a published task may wait undelivered; None: off.
    delivery_timeout: float | None = defaults.DELIVERY_TIMEOUT
    unavailable_retry_delay: float = defaults.UNAVAILABLE_RETRY_DELAY
    unavailable_retry_max_delay: float = defaults.UNAVAILABLE_RETRY_MAX_DELAY
    deliveries_per_minute: int = defaults.DELIVERIES_PER_MINUTE
    worker_recovery: bool = defaults.WORKER_RECOVERY
    #: Redis broker, tracking on: deliveries of recorded tasks held by their lease, not kombu's hash.
    held_deliveries: bool = defaults.HELD_DELIVERIES
    #: Threads: finishes nobody waits for sent in the background (worker/background.py).
    background_finishes: bool = defaults.BACKGROUND_FINISHES
    #: None: add the beat entry only when worker_recovery is off (recovery/beat.py, beat_entry_wanted).
    beat_schedule: bool | None = defaults.BEAT_SCHEDULE
    #: The worker's HTTP endpoint (worker/health.py): its port (None: off) and bind address.
    http_port: int | None = defaults.HTTP_PORT
    http_host: str = defaults.HTTP_HOST
    #: A file the worker touches every second while it is live (exec probes); None: off.
    health_file: str | None = defaults.HEALTH_FILE
    #: The outbox (celery_leases/outbox/): the database the workers relay (None: none), the
    #: table ``send`` writes to, and the relay's poll interval.
    outbox_url: str | None = dataclasses.field(default=defaults.OUTBOX_URL, repr=False)
    outbox_table: str = defaults.OUTBOX_TABLE
    outbox_poll_interval: float = defaults.OUTBOX_POLL_INTERVAL
    #: kombu-style options for redis_url (Sentinel's master_name, sentinel_kwargs).
    redis_transport_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    #: The setting redis_transport_options came from, for error messages.
    transport_options_setting: str = dataclasses.field(default="leases_redis_transport_options", repr=False)
    #: Errors of worker-only settings (their fields hold the defaults meanwhile):
    #: a publisher never sees them, ``check_worker()`` raises them.
    worker_errors: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def check_worker(self) -> "LeaseConfig":
        """Raise ConfigurationError naming every invalid worker-only setting."""
        if self.worker_errors:
            raise _error(self.worker_errors)
        return self

    def for_task(self, task: Any) -> "LeaseConfig":
        """This config with the task's ``lease_*`` overrides applied (validated)."""
        errors, config = task_option_errors(task, self)
        if errors or config is None:  # with a config given, none comes back only with errors
            raise _error(errors)
        return config


def _joined(errors: "list[str] | tuple[str, ...]") -> str:
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} problems: " + "; ".join(errors)


def _error(errors: "list[str] | tuple[str, ...]") -> ConfigurationError:
    """One ConfigurationError for all ``errors``; ``.problems`` keeps them apart."""
    exc = ConfigurationError(_joined(errors))
    exc.problems = tuple(errors)  # type: ignore[attr-defined]
    return exc


def _task_option_names(task: Any) -> list[str]:
    cls = task if isinstance(task, type) else type(task)
    return sorted(name for name in dir(cls) if name.startswith("lease_"))


def task_option_errors(task: Any, config: "LeaseConfig | None") -> "tuple[list[str], LeaseConfig | None]":
    """Problems of one task's ``lease_*`` options, and the task's config (``config`` with them applied).

    Each problem names the task, the option and the value. Without ``config``
    (the app's settings are not readable yet, or broken) only the options' own
    rules are checked, not how they combine with the app's ttl.
    """
    name = getattr(task, "name", None) or getattr(task, "__name__", "?")
    errors: list[str] = []
    changes: dict[str, Any] = {}
    leased = getattr(task, "leased", False)
    for attr in _task_option_names(task):
        value = getattr(task, attr, None)
        field = TASK_OPTIONS.get(attr)
        if field is None and not leased:
            continue  # a plain task's own attribute: only our option names are a slip there
        if field is None:
            close = difflib.get_close_matches(attr, TASK_OPTIONS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f" (known: {', '.join(TASK_OPTIONS)})"
            errors.append(f"task {name}: {attr}: unknown option{hint}")
            continue
        if value is None:
            continue
        if not leased:
            errors.append(f"task {name}: {attr}={value!r} is set but the task is not leased; "
                          f"use base=celery_leases.LeasedTask")
            continue
        rule = SETTINGS[field][0]
        assert rule is not None
        try:
            changes[field] = rule(value, True)
        except _Invalid as exc:
            errors.append(f"task {name}: {attr} {exc}, got {value!r}")
    if errors or config is None:
        return errors, None
    if not changes:
        return errors, config
    if "ttl" in changes and "heartbeat_interval" not in changes:
        changes["heartbeat_interval"] = min(config.heartbeat_interval, changes["ttl"] / 3)
    result = replace(config, **changes)
    if result.heartbeat_interval >= result.ttl:
        interval = ("lease_heartbeat_interval" if "heartbeat_interval" in changes
                    else "leases_heartbeat_interval")
        ttl = "lease_ttl" if "ttl" in changes else "leases_ttl"
        errors.append(f"task {name}: {interval} ({result.heartbeat_interval:g}) must be below "
                      f"{ttl} ({result.ttl:g}); ttl / 3 is a safe choice")
        return errors, None
    return errors, result


_configs: "weakref.WeakKeyDictionary[Any, LeaseConfig]" = weakref.WeakKeyDictionary()


def get_config(app: Any, **overrides: Any) -> LeaseConfig:
    """The app's LeaseConfig with every setting validated: what a worker needs.

    Raises ConfigurationError naming each invalid setting, the worker-only ones included.
    """
    return client_config(app, **overrides).check_worker()


def client_config(app: Any, **overrides: Any) -> LeaseConfig:
    """The app's LeaseConfig, built once; raises only for settings a publisher uses.

    Errors of worker-only settings are kept in ``worker_errors`` (those fields
    hold their defaults), so ``import proj`` never fails on them in a web tier.
    """
    config = _configs.get(app)
    if config is None or overrides:
        config = _configs[app] = build_config(app, **overrides)
    return config


def forget_config(app: Any) -> None:
    """Drop the app's built LeaseConfig: its settings changed (a second ``install(app, ...)``)."""
    _configs.pop(app, None)


def build_config(app: Any, **overrides: Any) -> LeaseConfig:
    """Build the config; client-side errors raise, worker-side ones are kept in ``worker_errors``."""
    namespace = getattr(app, "namespace", None)

    def as_written(message: str) -> str:
        if not namespace:
            return message
        # Name the setting as the user wrote it (Django: CELERY_LEASES_TTL).
        return re.sub(r"\bleases_(\w+)",
                      lambda m: f"{namespace.upper()}_LEASES_{m.group(1).upper()}", message)

    try:
        config = _build_config(app, **overrides)
    except ConfigurationError as exc:
        if not namespace:
            raise
        raise _error([as_written(e) for e in getattr(exc, "problems", (str(exc),))]) from None
    if namespace and config.worker_errors:
        config = replace(config, worker_errors=tuple(as_written(e) for e in config.worker_errors))
    return config


def _build_config(app: Any, **overrides: Any) -> LeaseConfig:
    conf = app.conf
    client_errors: list[str] = []
    worker_errors: list[str] = []

    def raw(field: str) -> Any:
        if field in overrides:
            return overrides[field]
        return conf.get(f"leases_{field}")

    values: dict[str, Any] = {}
    for field, (rule, side) in SETTINGS.items():
        if rule is None:
            continue
        value = raw(field)
        if value is None:
            # Unset: the default. Set to None: the default too, except where None means off.
            explicit = field in _NONE_IS_OFF and (field in overrides or f"leases_{field}" in conf)
            values[field] = None if explicit else _DEFAULTS[field]
            continue
        try:
            values[field] = rule(value)
        except _Invalid as exc:
            (client_errors if side == _CLIENT else worker_errors).append(
                f"leases_{field} {exc}, got {value!r}")
            values[field] = _DEFAULTS[field]
    if values["heartbeat_interval"] is None:
        values["heartbeat_interval"] = values["ttl"] / 3
    elif not worker_errors and values["heartbeat_interval"] >= values["ttl"]:
        worker_errors.append(
            f"leases_heartbeat_interval ({values['heartbeat_interval']:g}) must be below "
            f"leases_ttl ({values['ttl']:g}); ttl / 3 is a safe choice")
        values["heartbeat_interval"] = values["ttl"] / 3
    for message, side in _unknown_settings(conf, overrides):
        (client_errors if side == _CLIENT else worker_errors).append(message)
    redis_url = raw("redis_url") or _fallback_url(conf)
    options, source = _transport_options(conf, redis_url, raw("redis_transport_options"))
    client_errors += _store_errors(redis_url, options, source, _url_setting(conf, raw("redis_url"), redis_url))
    if client_errors:
        raise _error(client_errors)
    return LeaseConfig(redis_url=redis_url, redis_transport_options=options,
                       transport_options_setting=source, worker_errors=tuple(worker_errors), **values)


def _url_setting(conf: Any, explicit: Any, url: Any) -> str:
    """The setting the lease store's URL came from, as error messages name it."""
    fallback = next((n for n in ("broker_url", "result_backend") if conf.get(n) == url), None)
    if explicit or fallback is None:
        return "leases_redis_url"
    return f"{fallback} (the lease store's URL while leases_redis_url is not set)"


def _store_errors(url: Any, options: Any, source: str, setting: str = "leases_redis_url") -> list[str]:
    """The lease store's URL and transport options: a Redis URL (``urls.py``, the one rule),
    a dict, a complete Sentinel setup."""
    url_error = redis_url_error(url, setting)
    if url_error is not None:
        return [url_error]
    scheme = _scheme(url)
    if not isinstance(options, Mapping):
        return [f"{source} must be a dict, got {type(options).__name__}"]
    if scheme == "sentinel":
        try:
            _sentinel_params(url, options, source)
        except ConfigurationError as exc:
            if source == "leases_redis_transport_options":
                return [str(exc)]
            return [f"{exc} ({source} applies because leases_redis_url is the "
                    f"{source.replace('_transport_options', '')} URL; set "
                    f"leases_redis_transport_options to give the lease store its own)"]
    return []


def _unknown_settings(conf: Any, overrides: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Misspelt settings: ``leases_*`` keys that are no setting, and ``lease_<setting>``
    (a slip of ``leases_<setting>``), each with the closest known name. A slip counts on the side
    (client or worker) of the setting it most likely meant."""
    # LeaseConfig's fields too, so a setting added there is never refused as unknown.
    internal = {"transport_options_setting", "worker_errors"}
    known = sorted({f"leases_{field}" for field in SETTINGS}
                   | {f"leases_{f.name}" for f in dataclasses.fields(LeaseConfig) if f.name not in internal})
    try:
        keys = list(conf.keys())
    except Exception:  # noqa: BLE001 - a conf without keys() (a plain mapping stand-in)
        keys = []
    keys += [f"leases_{key}" for key in overrides]
    found = []
    for key in sorted(set(k for k in keys if isinstance(k, str))):
        lowered = _setting_name(key)
        if lowered is None or lowered in known:
            continue
        if not lowered.startswith("leases_") and "leases_" + lowered[len("lease_"):] not in known:
            continue  # lease_* is not our namespace: only the plain slip (lease_ttl) is flagged
        close = difflib.get_close_matches(lowered, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        side = SETTINGS.get(close[0][len("leases_"):], (None, _WORKER))[1] if close else _WORKER
        found.append((f"{key if key.isupper() else lowered}: unknown setting{hint}", side))
    return found


def _setting_name(key: str) -> str | None:
    """``key`` in lower case without a Django namespace (``CELERY_LEASES_TTL`` -> ``leases_ttl``)
    when it looks like a celery-leases setting (``leases_*``, or the slip ``lease_*``), else None."""
    lowered = key.lower()
    if lowered.startswith("celery_") and key.isupper():
        lowered = lowered[len("celery_"):]
    if lowered.startswith(("leases_", "lease_")):
        return lowered
    return None


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
