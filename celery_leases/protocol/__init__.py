"""The lease protocol, free of Celery: key names, Lua scripts, the store and its transport.

Importing this package (or any module in it) loads no ``celery.*`` or ``kombu.*`` module,
so a web tier, a script or a test can read and change leases without Celery
(tests/protocol/test_protocol_layer.py holds that). The Celery wiring lives outside it and calls in.
"""
