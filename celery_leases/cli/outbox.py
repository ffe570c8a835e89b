"""``celery leases outbox init | relay | status``: the transactional outbox's table and relay.

The database is ``leases_outbox_url`` (``--url`` overrides it), the table
``leases_outbox_table``. ``init`` creates the table and its parked table (``--print``
only prints the statements, for a migration tool); ``relay`` runs one relay in the
foreground until Ctrl-C or SIGTERM (``--once``: drain the outbox and exit); ``status``
prints the rows waiting, the oldest one's age and the parked rows.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

import click

from ..config import client_config
from ..exceptions import ConfigurationError
from ..outbox.database import Database
from ..outbox.relay import Relay
from ..protocol.connection import redact
from .base import LeasesCommand, _command, _emit_json, json_option
from .format import table

_URL_HELP = "The outbox's database (default: leases_outbox_url)."


def _database(ctx: click.Context, url: str | None) -> Database:
    config = client_config(ctx.obj.app)
    url = url or ctx.obj.app.conf.get("leases_outbox_url")
    if not url:
        raise ConfigurationError("leases_outbox_url is not set (and no --url given): name the database "
                                 "of the outbox, e.g. postgresql://app@db/app or sqlite:///app.db")
    try:
        return Database(url, config.outbox_table)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


def _db_errors(fn: Any) -> Any:
    """A database error is one line and exit status 1 (``_command`` handles the others)."""
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(ctx, *args, **kwargs)
        except (ConfigurationError, click.exceptions.Exit, BrokenPipeError):
            raise
        except ImportError as exc:
            raise ConfigurationError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the driver's error, named
            if type(exc).__module__.split(".")[0] in ("psycopg", "psycopg2", "sqlite3", "pymysql", "MySQLdb"):
                raise OSError(f"{type(exc).__name__}: {exc}") from None
            raise
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


@click.group(name="outbox")
def outbox() -> None:
    """The transactional outbox: init (create the table), relay, status."""


@outbox.command(cls=LeasesCommand)
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--print", "print_only", is_flag=True, help="Print the statements; run nothing.")
@json_option
@click.pass_context
@_command
@_db_errors
def init(ctx: click.Context, url: str | None, print_only: bool, as_json: bool) -> None:
    """Create the outbox table and its parked table (if they do not exist)."""
    database = _database(ctx, url)
    if print_only:
        statements = database.dialect.create(database.table)
    else:
        statements = database.create()
    if as_json:
        _emit_json({"database": str(database), "table": str(database.table), "statements": statements,
                    "ran": not print_only})
        return
    if print_only:
        click.echo(";\n".join(statements) + ";")
        return
    click.echo(f"outbox table {database.table} (and {database.table}_parked) ready in {database}")


@outbox.command(cls=LeasesCommand)
@click.option("--url", default=None, help=_URL_HELP)
@click.option("--once", is_flag=True, help="Publish every row there now, then exit.")
@click.option("--poll-interval", type=click.FloatRange(min=0.01), default=None,
              help="Seconds between looks at the outbox (default: leases_outbox_poll_interval).")
@json_option
@click.pass_context
@_command
@_db_errors
def relay(ctx: click.Context, url: str | None, once: bool, poll_interval: float | None, as_json: bool) -> None:
    """Run an outbox relay in the foreground (workers run one each when leases_outbox_url is set)."""
    database = _database(ctx, url)
    config = client_config(ctx.obj.app)
    interval = poll_interval or ctx.obj.app.conf.get("leases_outbox_poll_interval") or config.outbox_poll_interval
    runner = Relay(ctx.obj.app, database.url, str(database.table), float(interval))
    if once:
        try:
            published = runner.run_once()
        finally:
            runner.close()
        if as_json:
            _emit_json({"published": published, "parked": runner.parked})
        else:
            click.echo(f"published {published}, parked {runner.parked}")
        return
    done = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    click.echo(f"outbox relay: {redact(database.url)}, table {database.table}, every {interval:g}s; "
               f"Ctrl-C stops it", err=True)
    runner.start()
    while not done.wait(1.0):
        pass
    runner.stop()
    click.echo(f"outbox relay stopped: published {runner.published}, parked {runner.parked}", err=True)


@outbox.command(cls=LeasesCommand)
@click.option("--url", default=None, help=_URL_HELP)
@json_option
@click.pass_context
@_command
@_db_errors
def status(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """Rows waiting in the outbox, the oldest one's age, and the parked rows."""
    database = _database(ctx, url)
    runner = Relay(ctx.obj.app, database.url, str(database.table))
    try:
        found = runner.status()
    finally:
        runner.close()
    if as_json:
        _emit_json({"database": str(database), "table": str(database.table), **found.as_dict()})
        return
    age = "-" if found.oldest_age is None else f"{found.oldest_age:.1f}s"
    click.echo(table(("TABLE", "WAITING", "OLDEST", "PARKED"),
                     [(str(database.table), found.depth, age, found.parked)]))
