"""Each publish of a task carries its own id (header ``lease_publish``).

A task id whose record is finished may arrive again for two reasons that look
alike at receipt: a copy of the message that already ran (kombu's restore of
an unacked message, a visibility-timeout redelivery, a late recovered copy)
and a new publish under the same id (a frozen signature or chord applied
again, ``apply_async(task_id=...)``). Plain Celery runs the second and so
must a leased task; the first must stay refused. This header tells them
apart: Celery's publish (``before_task_publish``) stamps a new one each time,
while every copy of a message keeps it (kombu restores the message as it
was; recovery, the worker's delayed re-queue and ``celery leases replay``
re-publish its stored headers through ``publish_raw``, past this hook).
A delivery without it (a producer that never imported celery-leases) is
refused as a duplicate when the record is finished, as before.
"""
from __future__ import annotations

import os
import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

from celery.signals import before_task_publish

#: Message header holding the publish id: 16 hex digits, random per publish.
PUBLISH_HEADER = "lease_publish"
#: Longest publish id a delivery may carry (the store keeps them in small hash fields).
MAX_PUBLISH_ID = 64
#: Message header set by a publisher that records the message in the lease store first
#: (publish tracking, tracking.py): the names of the headers it recorded, as
#: ``recorded_headers`` gives them. A worker that receives exactly those headers leaves
#: the message out of its acquire, since the store holds it already
#: (LeaseStore.acquire(recorded=True)); one that receives more (a ``before_task_publish``
#: receiver that ran after the record added some, such as a trace context) sends it.
RECORDED_HEADER = "lease_recorded"


def recorded_headers(headers: Mapping[str, Any]) -> str:
    """A short digest of the header names (not their values, which a broker's encoding may
    change: a tuple arrives as a list), ``RECORDED_HEADER`` itself left out."""
    seen = tuple(headers)
    digest = _digests.get(seen)
    if digest is None:
        names = sorted(str(name) for name in seen if name != RECORDED_HEADER)  # (a key may not be a str)
        digest = "%08x" % zlib.crc32("\x00".join(names).encode("utf-8", "surrogatepass"))
        if len(_digests) >= _DIGESTS_MAX:
            _digests.clear()
        _digests[seen] = digest
    return digest


#: Header names, in a message's order -> their digest. Every message of one publisher and
#: task carries the same names in the same order; the worker checks each message twice.
_digests: dict[tuple, str] = {}
_DIGESTS_MAX = 256


def new_publish_id() -> str:
    return os.urandom(8).hex()


#: The publish id chosen ahead of the publishes under way in this context (``publishing_as``).
_given: ContextVar[str | None] = ContextVar("celery_leases_publish_id", default=None)


@contextmanager
def publishing_as(publish_id: str) -> Iterator[None]:
    """Stamp the messages published in this block with ``publish_id`` instead of new ones.

    The outbox (celery_leases/outbox/) chooses a row's publish id when the row is written
    and publishes the row with it, as often as a crash makes it publish the row: every
    copy is then one publish, refused at receipt once a copy ran."""
    token = _given.set(publish_id)
    try:
        yield
    finally:
        _given.reset(token)


@before_task_publish.connect(weak=False, dispatch_uid="celery_leases.publish_id")
def stamp_publish_id(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
    """Give every publish of a task message its own id (cheap: 8 random bytes)."""
    if isinstance(headers, dict):
        headers[PUBLISH_HEADER] = _given.get() or new_publish_id()
