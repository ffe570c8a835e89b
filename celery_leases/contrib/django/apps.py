"""The Django app of the outbox (its migration creates the table)."""
from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "celery_leases.contrib.django"
    label = "celery_leases_outbox"
    verbose_name = "celery-leases outbox"
