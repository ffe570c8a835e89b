"""The message of a publish as kombu will publish it, serialized once.

The record of a publish (tracking.py) needs the body serialized, its routing, headers and
properties exactly as kombu will send them; ``message_of`` builds that. kombu's Producer then
takes the body the record serialized instead of serializing it again (``serialize_once``).
"""
from __future__ import annotations

from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

from kombu.compression import compress
from kombu.entity import maybe_delivery_mode
from kombu.serialization import dumps

from .. import patches
from ..protocol.queued import QueuedTask
from .publish_id import PUBLISH_HEADER

#: The body serialized for the record of the publish under way: (body, serializer, what
#: kombu's ``dumps`` returned), so that kombu's Producer does not serialize it a second time.
_serialized: ContextVar[tuple | None] = ContextVar("celery_leases_serialized", default=None)
#: The properties a re-publish needs (publish_raw reads these).
_PROPERTIES = ("correlation_id", "reply_to", "delivery_mode", "priority")


def serialize_once() -> None:
    """Let kombu's Producer take the body the record serialized, instead of serializing it again.

    The record (``before_task_publish``) serializes the body with kombu's ``dumps`` just
    before Celery hands the same object to ``Producer.publish``, which serializes it with
    ``kombu.messaging.dumps``. That name is wrapped to return the record's result when it is
    asked for the very object (identity, held alive by the context variable) with the same
    serializer: the same function on the same input, so the same bytes, one serialization
    saved per publish. Anything else goes to kombu's own ``dumps``, as before."""
    import kombu.messaging as messaging
    original = messaging.dumps
    if getattr(original, "_celery_leases_once", False):
        return

    def dumps(data: Any, serializer: Any = None) -> Any:
        done = _serialized.get()
        if done is not None:
            _serialized.set(None)
            if done[0] is data and done[1] == serializer:
                return done[2]
        return original(data, serializer=serializer)

    dumps._celery_leases_once = True  # type: ignore[attr-defined]
    patches.patch("kombu.messaging.dumps", messaging, "dumps", dumps)


def message_of(app: Any, name: str, body: Any, exchange: Any, routing_key: Any, headers: dict,
               properties: dict, serializer: str | None, compression: str | None,
               delivery_mode: int | None = None) -> QueuedTask:
    """The message as kombu will publish it: serialized body, routing, headers, properties."""
    if serializer is None or compression is None:
        default_serializer, default_compression, _ = _defaults(app)
        serializer = serializer or default_serializer
        compression = compression or default_compression
    serialized = content_type, content_encoding, data = dumps(body, serializer=serializer)
    _serialized.set((body, serializer, serialized))  # kombu's Producer takes it (serialize_once)
    if isinstance(data, str):
        data = data.encode(content_encoding or "utf-8")
    stored_headers = dict(headers)
    if compression:
        data, stored_headers["compression"] = compress(data, compression)
    get = properties.get
    props = {k: v for k in _PROPERTIES if (v := get(k)) is not None}
    if delivery_mode is not None and "delivery_mode" not in props:
        props["delivery_mode"] = delivery_mode
    envelope = {"exchange": exchange or "", "routing_key": routing_key or "",
                "priority": get("priority"), "headers": stored_headers,
                "properties": props, "content_type": content_type,
                "content_encoding": content_encoding}
    eta, expires = headers.get("eta"), headers.get("expires")
    return QueuedTask(str(headers["id"]), name, data, envelope,
                      eta_ms=_epoch_ms(eta) if eta else 0, expires_ms=_epoch_ms(expires) if expires else 0,
                      publish=str(headers.get(PUBLISH_HEADER) or ""))


def _defaults(app: Any) -> tuple[str, str | None, Any]:
    """The app's task_serializer, task_compression and task_default_delivery_mode, read once
    per app as Celery's own task sender reads them (``app.amqp.send_task_message``): a conf
    lookup costs more than the whole record's serialization."""
    defaults = app.__dict__.get("_celery_leases_publish_defaults")
    if defaults is None:
        conf = app.conf
        defaults = app._celery_leases_publish_defaults = (
            conf.task_serializer, conf.task_compression, conf.task_default_delivery_mode)
    return defaults


def delivery_mode_of(app: Any, option: Any, declare: Any) -> int | None:
    """The delivery mode the message goes out with, as Celery's task sender and kombu pick it
    (the option, else the queue's exchange's, else task_default_delivery_mode; Celery passes
    its queue to this signal as ``declare``), so a re-published copy is as persistent."""
    mode = option
    if mode is None:
        try:
            mode = declare[0].exchange.delivery_mode
        except (AttributeError, IndexError, TypeError):
            pass
        mode = mode or _defaults(app)[2]
    try:
        return maybe_delivery_mode(mode)
    except KeyError:
        return None  # a name kombu does not know: left to kombu, as before


def _epoch_ms(value: Any) -> int:
    """An ETA / expires header (ISO 8601, naive taken as UTC) in ms since the epoch; 0: none."""
    if not value:
        return 0
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000)
