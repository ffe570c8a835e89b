"""``python -m tests.adversarial [--long] [--out DIR] [NAME ...]``: run scenarios as scripts.

Runs each scenario (all by default, in the order of SCENARIOS), prints its counts as it
ends and one Markdown table at the end (docs/chaos.md keeps one). Exits 1 if any scenario
lost a task, accepted a duplicate, misled a waiter or failed a count of its own.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.adversarial.runner import Counts, table

#: Module names, in the order of their rows in the printed table (docs/chaos.md).
SCENARIOS = (
    "malformed_ids", "finish_timed_out", "poison_pill_threads", "broker_death_after_success",
    "skewed_clocks", "store_restarted_empty", "revoke_terminate", "prefetched_after_pause",
    "main_paused_pool_runs", "volume", "large_arguments", "redis_restart_aof", "poison_pills_shared",
)

#: Scenario-specific counts that must be zero (the rest are reported only).
MUST_BE_ZERO = ("malformed bodies run", "callbacks missing", "callbacks duplicated",
                "deadlines off the server clock", "refusals logged", "revoked re-run",
                "bodies after success", "callbacks not once", "wrong digest", "envelopes kept",
                "active leases left", "worker exits", "innocents never run")


def failed(counts: Counts) -> bool:
    return bool(counts.lost or counts.duplicates or counts.misled
                or counts.exactly_one != counts.submitted
                or any(counts.extra.get(k) for k in MUST_BE_ZERO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.adversarial", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"scenarios (default: all): {', '.join(SCENARIOS)}")
    parser.add_argument("--long", action="store_true", help="the long forms")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the counts here too")
    args = parser.parse_args(argv)
    names = [n.replace("-", "_") for n in args.names] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="adversarial-"))
    rows: list[Counts] = []
    status = 0
    for name in names:
        module = importlib.import_module(f"tests.adversarial.test_{name}")
        started = time.monotonic()
        try:
            counts = module.scenario(out, long=args.long)
        except Exception:  # noqa: BLE001 - one broken scenario must not hide the others' counts
            traceback.print_exc()
            counts = Counts(module.NAME, extra={"crashed": 1})
        counts.extra["seconds"] = round(time.monotonic() - started)
        bad = failed(counts) or counts.extra.get("crashed")
        status |= bool(bad)
        depends = f" (depends on {module.DEPENDS})" if module.DEPENDS and bad else ""
        print(("FAIL " if bad else "ok   ") + counts.line() + depends, flush=True)
        if bad:
            print(counts.explain(), flush=True)
        rows.append(counts)
    print()
    print(table(rows))
    print(f"\nrun directory: {out}")
    if args.json:
        args.json.write_text(json.dumps([c.as_dict() for c in rows], indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
