"""A Django project package (``proj``): Django's convention loads the Celery app with it,
so ``@shared_task`` tasks bind to it."""
from .celery import app as celery_app

__all__ = ("celery_app",)
