"""The outbox in a Django project: the app's migration makes the table, ``send`` joins the
current atomic block and publishes on ``transaction.on_commit`` (SQLite and PostgreSQL)."""
from __future__ import annotations

import json

import pytest

from celery_leases.outbox import Relay

django = pytest.importorskip("django", reason="Django not installed (pip install -e '.[test]')")

TABLE = "django_outbox"
ADD = "tests.support.apps.leased_app.add"


@pytest.fixture(scope="module")
def django_dbs(tmp_path_factory, pg_database):
    """Django configured once for this module: "default" on SQLite, "pg" on PostgreSQL, both migrated."""
    from django.conf import settings
    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["celery_leases.contrib.django"],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                   "NAME": str(tmp_path_factory.mktemp("django") / "db.sqlite3")},
                       "pg": {"ENGINE": "django.db.backends.postgresql", "NAME": pg_database.rsplit("/", 1)[1],
                              "USER": "postgres", "HOST": "127.0.0.1", "PORT": "5432"}},
            CELERY_LEASES_OUTBOX_TABLE=TABLE, USE_TZ=True)
        django.setup()
    from django.core.management import call_command
    for alias in ("default", "pg"):
        call_command("migrate", "celery_leases_outbox", database=alias, verbosity=0)
    from django.db import connections
    yield {"default": f"sqlite:///{settings.DATABASES['default']['NAME']}", "pg": pg_database}
    for alias in ("default", "pg"):
        call_command("migrate", "celery_leases_outbox", "zero", database=alias, verbosity=0)
    connections.close_all()


@pytest.fixture
def app(outbox_env):
    from tests.support.apps.leased_app import create_app
    app = create_app({**outbox_env, "LEASES_TEST_OUTBOX_TABLE": TABLE})
    yield app
    app.close()


def queued(redis_client, queue):
    return [json.loads(raw)["headers"]["id"] for raw in redis_client.lrange(queue, 0, -1)]


@pytest.mark.parametrize("alias", ["default", "pg"])
def test_send_joins_the_atomic_block_and_publishes_on_commit(alias, django_dbs, app, redis_client, key_prefix):
    from django.db import transaction

    from celery_leases.contrib.django import send
    add = app.tasks[ADD]
    # A block that rolls back: nothing, ever
    with pytest.raises(RuntimeError):
        with transaction.atomic(using=alias):
            dropped = send(add.s(0, 0), using=alias)
            raise RuntimeError("rolled back")
    # A block that commits: published by the on_commit hook, right after COMMIT
    with transaction.atomic(using=alias):
        sent = [send(add.s(i, i), using=alias) for i in range(3)]
        with transaction.atomic(using=alias):  # a savepoint that commits with the block
            sent.append(send(add.s(9, 9), using=alias))
        with pytest.raises(RuntimeError):
            with transaction.atomic(using=alias):  # a savepoint rolled back: its row goes with it
                undone = send(add.s(8, 8), using=alias)
                raise RuntimeError("savepoint rolled back")
        assert queued(redis_client, key_prefix) == []
    assert sorted(queued(redis_client, key_prefix)) == sorted(r.id for r in sent)
    assert dropped.id not in queued(redis_client, key_prefix) and undone.id not in queued(redis_client, key_prefix)
    relay = Relay(app, django_dbs[alias], TABLE)
    assert relay.status().depth == 0 and relay.run_once() == 0
    relay.close()


def test_a_failed_on_commit_publish_is_left_to_the_relay(django_dbs, app, redis_client, key_prefix, monkeypatch):
    from django.db import transaction

    from celery_leases.contrib.django import send
    from celery_leases.outbox import claims
    monkeypatch.setattr(claims, "publish_batch", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("broker")))
    import celery_leases.outbox as outbox_module
    monkeypatch.setattr(outbox_module, "publish_batch", claims.publish_batch)
    with transaction.atomic(using="pg"):
        sent = send(app.tasks[ADD].s(1, 1), using="pg")
    assert queued(redis_client, key_prefix) == []
    monkeypatch.undo()
    relay = Relay(app, django_dbs["pg"], TABLE)
    assert relay.run_once() == 1
    relay.close()
    assert queued(redis_client, key_prefix) == [sent.id]
