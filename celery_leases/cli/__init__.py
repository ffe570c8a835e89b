"""``celery -A proj leases <command>``: inspect and maintain the leases of an app.

Registered through the ``celery.commands`` entry point (setup.py). Every
command reads the app's ``leases_*`` settings, talks to the lease store (``ls
--workers`` asks the workers, by Celery's remote control), prints a table
(``--json``: JSON) and measures times on the Redis server's clock, like the
scripts do. Errors are one line on stderr and a non-zero exit status: 1 (no
such record, a failed publish, anything else; ``doctor``: findings), 69 (the
lease store is unreachable), 78 (a configuration error, as a worker); under ``--json`` that line is a JSON object, on
stderr too. A closed stdout (``| head``) ends a command quietly with status
141, as SIGPIPE would. Passwords of the app's URLs never appear in output.
"""
from __future__ import annotations

from typing import Any

import click

from . import doctor, inspect_leases, maintenance, outbox, show

# Celery's command line imports this module (its celery.commands entry point) before it loads
# -A proj, in its own process only: there `celery inspect leases` prints tables.
inspect_leases.install()


# -- the command group --------------------------------------------------------------


@click.group(name="leases")
@click.pass_context
def leases(ctx: click.Context, **kwargs: Any) -> None:
    """Inspect and maintain the leases of the app (-A): ls, show, stats, top, doctor, recover,
    parked, replay, purge, outbox."""


# ``leases ls/show/stats/top/doctor`` read; ``leases recover/purge/parked/replay`` change the store.
for command in (show.ls, show.show, show.stats, show.top, doctor.doctor, maintenance.recover, maintenance.purge,
                maintenance.parked, maintenance.replay):
    leases.add_command(command)
leases.add_command(outbox.outbox)
