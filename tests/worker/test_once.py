"""Once-only steps: ``self.lease.once(step, fn, ...)`` and the complete_step script.

A step completed by one owner is skipped by every later owner of the same task
id; a step not completed is run by the next owner; an owner that lost its
lease can never record a step for the owner that replaced it.
"""
from __future__ import annotations

import signal
import time

import pytest

import celery_leases
from celery_leases import Code, LeaseLost, LeaseStore
from celery_leases.task.lease import DETACHED, Lease
from celery_leases.testing import wait_for

TASKS = "tests.support.apps.leased_app"
A, B = "worker-a", "worker-b"
SHORT = 0.1


@pytest.fixture
def store(redis_client, key_prefix):
    return LeaseStore(redis_client, prefix=key_prefix, ttl=5.0, retention=60.0)


def lease_of(store, task_id, owner, **kwargs) -> Lease:
    acquisition = store.acquire(task_id, owner, **kwargs)
    assert acquisition.owned, acquisition
    return Lease(task_id, owner, acquisition.token, acquisition.generation, store)


def take_over(store, task_id, owner) -> Lease:
    """Let the current lease (ttl SHORT) expire and acquire it as ``owner``."""
    time.sleep(SHORT + 0.05)
    return lease_of(store, task_id, owner)


# -- the store: complete_step / completed_steps --------------------------------


def test_the_owner_records_a_step_once(store):
    # Given an owner of a task's lease
    lease = lease_of(store, "t1", A)
    # When it records a step twice
    first = store.complete_step("t1", A, lease.token, "send-receipt")
    again = store.complete_step("t1", A, lease.token, "send-receipt")
    # Then the first call records it under its token and the second reports it done
    assert (first, again) == (True, False)
    assert store.completed_steps("t1") == {"send-receipt": lease.token}


def test_a_stale_owner_cannot_record_a_step_for_the_new_owner(store):
    # Given A's lease expired and B took the task over
    a = lease_of(store, "t1", A, ttl=SHORT)
    b = take_over(store, "t1", B)
    assert b.token > a.token
    # When A tries to record a step
    with pytest.raises(LeaseLost):
        store.complete_step("t1", A, a.token, "charge")
    # Then nothing is recorded, and B can still record it under its own token
    assert store.completed_steps("t1") == {}
    assert store.complete_step("t1", B, b.token, "charge") is True
    assert store.completed_steps("t1") == {"charge": b.token}


@pytest.mark.parametrize("how", ["released", "recovering", "finished", "missing"])
def test_no_step_is_recorded_without_a_live_lease(store, how):
    # Given a lease that was released, claimed by recovery, finished, or never existed
    lease = lease_of(store, "t1", A, ttl=SHORT)
    if how == "released":
        store.release(A, {"t1": lease.token})
    elif how == "recovering":
        time.sleep(SHORT + 0.05)
        assert [c.task_id for c in store.claim_expired()] == ["t1"]
    elif how == "finished":
        store.finish("t1", A, lease.token, "succeeded")
    task_id = "other" if how == "missing" else "t1"
    # When the former owner records a step, Then it is refused
    with pytest.raises(LeaseLost):
        store.complete_step(task_id, A, lease.token, "charge")
    assert store.completed_steps(task_id) == {}


def test_the_script_answers_with_contract_codes(store, redis_client):
    # The raw codes, for the header contract: OK, STEP_DONE, LOST, FINISHED, MISSING
    from celery_leases.protocol.calls import call_script
    from celery_leases.protocol.scripts import scripts
    lease = lease_of(store, "t1", A)
    keys = (store.keys.record("t1"),)

    def call(owner, token, step="s", task_keys=keys):
        code, token = call_script(redis_client, scripts.complete_step, task_keys, (owner, token, step))
        return Code(code), token

    assert call(A, lease.token) == (Code.OK, lease.token)
    assert call(A, lease.token) == (Code.STEP_DONE, lease.token)
    assert call(B, lease.token)[0] is Code.LOST
    assert call(A, lease.token + 1)[0] is Code.LOST
    assert call(A, 1, task_keys=(store.keys.record("nope"),))[0] is Code.MISSING
    store.finish("t1", A, lease.token, "succeeded")
    assert call(A, lease.token, "t")[0] is Code.FINISHED


def test_steps_live_exactly_as_long_as_the_record(store, redis_client):
    # Given a recorded step (retention 60 s)
    lease = lease_of(store, "t1", A)
    store.complete_step("t1", A, lease.token, "charge")
    # Then, while the task is unfinished, nothing expires (steps are fields of the record)
    assert redis_client.pttl(store.keys.record("t1")) == -1
    # And once it finishes, record and steps expire together after the retention period
    store.finish("t1", A, lease.token, "succeeded")
    assert 59_000 < redis_client.pttl(store.keys.record("t1")) <= 60_000
    assert store.completed_steps("t1") == {"charge": lease.token}


# -- Lease.once ----------------------------------------------------------------


