"""Settings: precedence, Django names, and clear errors that name the setting."""
from __future__ import annotations

import logging
import re

import pytest
from celery import Celery

import celery_leases
from celery_leases import ConfigurationError, LeasedTask
from celery_leases.config import get_config
from tests.support.processes import run_fresh


def make_app(**conf):
    app = Celery("cfg", broker="redis://127.0.0.1:1/0")
    app.conf.update(conf)
    return app


#: Settings a publisher uses: an error fails install(), naming the setting and the rule.
@pytest.mark.parametrize("setting, value, message", [
    ("leases_redis_url", "amqp://guest@localhost//", "leases_redis_url must be a Redis URL"),
    ("leases_key_prefix", "", "leases_key_prefix must be a non-empty string without whitespace"),
    ("leases_key_prefix", "a\tb", "leases_key_prefix must be a non-empty string without whitespace"),
    ("leases_key_prefix", "a b", "leases_key_prefix must be a non-empty string without whitespace"),
    ("leases_key_prefix", "line\n", "leases_key_prefix must be a non-empty string without whitespace"),
    ("leases_key_prefix", "x{y}", "braces"),
    ("leases_key_prefix", 5, "leases_key_prefix must be a non-empty string"),
    ("leases_shards", 0, "leases_shards must be an integer >= 1, got 0"),
    ("leases_recover_batch", 0, "leases_recover_batch must be an integer >= 1, got 0"),
    ("leases_recover_batch", 2.5, "leases_recover_batch must be an integer >= 1, got 2.5"),
    ("leases_max_recoveries", -2, "leases_max_recoveries must be a non-negative integer, got -2"),
    ("leases_retention", 0, "leases_retention must be a positive number of seconds, got 0"),
    ("leases_publish_grace", float("inf"), "leases_publish_grace must be a positive number of seconds"),
    ("leases_dead_letter_queue", 5, "leases_dead_letter_queue must be None (off) or a queue name"),
    ("leases_dead_letter_queue", "", "leases_dead_letter_queue must be None (off) or a queue name"),
    ("leases_dead_letter_queue", ["dlq"], "leases_dead_letter_queue must be None (off) or a queue name"),
])
@pytest.mark.parametrize("configured", [True, False])
def test_install_with_a_broken_publisher_setting_names_it(setting, value, message, configured):
    app = make_app(**{setting: value})
    if configured:
        app.conf.get("leases_ttl")  # reads the configuration: install() validates app.conf
    assert app.configured is configured
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        celery_leases.install(app)


#: Settings only a worker uses: install() and the store work (a publisher is not broken),
#: the worker's full check names the setting.
@pytest.mark.parametrize("setting, value, message", [
    ("leases_ttl", -1, "leases_ttl must be a positive number of seconds, got -1"),
    ("leases_ttl", "soon", "leases_ttl must be a positive number of seconds, got 'soon'"),
    ("leases_ttl", float("nan"), "leases_ttl must be a positive number of seconds, got nan"),
    ("leases_ttl", True, "leases_ttl must be a positive number of seconds, got True"),
    ("leases_heartbeat_interval", 30, "leases_heartbeat_interval (30) must be below leases_ttl (30)"),
    ("leases_recovery_interval", 0, "leases_recovery_interval must be a positive number of seconds, got 0"),
    ("leases_progress_timeout", -1, "leases_progress_timeout must be None (off) or a positive number"),
    ("leases_on_lost", "explode", "leases_on_lost must be 'flag' or 'terminate', got 'explode'"),
    ("leases_unavailable_retry_delay", "x", "leases_unavailable_retry_delay must be a positive number"),
    ("leases_worker_recovery", "maybe", "leases_worker_recovery must be a boolean, got 'maybe'"),
    ("leases_beat_schedule", 2, "leases_beat_schedule must be a boolean, got 2"),
])
def test_a_broken_worker_setting_does_not_break_a_publisher(setting, value, message):
    app = make_app(**{setting: value})
    app.conf.get("leases_ttl")
    celery_leases.install(app)                 # a publisher's import proj
    assert celery_leases.store(app) is not None
    assert "celery_leases.recover" not in (app.conf.beat_schedule or {})
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        get_config(app)                        # what the worker checks at start


def test_every_broken_setting_is_named_at_once():
    app = make_app(leases_ttl=-1, leases_on_lost="x")
    with pytest.raises(ConfigurationError) as err:
        get_config(app)
    assert "2 problems" in str(err.value)
    assert "leases_ttl" in str(err.value) and "leases_on_lost" in str(err.value)


