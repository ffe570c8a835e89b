#!/usr/bin/env python
"""Show the lease configuration a Django project gets: ``python examples/django/run.py``.

Loads ``proj/celery.py`` (the app configured from ``proj/settings.py`` with the
``CELERY`` namespace, as Django projects do) and prints:

- every ``leases_*`` setting in effect, under its Django name, with where its
  value came from (the settings module, or the default);
- the beat schedule (the ``celery_leases.recover`` entry ``install()`` adds when the
  workers run no recovery of their own);
- the leased tasks and the lease settings each one gets (task options win);
- with ``$REDIS_URL`` set, whether the lease store answers there (what a worker
  checks at start).

Needs no Django, no Redis (unless ``$REDIS_URL`` is set) and no worker. Exits
0 when the configuration is valid (and the lease store answers, if asked).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def redact(url: str) -> str:
    parts = urlsplit(url or "")
    if parts.password:
        return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()
    return url


def main() -> int:
    sys.path.insert(0, str(HERE))
    try:
        import celery_leases
    except ImportError:      # run from a checkout without installing the package
        sys.path.insert(1, str(REPO))
        import celery_leases
    from proj import settings
    from proj.celery import app

    from celery_leases.config import SETTINGS, TASK_OPTIONS, get_config

    try:
        config = get_config(app)
    except celery_leases.ConfigurationError as exc:
        print(f"invalid lease configuration in proj/settings.py: {exc}")
        return 1
    app.loader.import_default_modules()   # what a worker does at start: autodiscover proj.tasks

    print("effective lease configuration (celery_leases.config.get_config(app)):\n")
    rows = [("setting", "value", "from")]
    # Only the settings: LeaseConfig also carries internal fields (which transport
    # options setting was used, deferred worker errors) that are no setting of their own.
    for f in (f for f in dataclasses.fields(config) if f.name in SETTINGS):
        name = f"CELERY_LEASES_{f.name.upper()}"
        value = getattr(config, f.name)
        if hasattr(settings, name):
            origin = "proj/settings.py"
        elif f.name == "heartbeat_interval":
            origin = "default: ttl / 3"
        else:
            origin = "default"
        shown = repr(redact(value) if f.name == "redis_url" else value)
        rows.append((name, shown, origin))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(row, width)).rstrip())

    print("\nbeat schedule:")
    for name, entry in (app.conf.beat_schedule or {}).items():
        print(f"  {name}: task {entry['task']} every {float(entry['schedule']):g}s")
    if "celery_leases.recover" not in (app.conf.beat_schedule or {}):
        print("  (no celery_leases.recover entry: the workers run the recovery passes, "
              "CELERY_LEASES_WORKER_RECOVERY)")

    print("\nleased tasks (a task's lease_* options win over the settings):")
    for name in sorted(app.tasks):
        task = app.tasks[name]
        if not getattr(task, "leased", False):
            continue
        own = {opt: getattr(task, opt) for opt in TASK_OPTIONS if getattr(task, opt, None) is not None}
        effective = config.for_task(task)
        progress = f"{effective.progress_timeout:g}s" if effective.progress_timeout else "off"
        print(f"  {name}: ttl {effective.ttl:g}s, heartbeat every {effective.heartbeat_interval:g}s, "
              f"progress timeout {progress}, max recoveries {effective.max_recoveries}"
              + (f"  (task options: {', '.join(f'{k}={v}' for k, v in own.items())})" if own else ""))

    if os.environ.get("REDIS_URL"):
        store = celery_leases.store(app)
        try:
            store.server_time_ms()
        except celery_leases.LeaseError as exc:
            print(f"\nlease store NOT reachable: {exc}")
            return 1
        print(f"\nlease store reachable at {store.description} (key prefix {config.key_prefix!r})")
    print("\nOK: the CELERY_LEASES_* settings are valid.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
