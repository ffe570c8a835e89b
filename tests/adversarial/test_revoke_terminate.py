"""Issue #14 item 7 and #15 item 8: ``revoke(id, terminate=True)`` of a running task.

Given a prefork worker running a long task beside ordinary ones; when the long task is
revoked with ``terminate=True``; then its waiter gets REVOKED, the lease says revoked, no
"outcome refused" is logged nor ``stale_outcome_rejected`` sent for it, recovery never runs
it again, and the ordinary tasks each succeed once.
"""
from __future__ import annotations


from tests.adversarial.runner import Counts, Run, wait_until

NAME = "revoke-terminate"
DEPENDS = "revoke as one script (revoke.lua); terminate recorded as a revoke, not a refused outcome"


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory) as run:
        run.server("main")
        run.wire("main")
        worker = run.worker("p", "prefork", 2)
        revoked = []
        for _ in range(3 if long else 1):
            victim = run.submit(8.0, expect="revoked")
            for _ in range(3):
                run.submit(0.2)
            wait_until(lambda: any(e["task"] == victim for e in run.starts()), 15, "the victim to start")
            run.client.control.revoke(victim, terminate=True, signal="SIGKILL")
            revoked.append(victim)
        run.mark_fault_end()
        counts = run.settle(timeout=20, quiet=2.0 * run.ttl + 2)  # room for a wrongful recovery
        history = run.history()
        counts.extra["refusals logged"] = (worker.log().count("outcome refused")
                                           + sum(1 for e in history if e["ev"] == "refused"))
        counts.extra["revoked re-run"] = sum(
            1 for v in revoked if sum(1 for e in history if e["ev"] == "start" and e["task"] == v) > 1)
        return counts


def test_revoke_terminate_is_clean(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"refusals logged": 0, "revoked re-run": 0})
