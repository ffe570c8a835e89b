"""A stale owner's outcome refused: logged, signalled, and kept inside the worker.

One place for what every refusal does, whether the finish was waited for
(``LeasedTask``) or sent in the background (worker/background.py).
"""
from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery.exceptions import Ignore

from ..exceptions import LeaseError, LeaseLost
from ..signals import stale_outcome_rejected

logger = logging.getLogger("celery_leases.task")


class StaleOutcome(Ignore, LeaseError):
    """Raised in the worker to drop the outcome of an owner that lost its lease.

    An ``Ignore``: Celery's tracer then sends no callbacks, writes no result
    and acknowledges the message.
    """


def refusal_reason(exc: LeaseError) -> str:
    return exc.reason if isinstance(exc, LeaseLost) else f"unverifiable: {exc}"


def report_refusal(task: Any, task_id: str, token: int | None, outcome: str, reason: str) -> None:
    """Log and signal a refused outcome."""
    logger.warning("task %s[%s]: outcome %r of token %s refused: lease %s",
                   getattr(task, "name", "?"), task_id, outcome, token, reason)
    stale_outcome_rejected.send(sender=task, task_id=task_id, token=token, outcome=outcome, reason=reason)


def refuse(task: Any, task_id: str, token: int | None, outcome: str, reason: str) -> NoReturn:
    """Log and signal a refused outcome, then raise StaleOutcome."""
    report_refusal(task, task_id, token, outcome, reason)
    raise StaleOutcome(f"stale outcome {outcome} of task {task_id} (token {token}) refused: {reason}")
