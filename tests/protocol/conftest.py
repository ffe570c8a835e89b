"""Fixtures of the protocol tests: LeaseStores on the test's own key prefix."""
from __future__ import annotations

import pytest
import redis

from celery_leases import LeaseStore
from tests.protocol.scripts_support import TTL


@pytest.fixture
def make_store(redis_server_url, key_prefix):
    """Build LeaseStores on the test's prefix, each with its own client."""
    clients = []

    def make(**kwargs) -> LeaseStore:
        client = redis.Redis.from_url(redis_server_url)
        clients.append(client)
        kwargs.setdefault("ttl", TTL)
        return LeaseStore(client, prefix=key_prefix, **kwargs)

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def store(make_store) -> LeaseStore:
    return make_store()


