"""proj/settings.py: the Celery and celery-leases part of a Django settings module.

Celery reads every setting that starts with ``CELERY_`` (the namespace given to
``config_from_object``), so celery-leases' ``leases_*`` settings are written in
upper case after it: ``leases_ttl`` becomes ``CELERY_LEASES_TTL``. The rest of
your Django settings (INSTALLED_APPS, DATABASES, ...) stay as they are.

Every ``CELERY_LEASES_*`` setting is optional; docs/configuration.md lists them
with their defaults.
"""
import os

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379/0")

# -- Celery ----------------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_DEFAULT_QUEUE = "proj"

# -- celery-leases ---------------------------------------------------------------
# The Redis holding the leases (default: the broker URL when it is Redis).
CELERY_LEASES_REDIS_URL = REDIS_URL
# Prefix of every lease key: one prefix per project sharing a Redis.
CELERY_LEASES_KEY_PREFIX = "proj"
# A lease lives 60 s without a heartbeat; heartbeats every 20 s (ttl / 3 when unset).
CELERY_LEASES_TTL = 60
# A recovery pass every 10 s (beat entry and the workers' fallback).
CELERY_LEASES_RECOVERY_INTERVAL = 10
# A task that kills its worker 5 times is declared dead ...
CELERY_LEASES_MAX_RECOVERIES = 5
# ... and its message is kept in this queue for inspection.
CELERY_LEASES_DEAD_LETTER_QUEUE = "proj.dead"
# A prefork worker terminates the process of a task whose lease was lost.
CELERY_LEASES_ON_LOST = "terminate"
