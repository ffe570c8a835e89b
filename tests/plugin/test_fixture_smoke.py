"""The test harness itself: a real Redis answers, prefixes are unique, AOF survives restart."""

from __future__ import annotations

import pytest
import redis

from celery_leases.testing.servers import RedisServer

_seen_prefixes: set[str] = set()


def test_throwaway_server_answers_ping(redis_client: redis.Redis) -> None:
    assert redis_client.ping() is True


@pytest.mark.parametrize("attempt", [1, 2])
def test_key_prefix_is_unique_per_test(key_prefix: str, attempt: int) -> None:
    assert key_prefix not in _seen_prefixes
    _seen_prefixes.add(key_prefix)


def test_restart_with_appendonly_preserves_keys(tmp_path, key_prefix: str) -> None:
    # Given a second server with AOF on, holding one key
    server = RedisServer(dir=tmp_path, appendonly=True)
    server.start()
    try:
        port = server.port
        client = server.client()
        client.set(f"{key_prefix}:k", b"v")
        client.close()

        # When it is restarted
        server.restart()

        # Then it is on the same port and the key is still there
        assert server.port == port
        client = server.client()
        assert client.get(f"{key_prefix}:k") == b"v"
        client.close()
    finally:
        server.stop()
    assert not server.running
