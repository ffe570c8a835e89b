"""Kept so ``celery_leases.protocol.direct`` still imports: the direct path lives in
transport/direct.py now (the worker's acquirer and users' code import it from here)."""
from __future__ import annotations

from .transport.direct import BUSY, DirectCaller, close_connection, open_connection, read_reply, supported

__all__ = ["DirectCaller", "BUSY", "open_connection", "close_connection", "supported", "read_reply"]
