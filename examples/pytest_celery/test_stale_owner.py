"""The stale-owner race on a cluster of two leased workers: the frozen owner's late outcome is refused."""
import pytest
from pytest_celery import CeleryWorkerCluster

from celery_leases.testing import pytest_celery as leases
from celery_leases.testing import make_stale, wait_for_lease
from tasks import whoami


@pytest.fixture
def celery_worker_cluster(celery_worker, leases_local_worker):
    cluster = CeleryWorkerCluster(celery_worker, leases_local_worker())
    yield cluster
    cluster.teardown()


def test_a_frozen_owner_past_its_ttl_cannot_overwrite_the_new_owner(celery_setup):
    a, b = celery_setup.worker_cluster
    # Given worker A running the task (B frozen, so A takes it)
    leases.freeze(b)
    result = whoami.s(4).apply_async(queue=a.worker_queue)
    first = wait_for_lease(celery_setup.app, result.id)
    # When A freezes mid-task past its ttl, and its lease is taken: B runs the copy
    leases.freeze(a)
    leases.thaw(b)
    make_stale(celery_setup.app, result.id)
    try:
        # Then B's outcome stands, under a newer token, and A's, once it wakes, is refused
        assert result.get(timeout=60) == b.hostname()
    finally:
        leases.thaw(a)
    a.wait_for_log("refused", timeout=30)  # its outcome of the old token
    record = leases.lease_record(celery_setup, result.id)
    assert record.state == "succeeded" and record.token > first.token
    assert result.get(timeout=10) == b.hostname()
