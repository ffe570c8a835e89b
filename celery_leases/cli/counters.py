"""The lifetime counters ``celery leases stats`` prints, each with what it counts.

The counters live in the store's stats hash (``{p}:stats``, one per shard,
summed: protocol/admin.py), incremented by the scripts as things happen,
cluster-wide and for the life of the prefix (they never reset). ``COUNTERS``
gives the order ``stats`` prints them in and the one line ``stats --help`` and
``stats --explain`` show for each; docs/operations.md has the same table (a
test keeps them equal). A counter the scripts add later is printed after these,
unexplained, rather than hidden.
"""
from __future__ import annotations

import click

__all__ = ["COUNTERS", "explain", "StatsHelp"]

#: Counter -> what it counts (one line).
COUNTERS: dict[str, str] = {
    "acquired": "deliveries that took the lease (take-overs included): each ran, or waited to, under it",
    "taken_over": "acquisitions that took an expired owner's lease at delivery, before a recovery pass did",
    "busy_deliveries": "deliveries not run because a live owner held the lease (a duplicate while it ran)",
    "stale_deliveries": "deliveries not run because they were an older copy than the current one",
    "finished_deliveries": "deliveries not run because the task had already finished (a late duplicate)",
    "started": "task bodies marked started under their lease (acquired at receipt, then started)",
    "recovered": "tasks a recovery pass re-published because their owner stopped renewing",
    "dead": "tasks declared dead after leases_max_recoveries recoveries (LeaseExpired stored)",
    "stalled": "leases lost because the task reported no progress within leases_progress_timeout",
    "refused": "outcomes refused because their run no longer held the lease (fencing at work)",
    "late_finishes": "outcomes sent again after a lost reply that arrived too late to apply, changing nothing",
    "retried": "retries handed over to their next attempt under the same lease record",
    "succeeded": "runs finished as succeeded",
    "failed": "runs finished as failed",
    "revoked": "tasks ended as revoked (a revoke, or an expires passed while queued)",
    "reasserted": "records a worker re-created for its live lease after they vanished (a failover)",
    "rerun": "finished task ids run again because the same id was published again",
    "queued": "tasks recorded at publish (publish tracking, leases_delivery_timeout)",
    "undelivered_republished": "queued tasks re-published after waiting undelivered past leases_delivery_timeout",
    "undelivered_expired": "queued tasks revoked because their expires passed before any delivery",
    "results_written": "results recovery stored because the process that finished the task died first",
}


def explain(name: str) -> str:
    """What counter ``name`` counts ("" for one this version does not know)."""
    return COUNTERS.get(name, "")


class StatsHelp(click.Command):
    """Adds the counters and their meaning to ``--help``, after the options."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Lifetime counters (cluster-wide, since the prefix was first used)"):
            formatter.write_dl(list(COUNTERS.items()))
        super().format_epilog(ctx, formatter)
