"""Every hand-written piece of Redis I/O in the protocol, in one place.

Everything else in the store talks to Redis through redis-py (``calls.py``,
pipelines, plain reads). Three pieces write and read sockets themselves, each
because redis-py's per-call work is measurable on a hot path (the figures, and
what redis-py with hiredis costs instead: docs/architecture.md, "Transport",
from ``bench/transport.py``):

- ``resp.py``: RESP packing (``pack``, ``segments``) and parsing (``parse``,
  ``Scanner``), also used by the worker's acquirer (worker/acquirer.py), which
  pipelines acquires on a socket of its own read by the event loop;
- ``direct.py``: ``DirectCaller``, script calls on a connection held per
  process (the finish from a pool process or thread, a blocking acquire);
  concurrent callers share its writes;
- ``line.py``: ``Line``, the publish line: an enqueue written before the message
  is published and its reply read after.

Connections are always opened by redis-py (``open_connection``): TLS, AUTH,
SELECT and Sentinel's current master stay its business.
"""
from __future__ import annotations

from .direct import DirectCaller, close_connection, open_connection, read_replies, read_reply, supported
from .line import RECORDED, Line
from .resp import ERRORS, Incomplete, Scanner, pack, parse, segments

__all__ = ["pack", "segments", "parse", "Incomplete", "ERRORS", "Scanner", "DirectCaller", "read_replies",
           "open_connection", "close_connection", "supported", "read_reply", "Line", "RECORDED"]
