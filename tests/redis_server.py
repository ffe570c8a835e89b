"""A throwaway ``redis-server`` process for tests.

Tests run against a real server, never fakeredis: the lease scripts depend on
server time, TTLs and persistence. The server binds to loopback only, keeps no
RDB snapshots, and can be killed and restarted on the same port (with AOF on)
by the chaos tests.

The implementation lives in the package, :mod:`celery_leases.processes`
(shared with the pytest plugin, the benchmarks and the examples); this module
keeps the names the suite and ``chaos/`` import.
"""

from __future__ import annotations

from celery_leases.processes import (
    START_TIMEOUT,
    STOP_TIMEOUT,
    RedisServer,
    RedisServerError,
    find_redis_server,
    free_port,
)

__all__ = ["START_TIMEOUT", "STOP_TIMEOUT", "RedisServer", "RedisServerError",
           "find_redis_server", "free_port"]
