"""Lua script loader: each ``scripts/<name>.lua`` is loaded once and called by SHA.

The shared ``_prelude.lua`` is prepended to every script; a script that runs
another one's body (``EMBEDDED``) gets it after the prelude, as a local
function of (KEYS, ARGV) named after it, so a rule has one copy. A server that lost
its script cache (restart, SCRIPT FLUSH, failover) answers NOSCRIPT; the call is
then repeated once with the full source, which also reloads the cache
(calls.py, the one place that does it).
"""
from __future__ import annotations

import hashlib
from importlib import resources

from .codes import STATES, TERMINAL_STATES, Code

SCRIPT_NAMES = (
    "acquire", "acquire_many", "reassert", "renew_many", "finish", "hand_over", "claim_expired", "mark_published",
    "release", "progress", "expired", "fenced_write", "complete_step", "purge",
    "park", "unpark",
    "revoke",
    "mark_started",
    "enqueue", "claim_undelivered", "forget",
    "claim_unwritten", "results_written",
)

#: Script -> the script whose body it calls as a function: ``local function acquire(KEYS, ARGV)``.
EMBEDDED = {"acquire_many": "acquire"}


def _read(name: str) -> str:
    return resources.files(__package__).joinpath("scripts", f"{name}.lua").read_text("utf-8")


def constants() -> str:
    """The Lua lines naming every return code, the known and the terminal states, from codes.py
    (their only copy)."""
    lines = ["-- Generated from celery_leases/protocol/codes.py by scripts.py."]
    lines += [f"local {code.name} = {int(code)}" for code in Code]
    lines.append("local TERMINAL_STATES = {" + ", ".join(f"{s} = true" for s in sorted(TERMINAL_STATES)) + "}")
    lines.append("local KNOWN_STATES = {" + ", ".join(f"{s} = true" for s in STATES) + "}")
    return "\n".join(lines)


def source(name: str) -> str:
    """The full source sent to Redis: the generated constants, the prelude, the script file
    (after the script it embeds, if any)."""
    embedded = EMBEDDED.get(name)
    body = _read(name) if embedded is None else \
        f"local function {embedded}(KEYS, ARGV)\n{_read(embedded)}\nend\n{_read(name)}"
    return constants() + "\n" + _read("_prelude") + "\n" + body


class Script:
    """One Lua script, called by SHA with a NOSCRIPT fallback to EVAL (calls.py)."""

    __slots__ = ("name", "source", "sha")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = source(name)
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()


class Scripts:
    """Every script of the package, read from disk once per process."""

    _cache: "dict[str, Script]" = {}

    def __getattr__(self, name: str) -> Script:
        if name.startswith("_"):
            raise AttributeError(name)
        script = self._cache.get(name)
        if script is None:
            if name not in SCRIPT_NAMES:
                raise AttributeError(f"no Lua script named {name!r}")
            script = self._cache[name] = Script(name)
        return script


    def load_all(self) -> None:
        """Read every script now, so a process never mixes two versions of the package on disk."""
        for name in SCRIPT_NAMES:
            getattr(self, name)


scripts = Scripts()
