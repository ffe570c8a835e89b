"""Settings: precedence, Django names, and clear errors that name the setting."""
from __future__ import annotations

import pytest
from celery import Celery

import celery_leases
from celery_leases import ConfigurationError, LeasedTask
from celery_leases.config import get_config


def make_app(**conf):
    app = Celery("cfg", broker="redis://127.0.0.1:1/0")
    app.conf.update(conf)
    return app


@pytest.mark.parametrize("setting, value, named", [
    ("leases_ttl", -1, "leases_ttl"),
    ("leases_ttl", "soon", "leases_ttl"),
    ("leases_heartbeat_interval", 30, "leases_heartbeat_interval"),
    ("leases_max_recoveries", -2, "leases_max_recoveries"),
    ("leases_on_lost", "explode", "leases_on_lost"),
    ("leases_redis_url", "amqp://guest@localhost//", "leases_redis_url"),
    ("leases_worker_recovery", "maybe", "leases_worker_recovery"),
])
def test_install_with_a_broken_setting_names_it(setting, value, named):
    app = make_app(**{setting: value})
    with pytest.raises(ConfigurationError, match=named):
        celery_leases.install(app)


def test_no_redis_url_anywhere_is_an_error_naming_the_setting():
    # (install() cannot know yet: a later config_from_object may bring the URL;
    #  the worker reads the settings at start, as get_config does here)
    app = Celery("cfg", broker="amqp://guest@localhost//", backend="rpc://")
    celery_leases.install(app)
    with pytest.raises(ConfigurationError, match="leases_redis_url"):
        get_config(app)


def test_defaults_and_fallback_to_a_redis_broker_url():
    app = make_app()
    config = get_config(app)
    assert config.redis_url == "redis://127.0.0.1:1/0"
    assert (config.ttl, config.heartbeat_interval, config.recovery_interval, config.max_recoveries) == \
        (30.0, 10.0, 5.0, 3)
    assert config.progress_timeout is None and config.on_lost == "flag"


def test_install_keyword_settings_and_task_overrides():
    app = make_app()
    celery_leases.install(app, ttl=12, max_recoveries=1)

    @app.task(base=LeasedTask, lease_ttl=3, lease_progress_timeout=9)
    def t():
        return 1

    config = get_config(app)
    assert config.ttl == 12 and config.max_recoveries == 1
    task_config = config.for_task(app.tasks[t.name])
    assert task_config.ttl == 3 and task_config.heartbeat_interval == 1.0
    assert task_config.progress_timeout == 9 and task_config.max_recoveries == 1


def test_invalid_task_override_names_the_task_and_option():
    app = make_app()
    celery_leases.install(app)

    @app.task(base=LeasedTask, lease_ttl=-5)
    def broken():
        return 1

    with pytest.raises(ConfigurationError, match=r"broken.*lease_ttl"):
        get_config(app).for_task(app.tasks[broken.name])


class DjangoSettings:
    CELERY_BROKER_URL = "redis://127.0.0.1:1/3"
    CELERY_LEASES_TTL = 7
    CELERY_LEASES_KEY_PREFIX = "django-leases"
    CELERY_LEASES_MAX_RECOVERIES = 5


def test_django_namespace_settings():
    app = Celery("django_proj")
    app.config_from_object(DjangoSettings, namespace="CELERY")
    celery_leases.install(app)
    config = get_config(app)
    assert (config.ttl, config.key_prefix, config.max_recoveries) == (7.0, "django-leases", 5)
    assert config.redis_url == "redis://127.0.0.1:1/3"


def test_all_tasks_makes_later_tasks_leased():
    app = make_app()
    celery_leases.install(app, all_tasks=True)

    @app.task
    def later():
        return 1

    assert isinstance(app.tasks[later.name], LeasedTask)
    assert "celery_leases.recover" in app.tasks


@pytest.mark.parametrize("settings", [{"leases_worker_recovery": False}, {"leases_beat_schedule": True}])
def test_beat_entry_is_added_with_the_recovery_interval(settings):
    # Given workers without fallback recovery, or the beat entry asked for
    app = Celery("beat", broker="redis://127.0.0.1:1/0")
    celery_leases.install(app)       # before configuration is read
    app.conf.update(leases_recovery_interval=2.5, **settings)
    app.loader.import_default_modules()
    entry = app.conf.beat_schedule["celery_leases.recover"]
    assert entry["task"] == "celery_leases.recover" and entry["schedule"] == 2.5


@pytest.mark.parametrize("settings", [{}, {"leases_beat_schedule": False, "leases_worker_recovery": False}])
def test_no_beat_entry_while_workers_recover_by_default(settings):
    # Given the defaults (the workers run the fallback recovery), or the entry refused
    app = Celery("beat", broker="redis://127.0.0.1:1/0")
    celery_leases.install(app)
    app.conf.update(**settings)
    app.loader.import_default_modules()
    # Then beat sends no recover task: one recoverer per interval, nothing logged for a skip
    assert "celery_leases.recover" not in (app.conf.beat_schedule or {})


def test_eager_mode_runs_without_a_lease():
    app = make_app(task_always_eager=True)
    celery_leases.install(app)

    @app.task(base=LeasedTask, bind=True)
    def eager(self, x):
        self.lease.check()
        self.lease.heartbeat()
        return (x, self.lease.token, self.lease.lost)

    assert eager.delay(4).get() == (4, None, False)
    assert eager.apply((5,)).get() == (5, None, False)
    assert eager(6) == (6, None, False)


def test_django_namespace_errors_name_the_setting_as_written():
    class Broken(DjangoSettings):
        CELERY_LEASES_TTL = -1

    app = Celery("django_proj")
    app.config_from_object(Broken, namespace="CELERY")
    with pytest.raises(ConfigurationError, match="CELERY_LEASES_TTL"):
        get_config(app)
