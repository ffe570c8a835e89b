"""Kept so ``celery_leases.protocol.wire`` still imports: RESP packing and parsing live in
transport/resp.py now (the worker's acquirer and users' code import them from here)."""
from __future__ import annotations

from .transport.resp import _PACKED_LEN, _PACKED_MAX, ERRORS, Incomplete, Scanner, _packed, pack, parse, segments

__all__ = ["pack", "segments", "parse", "Incomplete", "ERRORS", "Scanner", "_packed", "_PACKED_MAX", "_PACKED_LEN"]