@pytest.mark.parametrize("setting, message", [
    ("leases_tll", "leases_tll: unknown setting; did you mean leases_ttl?"),
    ("lease_ttl", "lease_ttl: unknown setting; did you mean leases_ttl?"),
    ("leases_heartbeat_intervall", "did you mean leases_heartbeat_interval?"),
    ("leases_something_else", "leases_something_else: unknown setting"),
])
def test_an_unknown_worker_side_setting_is_named_with_the_closest_one(setting, message):
    app = make_app(**{setting: 5})
    celery_leases.install(app)   # closest to a worker-only setting (or to none): the worker refuses
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        get_config(app)


def test_other_lease_prefixed_settings_are_not_ours():
    app = make_app(lease_duration=5, leasehold="x")   # a project's own settings
    celery_leases.install(app)
    get_config(app)


def test_an_unknown_publisher_side_setting_fails_install():
    app = make_app(leases_key_prefx="orders")
    with pytest.raises(ConfigurationError,
                       match=re.escape("leases_key_prefx: unknown setting; did you mean leases_key_prefix?")):
        celery_leases.install(app)


def test_an_unknown_django_setting_is_named_as_written():
    class Settings(DjangoSettings):
        CELERY_LEASES_TLL = 5

    app = Celery("django_proj")
    app.config_from_object(Settings, namespace="CELERY")
    celery_leases.install(app)
    with pytest.raises(ConfigurationError,
                       match=re.escape("CELERY_LEASES_TLL: unknown setting; did you mean CELERY_LEASES_TTL?")):
        get_config(app)


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


@pytest.mark.parametrize("options, message", [
    ({"lease_ttl": -5}, "task cfg.broken: lease_ttl must be a positive number of seconds, got -5"),
    ({"lease_ttl": "5"}, "task cfg.broken: lease_ttl must be a positive number of seconds, got '5'"),
    ({"lease_max_recoveries": 1.5}, "task cfg.broken: lease_max_recoveries must be a non-negative integer, got 1.5"),
    ({"lease_progress_timeout": True}, "task cfg.broken: lease_progress_timeout must be None (off) or a positive"),
    ({"lease_on_lost": "kill"}, "task cfg.broken: lease_on_lost must be 'flag' or 'terminate', got 'kill'"),
    ({"lease_tll": 5}, "task cfg.broken: lease_tll: unknown option; did you mean lease_ttl?"),
    ({"lease_ttl": 5, "lease_heartbeat_interval": 10},
     "task cfg.broken: lease_heartbeat_interval (10) must be below lease_ttl (5)"),
    ({"lease_heartbeat_interval": 40}, "task cfg.broken: lease_heartbeat_interval (40) must be below leases_ttl (30)"),
])
def test_invalid_task_option_fails_at_definition_naming_task_option_and_value(options, message):
    app = make_app()
    celery_leases.install(app)

    with pytest.raises(ConfigurationError, match=re.escape(message)) as err:
        @app.task(base=LeasedTask, name="cfg.broken", shared=False, **options)
        def broken():
            return 1

        _ = broken.name  # evaluates the task (app.task is lazy until the app is finalized)
    # the prefix is not repeated ("task x: lease_task x: lease_ttl")
    assert str(err.value).count("task cfg.broken") == 1, err.value


def test_task_options_are_checked_without_the_app_settings_when_those_are_broken():
    # A publisher with a broken worker-only setting still imports its tasks
    app = make_app(leases_ttl=-1)
    celery_leases.install(app)

    @app.task(base=LeasedTask, lease_heartbeat_interval=3, shared=False)
    def fine():
        return 1

    assert app.tasks[fine.name].lease_heartbeat_interval == 3
    with pytest.raises(ConfigurationError, match="lease_ttl must be a positive"):
        @app.task(base=LeasedTask, lease_ttl=0, shared=False)
        def broken():
            return 1
        _ = broken.name


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
    # The recovery task is never leased: a pass may run twice or crash anywhere
    assert not isinstance(app.tasks["celery_leases.recover"], LeasedTask)


def test_all_tasks_leases_a_task_defined_before_the_call_that_the_app_has_not_built_yet():
    # Given a task decorated before install() on an app not finalized yet (Celery builds a
    # task's class when the app is finalized), and one on an app already finalized
    pending_app, built_app = make_app(), make_app()

    @pending_app.task(name="cfg.pending")
    def pending():
        return 1

    @built_app.task(name="cfg.built")
    def built():
        return 2

    built_app.finalize()
    # When every task of each app is leased from here on
    celery_leases.install(pending_app, all_tasks=True)
    celery_leases.install(built_app, all_tasks=True)
    # Then the pending one is built leased; the one already built keeps its class
    assert isinstance(pending_app.tasks["cfg.pending"], LeasedTask)
    assert not isinstance(built_app.tasks["cfg.built"], LeasedTask)


