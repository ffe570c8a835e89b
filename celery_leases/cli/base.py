"""What every ``celery leases`` command shares: the store, exit statuses, errors without secrets."""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import Any, Callable, Iterable
from urllib.parse import unquote, urlsplit

import click
import redis
from celery.bin.base import CeleryCommand

from ..protocol.codes import STATES
from ..protocol.keys import usable_id
from ..config import client_config
from ..exceptions import ConfigurationError, CorruptRecord, LeaseError, LeaseUnavailable
from ..protocol.store import LeaseStore
from .counters import COUNTERS as _COUNTERS

logger = logging.getLogger("celery_leases.cli")

#: Exit status when the lease store cannot be reached (sysexits EX_UNAVAILABLE, as Celery uses).
EX_UNAVAILABLE = 69
#: Exit status of a configuration error (a ``leases_*`` setting, the lease store's URL): sysexits
#: EX_CONFIG, what a worker refused for the same error exits with.
EX_CONFIG = 78
#: ``ls --state`` choices: the six states, all finished ones, or every record.
STATE_CHOICES = (*STATES, "finished", "all")
#: Lifetime counters of ``LeaseStore.stats()`` (counters.py: each with what it counts), shown as 0
#: until they first move.
COUNTERS = tuple(_COUNTERS)


class NotFound(LeaseError):
    """Raised when a command names a task that has no lease record."""


# -- plumbing -------------------------------------------------------------------


def _secrets(app: Any) -> list[str]:
    """Passwords in the app's URLs and transport options: scrubbed from everything the CLI prints.

    A second line of defence: messages are built with ``connection.redact`` and
    ``describe`` already, but an error text from redis-py or kombu is not ours.
    """
    found: list[str] = []
    for name in ("broker_url", "result_backend", "leases_redis_url"):
        urls = app.conf.get(name)
        for url in urls if isinstance(urls, (list, tuple)) else [urls]:
            if isinstance(url, str):
                for part in url.split(";"):
                    try:
                        password = urlsplit(part.strip()).password
                    except ValueError:
                        password = None
                    if password:
                        found += [password, unquote(password)]
    for name in ("leases_redis_transport_options", "broker_transport_options",
                 "result_backend_transport_options"):
        options = app.conf.get(name)
        if isinstance(options, dict):
            for holder in (options, options.get("sentinel_kwargs")):
                if isinstance(holder, dict) and isinstance(holder.get("password"), str):
                    found.append(holder["password"])
    # Longest first, so a password containing another is replaced whole.
    return sorted({s for s in found if s}, key=len, reverse=True)


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return " ".join(text.split())  # one line


#: Exit status after the reader of stdout went away (``| head``): a shell's status for SIGPIPE.
EX_PIPE = 128 + 13


def _error_kind(exc: BaseException) -> str:
    """The ``kind`` of a JSON error: not_found, unavailable, corrupt, configuration or error."""
    if isinstance(exc, NotFound):
        return "not_found"
    if isinstance(exc, LeaseUnavailable):
        return "unavailable"
    if isinstance(exc, CorruptRecord):
        return "corrupt"
    if isinstance(exc, ConfigurationError):
        return "configuration"
    return "error"


def _quiet_pipe_exit() -> None:
    """stdout's reader closed the pipe: exit quietly, as a Unix tool killed by SIGPIPE would.

    stdout is pointed at /dev/null first, so the interpreter's flush at exit
    does not raise (and print) the same BrokenPipeError again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    raise SystemExit(EX_PIPE)


def _command(fn: Callable) -> Callable:
    """Run a subcommand; expected failures become one line on stderr and an exit status.

    With ``--json`` the line is a JSON object, ``{"error": ..., "kind": ...,
    "command": ..., "status": ...}``, still on stderr: stdout carries only
    data, so ``... --json | jq`` never parses an error as a result.
    """
    @functools.wraps(fn)
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        error: BaseException
        try:
            result = fn(ctx, *args, **kwargs)
            sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
            return result
        except BrokenPipeError:
            _quiet_pipe_exit()
        except NotFound as exc:
            status, message, error = 1, str(exc), exc
        except LeaseUnavailable as exc:
            status, message, error = EX_UNAVAILABLE, str(exc), exc
        except ConfigurationError as exc:
            status, message, error = EX_CONFIG, str(exc), exc
        except (LeaseError, redis.RedisError, OSError) as exc:
            status, message, error = 1, str(exc) or type(exc).__name__, exc
        logger.debug("celery leases %s failed", ctx.info_name, exc_info=True)
        message = _scrub(message, _secrets(ctx.obj.app))
        if kwargs.get("as_json"):
            click.echo(json.dumps({"error": message, "kind": _error_kind(error),
                                   "command": ctx.info_name, "status": status}), err=True)
        else:
            click.echo(f"celery leases {ctx.info_name}: error: {message}", err=True)
        ctx.exit(status)
    return wrapper


def _store(ctx: click.Context) -> LeaseStore:
    from ..install import store
    return store(ctx.obj.app)


def _prefix(ctx: click.Context) -> str:
    return client_config(ctx.obj.app).key_prefix


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


class HelpArgument(click.Argument):
    """A click argument with a ``help`` text (click's own arguments take none)."""

    def __init__(self, *args: Any, help: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = help

    def get_help_record(self, ctx: click.Context) -> tuple[str, str]:
        try:
            metavar = self.make_metavar(ctx)  # click >= 8.2
        except TypeError:
            metavar = self.make_metavar()  # type: ignore[call-arg]
        return metavar, self.help or ""


def task_id_argument(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Click callback of a TASK_ID argument: an id no record can have is a usage error
    (exit 2, naming the argument), not a lookup."""
    if not usable_id(value):
        raise click.BadParameter(f"{value!r} is not a task id: it must be a non-empty UTF-8 string")
    return value


class LeasesCommand(CeleryCommand):
    """Celery's command class, with arguments listed as arguments: never under "Options".

    Click 8.5 lists documented arguments itself ("Positional arguments");
    under an older click this adds the section.
    """

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        params = self.get_params(ctx)
        if not hasattr(click.Command, "format_arguments"):
            arguments = [p.get_help_record(ctx) for p in params if isinstance(p, click.Argument)]
            if any(arguments):
                with formatter.section("Arguments"):
                    formatter.write_dl([record for record in arguments if record])
        options = [p.get_help_record(ctx) for p in params if not isinstance(p, click.Argument)]
        if any(options):
            with formatter.section("Options"):
                formatter.write_dl([record for record in options if record])


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
