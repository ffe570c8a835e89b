"""The outbox for Django: ``INSTALLED_APPS += ["celery_leases.contrib.django"]``.

Its migration creates the outbox table (``CELERY_LEASES_OUTBOX_TABLE``, default
``celery_leases_outbox``, and ``<table>_parked``) in each database it is migrated on
(``manage.py migrate celery_leases_outbox [--database NAME]``), as ``celery -A proj leases
outbox init`` does. ``send`` writes a task into the current transaction of a database
connection and publishes it right after COMMIT (``transaction.on_commit``); a sender that
dies first leaves the row to the workers' relay::

    from celery_leases.contrib.django import send

    with transaction.atomic():
        order.save()
        send(charge.s(order.pk))      # exists if and only if this block commits
"""
from __future__ import annotations

from typing import Any

from ... import outbox
from ...outbox.sql import DEFAULT_TABLE, Table, dialect

__all__ = ["send", "create_table", "drop_table", "table_name"]



def send(sig: Any, *, using: str | None = None, publish_on_commit: bool = True, app: Any = None) -> Any:
    """``celery_leases.outbox.send`` on Django's connection ``using`` (default: "default"),
    inside its current atomic block (or at once, in autocommit). Returns the AsyncResult."""
    from django.db import DEFAULT_DB_ALIAS, connections
    return outbox.send(connections[using or DEFAULT_DB_ALIAS], sig, app=app,
                       publish_on_commit=publish_on_commit)


def table_name() -> str:
    """The outbox table the migration creates: ``settings.CELERY_LEASES_OUTBOX_TABLE``."""
    from django.conf import settings
    return getattr(settings, "CELERY_LEASES_OUTBOX_TABLE", None) or DEFAULT_TABLE


def create_table(apps: Any, schema_editor: Any) -> None:
    """The migration's forward step: the outbox table and its parked table."""
    connection = schema_editor.connection
    for sql in dialect(connection.vendor, "%s").create(Table.parse(table_name())):
        schema_editor.execute(sql, None)


def drop_table(apps: Any, schema_editor: Any) -> None:
    """The migration's backward step."""
    connection = schema_editor.connection
    db = dialect(connection.vendor, "%s")
    table = Table.parse(table_name())
    for suffix in ("_parked", ""):
        schema_editor.execute(f"DROP TABLE IF EXISTS {db.ident(table, suffix)}", None)
