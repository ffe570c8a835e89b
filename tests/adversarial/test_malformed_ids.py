"""Issue #14 item 1 and #15 item 2: malformed messages in the task stream.

Given a prefork worker taking ordinary tasks; when messages any client could send arrive
among them (an ``id`` that is null, a float, a string with a lone surrogate; a
non-integer ``lease_generation`` or ``retries`` header); then no malformed message runs a
body, and every ordinary task, before and after them, is accepted once with its own token.
"""
from __future__ import annotations

import uuid

from tests.adversarial.runner import Counts, Run

NAME = "malformed-ids"
DEPENDS = "malformed ids and headers parked at receipt, before the acquirer"

MALFORMED = (
    {"id": None},
    {"id": 1.5},
    {"id": "bad-\udc80-id"},
    {"lease_generation": "x"},
    {"retries": "two"},
    {"lease_generation": [1]},
)


def scenario(directory, long: bool = False) -> Counts:
    rounds = 5 if long else 1
    with Run(NAME, directory) as run:
        run.server("main")
        run.wire("main")
        run.worker("p", "prefork", 2, ADV_PREFETCH="4")
        for _ in range(rounds):
            for _ in range(4):
                run.submit(0.1)
            for headers in MALFORMED:
                run.publish_raw({"id": str(uuid.uuid4()), **headers})
            for _ in range(6):
                run.submit(0.1)
        run.mark_fault_end()
        counts = run.settle(timeout=30 + 10 * rounds, quiet=2.0)
        counts.extra["malformed bodies run"] = sum(1 for e in run.starts() if e.get("seq") == -1)
        return counts


def test_malformed_messages_run_no_body_and_mix_up_no_token(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"malformed bodies run": 0})
