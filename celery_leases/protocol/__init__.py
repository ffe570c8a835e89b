"""The lease protocol, free of Celery: key names, Lua scripts, the store and its transport.

Importing this package (or any module in it) loads no ``celery.*`` or ``kombu.*`` module,
so a web tier, a script or a test can read and change leases without Celery
(tests/protocol/test_protocol_layer.py holds that). The Celery wiring lives outside it and calls in.

Imports point one way, from the top of this list to the bottom
(tests/protocol/test_protocol_shape.py holds it, and the 400-line limit):

- ``store.py``: ``LeaseStore``, the transitions; it builds on ``core.py`` and composes
  ``transitions.py``, ``renewals.py``, ``recovery.py`` and ``admin.py``;
- ``queued.py`` (publish tracking, the publish side) and ``undelivered.py`` (its recovery side),
  ``unwritten.py`` (kept results), ``settle.py`` and ``clock.py``, ``fencing.py``;
- ``transitions.py`` (``AcquireRequest``, ``FinishRequest`` and the KEYS/ARGV built from
  them), ``renewals.py``, ``recovery.py``, ``admin.py``: each takes a ``StoreCore``;
- ``core.py``: ``StoreCore`` (client, keys, script runner, ``StoreSettings``, plain reads);
- ``calls.py`` (the script runner), ``scripts.py`` and ``scripts/*.lua``, ``records.py``,
  ``keys.py``, ``codes.py``, ``connection.py``, ``errors.py``;
- ``transport/``: the hand-written Redis I/O (``resp.py``, ``direct.py``, ``line.py``);
  ``wire.py`` and ``direct.py`` here re-export it under their former names.
"""
