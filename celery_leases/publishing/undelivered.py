"""The Celery side of the recovery step for tasks no worker acquired in time.

Publish tracking adds a step to every recovery pass (tracking.attach): the store claims the
queued tasks no worker acquired within ``leases_delivery_timeout``; this re-publishes each
(same id, routing, headers, a new ``lease_generation``), or stores REVOKED (reason expired)
for those past their ``expires``, as Celery does for an expired message.
"""
from __future__ import annotations

import logging
from typing import Any

from celery import states

from ..protocol.queued import Undelivered
from ..recovery.messages import publish_raw, request_of
from ..signals import undelivered_republished
from ..runtime import decided

logger = logging.getLogger("celery_leases.tracking")


class Republisher:
    """What a recovery pass does with an undelivered task: re-publish it, or store its expiry."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def publish(self, item: Undelivered) -> None:
        headers = dict(item.envelope.get("headers") or {})
        headers["lease_generation"] = item.generation
        publish_raw(self.app, item.body, item.envelope, headers)
        logger.warning("task %s[%s]: not acquired within leases_delivery_timeout; re-published "
                       "(generation %d)", item.name, item.task_id, item.generation)
        undelivered_republished.send(sender=self.app, task_id=item.task_id, generation=item.generation)

    def on_expired(self, item: Undelivered) -> None:
        """Past ``expires`` while undelivered: REVOKED (expired) for waiters, as Celery stores it."""
        task = self.app.tasks.get(item.name)
        store_result = task is None or task.store_errors_even_if_ignored or not task.ignore_result
        request = request_of(item.task_id, item.name, item.body, item.envelope)
        logger.info("task %s[%s]: expired before any worker received it; revoked", item.name, item.task_id)
        with decided(item.task_id):
            self.app.backend.mark_as_revoked(item.task_id, "expired", request=request,
                                             store_result=store_result, state=states.REVOKED)
