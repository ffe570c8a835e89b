"""Redis key names. Every key of one prefix carries the same hash tag.

All keys share the tag ``{<prefix>}`` so every script touches a single Redis
Cluster slot (a renew of many leases and a recovery pass over many records are
then legal on a cluster).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "leases"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{} \n"):
            raise ValueError(
                f"leases_key_prefix {self.prefix!r} must be non-empty and contain "
                "no braces or whitespace")

    @property
    def tag(self) -> str:
        return "{" + self.prefix + "}"

    def record(self, task_id: str) -> str:
        """Hash holding one task's lease record."""
        return f"{self.tag}:lease:{task_id}"

    def message(self, task_id: str) -> str:
        """Hash holding the message a recovery would re-publish (body, envelope).

        Kept apart from the record so the record stays small enough for
        Redis's compact hash encoding, and is deleted when the task finishes.
        """
        return f"{self.tag}:msg:{task_id}"

    @property
    def deadlines(self) -> str:
        """Sorted set: task id -> deadline (ms, server clock) of active/recovering leases."""
        return f"{self.tag}:deadlines"

    @property
    def sequence(self) -> str:
        """Counter the fencing tokens are drawn from."""
        return f"{self.tag}:seq"

    @property
    def stats(self) -> str:
        """Hash of lifetime counters (acquired, recovered, refused, ...)."""
        return f"{self.tag}:stats"

    @property
    def recovery_guard(self) -> str:
        """String key held by the worker whose turn it is to run a recovery pass."""
        return f"{self.tag}:recovery-guard"

    def fence(self, resource: str) -> str:
        """Hash guarding one fenced resource (see celery_leases.fencing)."""
        return f"{self.tag}:fence:{resource}"

    def record_prefix(self) -> str:
        return f"{self.tag}:lease:"