@pytest.mark.parametrize("second", [dict(all_tasks=True), dict(all_tasks=True, ttl=7)])
def test_a_second_install_applies_what_it_asks_for_and_installs_nothing_twice(second):
    # Given an app installed once without options (a shared module's install(app))
    app = make_app()
    celery_leases.install(app)
    steps = set(app.steps["worker"])
    beat = dict(app.conf.beat_schedule or {})
    # When the project installs it again asking for every task leased (and a setting)
    celery_leases.install(app, **second)

    @app.task(name=f"cfg.later{len(second)}")
    def later():
        return 1

    # Then what it asked for holds, and no hook or task was added twice
    assert isinstance(app.tasks[later.name], LeasedTask)
    if "ttl" in second:
        assert app.conf.leases_ttl == 7 and get_config(app).ttl == 7
    assert set(app.steps["worker"]) == steps and dict(app.conf.beat_schedule or {}) == beat
    assert not isinstance(app.tasks["celery_leases.recover"], LeasedTask)


def test_a_second_install_with_settings_after_the_store_was_built_is_refused_naming_them():
    # Given an installed app whose lease store this process already built
    app = make_app()
    celery_leases.install(app, ttl=5)
    celery_leases.store(app)
    # When a later install asks for other settings, Then it is refused, naming them (the
    # store already uses the first ones), and the settings are left as they were
    with pytest.raises(ConfigurationError) as refused:
        celery_leases.install(app, ttl=9, key_prefix="other")
    assert "leases_ttl, leases_key_prefix" in str(refused.value)
    assert app.conf.leases_ttl == 5
    # And a second install without settings is still a no-op
    assert celery_leases.install(app) is app


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


def test_eager_mode_runs_without_a_lease_and_warns_once_per_process(caplog, monkeypatch):
    import celery_leases.task.leased as task_module
    monkeypatch.setattr(task_module, "_warned_unleased", False)
    app = make_app(task_always_eager=True)
    celery_leases.install(app)

    @app.task(base=LeasedTask, bind=True)
    def eager(self, x):
        self.lease.check()
        self.lease.heartbeat()
        return (x, self.lease.token, self.lease.lost)

    with caplog.at_level(logging.WARNING, logger="celery_leases.task"):
        assert eager.delay(4).get() == (4, None, False)
        assert eager.apply((5,)).get() == (5, None, False)
        assert eager(6) == (6, None, False)
    warnings = [r for r in caplog.records if "ran without a lease" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_django_namespace_errors_name_the_setting_as_written():
    class Broken(DjangoSettings):
        CELERY_LEASES_TTL = -1

    app = Celery("django_proj")
    app.config_from_object(Broken, namespace="CELERY")
    with pytest.raises(ConfigurationError, match="CELERY_LEASES_TTL"):
        get_config(app)


def test_beat_reports_a_broken_worker_setting_and_schedules_no_recovery(caplog):
    from celery.signals import beat_init
    app = make_app(leases_recovery_interval=0)
    celery_leases.install(app)
    app.loader.import_default_modules()
    assert "celery_leases.recover" not in (app.conf.beat_schedule or {})

    class Beat:  # beat_init's sender is beat's Service, which carries the app
        pass
    beat = Beat()
    beat.app = app
    with caplog.at_level(logging.ERROR, logger="celery_leases.install"):
        beat_init.send(sender=beat)
    [record] = [r for r in caplog.records if "leases_recovery_interval" in r.getMessage()]
    assert "beat does not schedule celery_leases.recover" in record.getMessage()


def test_the_key_layout_refuses_what_the_setting_refuses():
    from celery_leases.protocol.keys import Keys
    for prefix in ("", "a\tb", "a b", "a\nb", "{a}", "a\x00"):
        with pytest.raises(ValueError, match="leases_key_prefix must be a non-empty string"):
            Keys(prefix)
    assert Keys("orders:v2").tag == "{orders:v2}"


def test_the_documented_modules_are_reachable_from_a_bare_import_of_the_package():
    # (a fresh interpreter: in this one the test suite has imported them already)
    code = ("import celery_leases; "
            "print(celery_leases.config.get_config.__name__, celery_leases.config.client_config.__name__, "
            "celery_leases.protocol.__name__, celery_leases.testing.wait_for.__name__)")
    assert run_fresh(code).split() == ["get_config", "client_config", "celery_leases.protocol", "wait_for"]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        celery_leases.nothing  # noqa: B018
