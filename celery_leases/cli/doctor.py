"""``celery leases doctor``: one line per finding, exit 0 when healthy, 1 with findings."""
from __future__ import annotations

import click

from ..ops.diagnosis import OK, StoreUnreachable, diagnose
from .base import LeasesCommand, EX_UNAVAILABLE, _command, _emit_json, _prefix, _scrub, _secrets, json_option


@click.command(cls=LeasesCommand)
@click.option("--scan/--no-scan", default=True, show_default=True,
              help="Read every record (SCAN MATCH on the record prefix) for corrupt and stuck ones; "
                   "--no-scan looks for stuck leases in the deadline index only.")
@click.option("--observe", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Watch the recovery passes take their turns for this long and report their "
                   "cadence (default: until one turn is seen, at most leases_recovery_interval "
                   "+ 0.5 s; 0: one look).")
@click.option("--stuck-after", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="A lease due for longer than this is stuck (default: 3 recovery intervals, "
                   "at least 10 s).")
@click.option("--quiet", "-q", is_flag=True, help="Print only the findings (ERROR, WARNING), not OK "
                                                  "and INFO lines.")
@json_option
@click.pass_context
@_command
def doctor(ctx: click.Context, scan: bool, observe: float | None, stuck_after: float | None,
           quiet: bool, as_json: bool) -> None:
    """Check the deployment: settings, Redis, clock, records, parked deliveries, recovery.

    Prints one line per check: its level (ERROR, WARNING, INFO, OK), what it
    found, and what to do. Exits 0 when there is no ERROR or WARNING, 1 when
    there is, 69 when the lease store is unreachable.
    """
    app = ctx.obj.app
    status = 0
    try:
        findings = diagnose(app, scan=scan, observe=observe, stuck_after=stuck_after)
    except StoreUnreachable as exc:
        findings, status = exc.findings, EX_UNAVAILABLE
    secrets = _secrets(app)
    counted = [f for f in findings if f.counts]
    status = status or (1 if counted else 0)
    if as_json:
        _emit_json({"prefix": _prefix(ctx), "healthy": not counted, "status": status,
                    "findings": [{**f.as_dict(), "what": _scrub(f.message, secrets)} for f in findings]})
    else:
        for f in findings:
            if quiet and not f.counts:
                continue
            line = f"{f.severity:<8} {f.check:<19} {_scrub(f.message, secrets)}"
            if f.todo and f.severity != OK:
                line += f"; do: {f.todo}"
            click.echo(line)
        errors = sum(f.severity == "ERROR" for f in findings)
        click.echo(f"{'unhealthy' if counted else 'healthy'}: {errors} error(s), "
                   f"{len(counted) - errors} warning(s)")
    if status:
        ctx.exit(status)
