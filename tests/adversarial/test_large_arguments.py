"""Issue #14, a case that must hold: 10 MB arguments.

Given tasks whose argument is 10 MB (the lease record keeps the message to re-publish);
when they run on prefork and threads workers; then each is accepted once with the right
digest, and the lease store holds no copy of the message once they finished.
"""
from __future__ import annotations

import hashlib

from tests.adversarial.runner import Counts, Run

NAME = "large-arguments"
DEPENDS = None


def scenario(directory, long: bool = False) -> Counts:
    with Run(NAME, directory) as run:
        run.server("main")
        run.wire("main")
        run.worker("p", "prefork", 2)
        run.worker("t", "threads", 2)
        data = {}
        for i in range(6 if long else 3):
            blob = (f"{i}" * 1024 * 1024 * 10)[: 10 * 1024 * 1024]
            data[run.submit(name="adv.blob", args=(blob,))] = hashlib.sha256(blob.encode()).hexdigest()[:16]
        run.mark_fault_end()
        counts = run.settle(timeout=60)
        backend = run.client.backend
        counts.extra["wrong digest"] = sum(
            1 for t, sha in data.items() if (backend.get_task_meta(t).get("result") or {}).get("sha") != sha)
        store = run.store()
        counts.extra["envelopes kept"] = sum(
            1 for t in data if store.client.exists(store.keys.message(t)))
        return counts


def test_ten_megabyte_arguments_run_once(tmp_path):
    counts = scenario(tmp_path)
    print(counts.line())
    counts.assert_clean(**{"wrong digest": 0, "envelopes kept": 0})
