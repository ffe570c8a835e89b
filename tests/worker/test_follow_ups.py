"""An accepted success never ends without its follow-ups: a chord member's part, its link
callbacks and its chain's next step.

A pool process SIGKILLed right after its success was accepted (before Celery's tracer
counted the chord part, and before the task sent its callbacks) leaves them kept in the
store with the outcome; recovery does them, once. One killed after all of that, before
its process confirmed it, has them done already: recovery sends nothing twice.

Real ``celery worker`` processes (prefork: the pool process dies, the worker lives), a real
redis-server for broker, results and leases (the default layout: the finish writes the
result itself), real SIGKILLs from inside the task's process.
"""
from __future__ import annotations

import pytest
from celery import chain, chord, group

import celery_leases
from celery_leases.protocol import unwritten
from celery_leases.testing.servers import wait_for

pytestmark = pytest.mark.slow

APP = "tests.support.apps.leased_app"
DIE_POINTS = {"finish": "add_then_die", "return": "add_then_die_late"}


def _task(app, name):
    return app.tasks[f"{APP}.{name}"]


def _recover_until(client_app, done, what: str, timeout: float = 30) -> None:
    store = celery_leases.store(client_app)

    def recovered() -> bool:
        store.recover()
        return done()
    wait_for(recovered, timeout, what)


def _starts(history, task_id: str) -> int:
    return sum(1 for event, tid, _, _ in history() if event == "start" and tid == task_id)


def _died(history) -> list:
    return [(tid, fields["after"]) for event, tid, _, fields in history() if event == "died"]


@pytest.mark.parametrize("die_after", sorted(DIE_POINTS))
def test_a_chord_whose_member_died_after_its_success_completes_once(
        start_worker, client_app, history, die_after):
    # Given a chord whose first member's pool process dies right after its success
    worker = start_worker("a", concurrency=2)
    dies = _task(client_app, DIE_POINTS[die_after])
    add, tsum = _task(client_app, "add"), _task(client_app, "tsum")
    result = chord(group(dies.s(1, 2), add.s(3, 4)), tsum.s()).apply_async()
    body_id = result.id
    # When recovery runs
    _recover_until(client_app, lambda: result.ready(), f"the chord body {body_id} to finish")
    # Then the body ran once, with every part
    assert result.get(timeout=10) == 10
    assert _starts(history, body_id) == 1
    assert [point for _, point in _died(history)] == [die_after]
    assert worker.running


@pytest.mark.parametrize("die_after", sorted(DIE_POINTS))
def test_a_chain_whose_step_died_after_its_success_goes_on_once(
        start_worker, client_app, history, die_after):
    worker = start_worker("a", concurrency=2)
    dies, add = _task(client_app, DIE_POINTS[die_after]), _task(client_app, "add")
    result = chain(dies.s(1, 2), add.s(10), add.s(100)).apply_async()
    _recover_until(client_app, lambda: result.ready(), f"the chain's last step {result.id}")
    assert result.get(timeout=10) == 113
    assert result.parent.get(timeout=10) == 13
    assert _starts(history, result.parent.id) == 1 and _starts(history, result.id) == 1
    assert [point for _, point in _died(history)] == [die_after]
    assert worker.running


@pytest.mark.parametrize("die_after", sorted(DIE_POINTS))
def test_a_link_callback_of_a_success_whose_process_died_is_sent_once(
        start_worker, client_app, history, die_after):
    start_worker("a", concurrency=2)
    dies, note = _task(client_app, DIE_POINTS[die_after]), _task(client_app, "note_callback")
    result = dies.apply_async((2, 3), link=note.s())

    def callbacks() -> list:
        return [tid for event, tid, _, fields in history() if event == "callback" and fields["value"] == "5"]
    _recover_until(client_app, lambda: len(callbacks()) >= 1, "the link callback to run")
    assert result.get(timeout=10) == 5
    # Once: recovery passes until the kept follow-ups are settled send nothing more
    _recover_until(client_app, lambda: unwritten.count(celery_leases.store(client_app)) == 0,
                   "the kept follow-ups settled")
    celery_leases.store(client_app).recover()
    assert len(callbacks()) == 1
