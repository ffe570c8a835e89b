"""charge_death: what a dead owner's lease costs its task, on a real redis-server.

A death is the task's own on a pool of one task per process, or when it ran alone
(``mark_started(alone=True)``); a death it shared with other tasks of one process, or
before its start mark, is uncertain: no recovery, a bounded uncertain one, and the task's
next runs are isolated (``Acquisition.isolate``) from the second such death on.
"""
from __future__ import annotations

from celery_leases import Code
from tests.protocol.scripts_support import A, B, SHORT, acquire, wait_out


def _die(store, task_id, owner, *, shared, alone=False, started=True, generation=0, **kwargs):
    """``owner`` acquires (and marks) the task, then dies: a recovery pass claims it."""
    acq = acquire(store, task_id, owner, ttl=SHORT, generation=generation, started=False,
                  shared=shared, **kwargs)
    assert acq.owned, acq
    if started:
        assert store.mark_started(owner, {task_id: acq.token}, alone=alone) == 1
    wait_out()
    (claim,) = store.claim_expired(ids=[task_id])
    if claim.code is Code.RECOVERED:
        store.mark_published([claim])
    return acq, claim


def test_a_death_shared_with_other_tasks_counts_no_recovery(make_store):
    # Given a task running beside others on a threads worker (shared), when that worker dies
    store = make_store(max_recoveries=1)
    acq, claim = _die(store, "t", A, shared=True)

    # Then it is not charged a recovery, only an uncertain one, and it runs again as usual
    # (one death from outside, an OOM kill or a deploy, isolates nothing)
    assert not acq.isolate
    assert (claim.code, claim.recoveries) == (Code.RECOVERED, 0)
    record = store.get("t")
    assert (record.unstarted_recoveries, record.isolate) == (1, False)
    again = acquire(store, "t", B, generation=claim.generation, started=False, shared=True)
    assert again.owned and not again.isolate


def test_a_second_uncertain_death_isolates_the_task(make_store):
    # Given a task that died beside others twice
    store = make_store(max_recoveries=1)
    _, first = _die(store, "t", A, shared=True)
    _, second = _die(store, "t", B, shared=True, generation=first.generation)
    # Then still no recovery is charged, and every later run is isolated
    assert (second.code, second.recoveries) == (Code.RECOVERED, 0)
    record = store.get("t")
    assert (record.unstarted_recoveries, record.isolate) == (2, True)
    again = acquire(store, "t", A, generation=second.generation, started=False, shared=True)
    assert again.owned and again.isolate


def test_a_death_while_running_alone_is_the_tasks_own(make_store):
    # Given a pill isolated after two deaths beside others on a shared-process worker
    store = make_store(max_recoveries=1)
    _, first = _die(store, "pill", A, shared=True)
    _, second = _die(store, "pill", B, shared=True, generation=first.generation)
    # When it kills its worker max_recoveries + 1 times, each time alone
    _, third = _die(store, "pill", B, shared=True, alone=True, generation=second.generation)
    _, fourth = _die(store, "pill", A, shared=True, alone=True, generation=third.generation)

    # Then each of those deaths counts, and it is dead after max_recoveries recoveries
    assert (third.code, third.recoveries) == (Code.RECOVERED, 1)
    assert fourth.code is Code.DEAD
    record = store.get("pill")
    assert (record.state, record.recoveries, record.unstarted_recoveries) == ("dead", 1, 2)


def test_a_pool_of_one_task_per_process_keeps_its_exact_blame(make_store):
    # Given prefork or solo (not shared): a started lease's death is its own
    store = make_store(max_recoveries=1)
    _, first = _die(store, "p", A, shared=False)
    assert (first.recoveries, store.get("p").isolate) == (1, False)
    _, second = _die(store, "p", B, shared=False, generation=first.generation)
    assert second.code is Code.DEAD


def test_unmarked_deaths_isolate_the_task_so_its_next_death_is_exact(make_store):
    # Given a body that killed its (solo) worker twice before its start mark went out
    store = make_store(max_recoveries=0)
    _, first = _die(store, "quick", A, shared=False, started=False)
    _, second = _die(store, "quick", A, shared=False, started=False, generation=first.generation)
    assert (second.code, second.recoveries) == (Code.RECOVERED, 0)

    # When the next run, isolated, is marked started before its body and dies again
    again = acquire(store, "quick", B, generation=second.generation, started=False, ttl=SHORT)
    assert again.isolate
    assert store.mark_started(B, {"quick": again.token}, alone=True) == 1
    wait_out()
    (claim,) = store.claim_expired(ids=["quick"])

    # Then that death counts: with max_recoveries 0 the task is dead after one own death,
    # not after the 4 * (0 + 1) uncertain ones an unmarked run is allowed
    assert claim.code is Code.DEAD


def test_a_take_over_charges_a_shared_death_as_a_recovery_pass_would(make_store):
    # Given a lease of a shared-process worker, started beside others, expired unclaimed twice
    store = make_store(max_recoveries=0)
    acquire(store, "t", A, ttl=SHORT, shared=True)
    wait_out()
    # When restored copies take it over (no recovery pass ran)
    took = acquire(store, "t", B, ttl=SHORT, shared=True)
    # Then it is not dead (max_recoveries 0 would have made a counted death fatal)
    assert (took.code, took.recoveries, took.isolate) == (Code.TAKEN_OVER, 0, False)
    wait_out()
    again = acquire(store, "t", A, started=False, shared=True)
    # And the second uncertain death isolates it
    assert (again.code, again.recoveries, again.isolate) == (Code.TAKEN_OVER, 0, True)
    assert store.get("t").unstarted_recoveries == 2


