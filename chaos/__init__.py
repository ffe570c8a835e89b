"""Chaos suite: real Redis, real ``celery worker`` processes, seeded faults, a history checker.

- ``chaos.app``: the Celery app chaos workers run, configured from the environment
  (mode ``leases`` or ``plain``), with the one workload task ``chaos.work``.
- ``chaos.history``: per-process, append-only execution histories (JSON lines).
- ``chaos.faults``: the workload and the fault schedule, both reproducible from a seed.
- ``chaos.cluster``: the Redis server(s) and worker processes a run drives faults into.
- ``chaos.checker``: the invariants, checked over the history and the final state.
- ``chaos.run``: ``python -m chaos.run --seed S --tasks N --duration D --mode both``.

See docs/chaos.md for what is checked, the semantics decisions and a recorded long run.
"""
