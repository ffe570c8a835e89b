"""The tasks under test: leased, so a killed worker's task runs again and a stale owner's
outcome is refused. pytest-celery copies this module into each worker."""
import time

from celery import shared_task

from celery_leases import LeasedTask


@shared_task(base=LeasedTask, name="tasks.slow_add")
def slow_add(x, y, seconds=0.0):
    time.sleep(seconds)
    return x + y


@shared_task(base=LeasedTask, bind=True, name="tasks.whoami")
def whoami(self, seconds=0.0):
    """The node name of the worker whose outcome stood, after ``seconds`` of work."""
    time.sleep(seconds)
    return self.request.hostname
