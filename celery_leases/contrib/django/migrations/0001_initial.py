"""Create the outbox table (``CELERY_LEASES_OUTBOX_TABLE``) and its parked table."""
from __future__ import annotations

from django.db import migrations

from celery_leases.contrib.django import create_table, drop_table


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []
    operations = [migrations.RunPython(create_table, drop_table)]
