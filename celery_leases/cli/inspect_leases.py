"""``celery -A proj inspect leases`` prints each worker's held leases as a table.

Celery's ``celery inspect`` prints each worker's reply with ``CLIContext.pretty``
(celery/bin/base.py), which is not told the command: a list becomes one repr
per line. Celery has no per-command printing hook, so Celery's command line,
which imports this package's ``celery.commands`` entry point (cli/__init__.py)
before it loads ``-A proj``, gets that method wrapped (patches.py); no other
process imports the command line. The
wrapper prints a reply as the table of ``format.held_row`` only while the
``inspect`` command runs ``leases`` and the reply is a list of leases; every
other reply (other commands, an empty list, the error a worker without
celery-leases answers) goes to Celery's method. With ``--json`` Celery prints
``json.dumps(replies)`` without calling it, so machines get the reply as the
workers sent it, as ``app.control.broadcast("leases", reply=True)`` does.
"""
from __future__ import annotations

from typing import Any

import click

from .. import patches
from ..worker.control import COMMAND
from .format import HELD_HEADERS, held_row, table

__all__ = ["NAME", "install", "render"]

#: The change's name in patches.py.
NAME = "celery.bin.base.CLIContext.pretty"


def render(leases: list[dict]) -> str:
    """One worker's held leases as ``celery inspect leases`` prints them.

    Deadlines stay the reply's ISO times: reading the store's clock to show
    them relative would make ``inspect`` depend on the store, which the
    workers' answer does not.
    """
    return table(HELD_HEADERS, [held_row(entry, None) for entry in leases])


def install() -> bool:
    """Wrap ``CLIContext.pretty`` once per process (patches.py); True if it was now."""
    from celery.bin.base import CLIContext

    original = CLIContext.pretty

    def pretty(self: Any, n: Any) -> Any:
        if _is_leases_reply(n):
            return self.OK, render(n)
        return original(self, n)

    pretty.__wrapped__ = original  # type: ignore[attr-defined]
    pretty.__doc__ = original.__doc__
    return patches.patch(NAME, CLIContext, "pretty", pretty)


def _is_leases_reply(reply: Any) -> bool:
    """True for a worker's non-empty list of leases while ``celery inspect leases`` prints it."""
    if not (isinstance(reply, list) and reply
            and all(isinstance(entry, dict) and "task_id" in entry for entry in reply)):
        return False
    # The reply alone could be another command's list of dicts: ask click which command runs.
    ctx = click.get_current_context(silent=True)
    return (ctx is not None and ctx.command.name == "inspect"
            and ctx.params.get("command") == COMMAND)
