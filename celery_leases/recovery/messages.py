"""The message envelope: what a lease record keeps of a broker message, and how it goes back.

A worker stores each leased delivery's body and envelope (routing, headers,
properties) with its lease at receipt, unless its publisher recorded that very
message (tracking.message_of builds the same envelope from the publish);
recovery, re-queueing, parking, the dead-letter copy and ``celery leases
replay`` publish those bytes again under the same task id. The envelope of a
delivery is built here and every re-publish goes through ``publish_raw``, so
each carries the same routing and properties as the original.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from celery.app.task import Context
from kombu.serialization import loads

__all__ = ["envelope_of", "publish_raw", "request_of"]

logger = logging.getLogger("celery_leases.recovery")


def envelope_of(message: Any) -> dict:
    """What recovery needs to re-publish a message exactly: routing, headers, properties."""
    info = message.delivery_info or {}
    props = dict(message.properties or {})
    props.pop("delivery_info", None)
    props.pop("body_encoding", None)
    props.pop("delivery_tag", None)
    return {
        "exchange": info.get("exchange") or "",
        "routing_key": info.get("routing_key") or "",
        "priority": info.get("priority", props.get("priority")),
        "headers": message.headers or {},
        "properties": props,
        "content_type": message.content_type,
        "content_encoding": message.content_encoding,
    }


def publish_raw(app: Any, body: bytes, envelope: Mapping, headers: dict, *,
                exchange: str | None = None, routing_key: str | None = None,
                declare: list | None = None) -> None:
    """Publish stored message bytes as they were: same id, routing, headers and properties.

    ``exchange``/``routing_key`` override the stored routing (a dead-letter
    queue); ``declare`` defaults to the app's queues bound to that routing.
    """
    props = envelope.get("properties") or {}
    exchange = envelope.get("exchange", "") if exchange is None else exchange
    routing_key = envelope.get("routing_key", "") if routing_key is None else routing_key
    if declare is None:
        declare = [q for q in app.amqp.queues.values()
                   if q.routing_key == routing_key and (q.exchange.name or "") == exchange]
    with app.producer_or_acquire() as producer:
        producer.publish(
            body, exchange=exchange, routing_key=routing_key, headers=headers,
            content_type=envelope.get("content_type"), content_encoding=envelope.get("content_encoding"),
            priority=envelope.get("priority") or 0, retry=True, declare=declare,
            correlation_id=props.get("correlation_id"), reply_to=props.get("reply_to"),
            delivery_mode=props.get("delivery_mode"),
        )


def request_of(task_id: str, name: str, body: bytes, envelope: Mapping) -> Context:
    """A request context (chord, chain, errbacks, reply_to) rebuilt from a stored message,
    for storing a failure (LeaseExpired, DeliveryParked) as the task's own result."""
    headers = dict(envelope.get("headers") or {})
    props = envelope.get("properties") or {}
    fields: dict[str, Any] = {**headers, "id": task_id, "task": name or headers.get("task"),
                              "reply_to": props.get("reply_to"),
                              "correlation_id": props.get("correlation_id"),
                              "delivery_info": {"exchange": envelope.get("exchange"),
                                                "routing_key": envelope.get("routing_key")}}
    if body:
        try:
            args, kwargs, embed = loads(body, envelope.get("content_type"),
                                        envelope.get("content_encoding"), accept=None)
            fields.update(args=args, kwargs=kwargs, **(embed or {}))
        except Exception as exc:  # noqa: BLE001 - still store the failure, without canvas links
            logger.warning("task %s: stored message could not be decoded (%r); its chord, chain "
                           "and errbacks are not notified", task_id, exc)
    return Context(fields)