def test_uncertain_deaths_keep_a_bound(make_store):
    # Given a task that shares every death (never run alone), max_recoveries 0: the bound is 4
    store = make_store(max_recoveries=0)
    codes, generation = [], 0
    for owner in [A, B, A, B, A]:
        _, claim = _die(store, "t", owner, shared=True, generation=generation)
        codes.append(claim.code)
        generation = claim.generation
        if claim.code is Code.DEAD:
            break
    # Then it is recovered 4 times, then dead: nothing is recovered without end
    assert codes == [Code.RECOVERED] * 4 + [Code.DEAD]


def test_a_new_publish_of_a_finished_task_starts_without_isolation(make_store):
    # Given a task isolated by two uncertain deaths, then finished
    store = make_store(max_recoveries=1)
    _, first = _die(store, "t", A, shared=True, publish="p1")
    _, claim = _die(store, "t", B, shared=True, publish="p1", generation=first.generation)
    acq = acquire(store, "t", B, generation=claim.generation, shared=True, publish="p1")
    assert acq.isolate
    store.finish("t", B, acq.token, "succeeded")
    # When the task id is published again (a new run)
    rerun = acquire(store, "t", A, shared=True, publish="p2")
    # Then that run starts with a clean slate
    assert rerun.owned and not rerun.isolate and not store.get("t").isolate


def _isolated(store, task_id):
    """A task isolated by two deaths beside others; the claim of the second."""
    _, first = _die(store, task_id, A, shared=True)
    _, second = _die(store, task_id, B, shared=True, generation=first.generation)
    return second


def test_an_isolated_task_that_dies_before_its_mark_is_charged_nothing(make_store):
    # Given an isolated task (two uncertain deaths), max_recoveries 0
    store = make_store(max_recoveries=0)
    claim = _isolated(store, "t")
    # When its worker dies three times while it waits for its turn (held, never marked:
    # an isolated body runs only after its alone mark)
    for owner in (A, B, A):
        _, claim = _die(store, "t", owner, shared=True, started=False, generation=claim.generation)
        # Then each death is another task's: no recovery, no uncertain one, still isolated
        assert (claim.code, claim.recoveries) == (Code.RECOVERED, 0)
    record = store.get("t")
    assert (record.unstarted_recoveries, record.waited_deaths, record.isolate) == (2, 3, True)
    # And its isolated run, when it comes, is charged exactly: with max_recoveries 0 its own
    # death makes it dead
    again = acquire(store, "t", B, generation=claim.generation, started=False, ttl=SHORT, shared=True)
    assert again.isolate
    assert store.mark_started(B, {"t": again.token}, alone=True) == 1
    wait_out()
    (last,) = store.claim_expired(ids=["t"])
    assert last.code is Code.DEAD


def test_a_take_over_charges_a_waited_death_as_a_recovery_pass_would(make_store):
    # Given an isolated task whose owner died before its mark, expired unclaimed
    store = make_store(max_recoveries=0)
    claim = _isolated(store, "t")
    acquire(store, "t", A, ttl=SHORT, generation=claim.generation, started=False, shared=True)
    wait_out()
    # When a restored copy takes it over
    took = acquire(store, "t", B, generation=claim.generation, started=False, shared=True)
    # Then it is charged nothing, counted as waited, and still isolated
    assert (took.code, took.recoveries, took.isolate) == (Code.TAKEN_OVER, 0, True)
    record = store.get("t")
    assert (record.unstarted_recoveries, record.waited_deaths) == (2, 1)


def test_waited_deaths_keep_a_bound(make_store):
    # Given an isolated task, max_recoveries 0: waited deaths are bounded at 4 x 4 = 16
    store = make_store(max_recoveries=0)
    claim = _isolated(store, "t")
    codes = []
    for n in range(17):
        _, claim = _die(store, "t", (A, B)[n % 2], shared=True, started=False,
                        generation=claim.generation)
        codes.append(claim.code)
        if claim.code is Code.DEAD:
            break
    # Then a worker that keeps dying of something else does not hand it round without end
    assert codes == [Code.RECOVERED] * 16 + [Code.DEAD]
    record = store.get("t")
    assert (record.state, record.waited_deaths) == ("dead", 17)


def test_a_new_publish_of_a_finished_task_forgets_its_waited_deaths(make_store):
    store = make_store(max_recoveries=1)
    _, first = _die(store, "t", A, shared=True, publish="p1")
    _, second = _die(store, "t", B, shared=True, publish="p1", generation=first.generation)
    _, waited = _die(store, "t", A, shared=True, started=False, publish="p1",
                     generation=second.generation)
    assert store.get("t").waited_deaths == 1
    acq = acquire(store, "t", B, generation=waited.generation, shared=True, publish="p1")
    store.finish("t", B, acq.token, "succeeded")
    rerun = acquire(store, "t", A, shared=True, publish="p2")
    assert rerun.owned and store.get("t").waited_deaths == 0
