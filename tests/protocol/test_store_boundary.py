"""The store's typed boundary: StoreSettings, AcquireRequest and FinishRequest, beside the
keyword forms callers used before (which keep working)."""
from __future__ import annotations

import dataclasses

import pytest
import redis

from celery_leases import Code, LeaseStore
from celery_leases.exceptions import LeaseLost
from celery_leases.protocol.queued import QueuedTasks
from celery_leases.protocol.store import AcquireRequest, FinishRequest, StoreSettings
from celery_leases.protocol.transitions import acquire_call, finish_call


@pytest.fixture
def client(redis_server_url):
    client = redis.Redis.from_url(redis_server_url)
    yield client
    client.close()


def test_settings_or_keywords_give_the_same_store(client, key_prefix):
    # Given one store built from keywords and one from a StoreSettings
    by_keywords = LeaseStore(client, key_prefix, ttl=5, retention=60, max_recoveries=2, shards=4)
    by_settings = LeaseStore(client, key_prefix, settings=StoreSettings(ttl=5, retention=60, max_recoveries=2,
                                                                        shards=4))
    # Then they hold the same settings
    assert by_keywords.settings == by_settings.settings
    settings = by_settings.settings
    assert (settings.ttl, settings.retention, settings.max_recoveries, by_settings.shards) == (5, 60, 2, 4)
    # And their scripts get the same KEYS and ARGV (sharded: tokens ordered by the clock)
    req = AcquireRequest("t1", "w", body=b"b", envelope={"x": 1})
    assert acquire_call(by_keywords, req) == acquire_call(by_settings, req)
    assert acquire_call(by_settings, req)[2][11] == 1


def test_a_keyword_other_than_its_default_wins_over_settings(client, key_prefix):
    store = LeaseStore(client, key_prefix, settings=StoreSettings(ttl=5, retention=60), retention=7)
    assert (store.settings.ttl, store.settings.retention) == (5, 7)


def test_publish_tracking_sets_the_delivery_timeout_in_the_store_s_settings(client, key_prefix):
    store = LeaseStore(client, key_prefix)
    QueuedTasks(store, 12.5)
    assert store.settings.delivery_timeout == 12.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        store.settings.ttl = 1  # type: ignore[misc]


def test_acquire_many_takes_requests_and_mappings_alike(client, key_prefix):
    # Given one acquire as a request and one as keyword arguments
    store = LeaseStore(client, key_prefix, ttl=30)
    results, marked = store.acquire_many([AcquireRequest("a", "w", name="proj.add"),
                                          dict(task_id="b", owner="w", name="proj.add")])
    # Then both are acquired, as acquire() would
    assert [r.code for r in results] == [Code.ACQUIRED, Code.ACQUIRED] and marked == 0
    assert store.get("a").owner == store.get("b").owner == "w"
    # And the packed form of a request is the packed form of its keywords
    assert store.acquire_parts(AcquireRequest("c", "w")) == store.acquire_parts(task_id="c", owner="w")


def test_a_finish_request_is_the_finish(client, key_prefix):
    store = LeaseStore(client, key_prefix, ttl=30)
    acq = store.acquire("t1", "w")
    req = FinishRequest("t1", "w", acq.token, "succeeded")
    assert finish_call(store, req) == finish_call(store, dataclasses.replace(req))
    store.finish_request(req)
    assert store.get("t1").state == "succeeded"
    with pytest.raises(LeaseLost):
        store.finish_request(dataclasses.replace(req, token=acq.token - 1))
    with pytest.raises(ValueError, match="unknown outcome"):
        store.finish_request(dataclasses.replace(req, outcome="maybe"))


def test_the_store_reads_its_settings_from_one_home_and_refuses_to_shadow_them(client, key_prefix):
    # Given a store built with its settings
    store = LeaseStore(client, prefix=key_prefix, ttl=7, max_recoveries=2)
    # Then each setting reads through the store from store.settings
    assert (store.ttl, store.max_recoveries) == (store.settings.ttl, store.settings.max_recoveries) == (7, 2)
    # And assigning one on the store (which would change nothing) is refused, naming the way
    with pytest.raises(AttributeError, match=r"ttl is a setting of the store.*dataclasses.replace"):
        store.ttl = 3
    assert store.settings.ttl == 7
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        store.nonsense  # noqa: B018 - the read is the test