def test_once_runs_the_step_and_records_it(store):
    # Given an owner's lease handle
    lease = lease_of(store, "t1", A)
    calls = []
    # When it runs a step, then the same step again
    first = lease.once("charge", lambda *a, **kw: calls.append((a, kw)) or "charged", 1, x=2)
    second = lease.once("charge", lambda: calls.append("again") or "again")
    # Then fn ran once with its arguments, its result returned; the repeat is skipped (None)
    assert first == "charged" and second is None
    assert calls == [((1,), {"x": 2})]
    assert store.completed_steps("t1") == {"charge": lease.token}


def test_once_across_a_take_over(store):
    # Given A completed "charge" but not "send-receipt", then lost its lease to B
    a = lease_of(store, "t1", A, ttl=SHORT)
    ran = []
    a.once("charge", ran.append, "A charge")
    b = take_over(store, "t1", B)
    # When B runs both steps
    b.once("charge", ran.append, "B charge")
    b.once("send-receipt", ran.append, "B receipt")
    # Then B skipped the step A completed and ran the one A did not
    assert ran == ["A charge", "B receipt"]
    assert store.completed_steps("t1") == {"charge": a.token, "send-receipt": b.token}


def test_once_refuses_a_stale_owner_before_running_fn(store):
    # Given A's lease was taken over by B
    a = lease_of(store, "t1", A, ttl=SHORT)
    take_over(store, "t1", B)
    ran = []
    # When A asks to run a step, Then LeaseLost and fn never ran
    with pytest.raises(LeaseLost):
        a.once("charge", ran.append, "A")
    assert ran == [] and a.lost


def test_once_raises_lease_lost_when_the_lease_is_lost_while_fn_runs(store):
    # Given A starts a step, and B takes the task over while the step runs
    a = lease_of(store, "t1", A, ttl=SHORT)
    holder = {}

    def slow_step():
        holder["b"] = take_over(store, "t1", B)
        return "A's effect"

    # When A's fn returns, Then recording is refused: LeaseLost, nothing recorded
    with pytest.raises(LeaseLost):
        a.once("charge", slow_step)
    assert a.lost
    assert store.completed_steps("t1") == {}
    # And the new owner runs the step itself
    assert holder["b"].once("charge", lambda: "B's effect") == "B's effect"
    assert store.completed_steps("t1") == {"charge": holder["b"].token}


def test_once_records_nothing_when_fn_raises(store):
    lease = lease_of(store, "t1", A)
    with pytest.raises(ZeroDivisionError):
        lease.once("charge", lambda: 1 / 0)
    assert store.completed_steps("t1") == {}
    assert lease.once("charge", lambda: "retried") == "retried"


def test_once_without_a_lease_just_calls_fn():
    assert DETACHED.once("charge", lambda x: x * 2, 21) == 42
    assert DETACHED.once("charge", lambda: "again") == "again"
    with pytest.raises(ValueError, match="step name"):
        DETACHED.once("", lambda: None)


# -- real workers: a recovery between two owners --------------------------------


def events(history, task_id, event):
    return [h for h in history() if h[0] == event and h[1] == task_id]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_once_across_a_recovery_with_real_workers(pool, client_app, start_worker, history):
    # Given worker A ran step "first" and is inside step "second" (not yet recorded)
    a = start_worker("a", pool=pool, concurrency=1)
    store = celery_leases.store(client_app)
    result = client_app.signature(f"{TASKS}.two_steps", (), {"pause": 3.0}).delay()
    wait_for(lambda: [h for h in events(history, result.id, "step") if h[3]["step"] == "second"],
             10, what="A to enter step second")
    token_a = int(events(history, result.id, "start")[0][3]["token"])
    assert store.completed_steps(result.id) == {"first": token_a}
    # When A is paused past its ttl, the task is recovered and worker B runs it
    a.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: store.expired(), 5, what="A's lease to expire")
        assert store.recover().recovered == 1
        start_worker("b", pool=pool, concurrency=1)
        first, second = result.get(timeout=20)
    finally:
        a.signal(signal.SIGCONT)
    token_b = store.get(result.id).token
    assert token_b > token_a
    # Then B skipped "first" (A completed it) and ran "second" (A had not)
    steps_run = [(int(h[3]["token"]), h[3]["step"]) for h in events(history, result.id, "step")]
    assert steps_run == [(token_a, "first"), (token_a, "second"), (token_b, "second")]
    assert first is None and second == f"second@{token_b}"
    assert store.completed_steps(result.id) == {"first": token_a, "second": token_b}
    # And when A resumes and finishes "second", its record of the step is refused
    refused = wait_for(lambda: events(history, result.id, "refused"), 10, what="A's step to be refused")
    assert int(refused[0][3]["token"]) == token_a
    assert store.completed_steps(result.id) == {"first": token_a, "second": token_b}
    # And the task's accepted outcome stays B's
    record = store.get(result.id)
    assert record.state == "succeeded" and record.token == token_b
    wait_for(lambda: "refused" in a.log(), 10, what="A's log to say its outcome was refused")
