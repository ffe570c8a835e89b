"""Kept results: an accepted outcome never ends without its result in the backend.

The finish accepts an outcome before Celery writes its result (the fence must
come first, or a stale owner's result could land). A process that dies in
between would leave the task finished with no result, and its waiters waiting
for ever. So when the result is written after the finish (any backend but the
fused Redis write, results.py), the finish also *keeps* that result in the
store (finish.lua), due a while later. The process that wrote it confirms it
at no cost of its own: the ids ride along in its next finish. What nobody
confirms is handed to the recovery pass (claim_unwritten.lua), which writes it
unless the backend already holds a result, and confirms it
(results_written.lua).

The same holds for what the finishing process does after the finish besides
the result: its *follow-ups* (a chord member's count, link callbacks, a chain's
next step). They are kept with the result, or alone when the finish wrote the
result itself, and recovery does those the dead process had not done.

A kept result is one opaque value: a JSON header line (state, task name,
traceback, whether recovery writes the result, the follow-ups) then the
backend's own encoding of the result. Knows nothing of Celery: the wiring
encodes, writes and sends (results.py, followups.py).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .calls import ms
from .records import raise_if_corrupt
from .scripts import scripts

if TYPE_CHECKING:
    from .core import StoreCore

__all__ = ["KEPT_MAX", "UnwrittenResult", "claim", "confirm", "count", "pack", "writes_result"]

#: Largest encoded result kept (bytes): a bigger one is left to Celery's own write
#: alone, so a finish never carries a large payload twice (docs/celery.md).
KEPT_MAX = 64 * 1024


@dataclass(frozen=True)
class UnwrittenResult:
    """A kept result recovery must write: what Celery would have stored."""

    task_id: str
    state: str
    name: str
    traceback: str | None
    #: The result as the backend encoded it (``backend.encode``).
    encoded: bytes
    #: When the finish kept it (the finishing process's clock, seconds since the epoch).
    kept_at: float = 0.0
    #: False when recovery must not write the result (the finish wrote it, or Celery stores
    #: none): only the follow-ups are kept.
    write: bool = True
    #: What the process does after the finish besides the result, as the wiring described
    #: it (JSON values); None: nothing.
    follow_ups: dict | None = None

    @classmethod
    def unpack(cls, task_id: str, value: bytes) -> "UnwrittenResult":
        head, _, encoded = value.partition(b"\n")
        meta = json.loads(head)
        return cls(task_id, str(meta["state"]), str(meta.get("name") or ""), meta.get("traceback"),
                   encoded, float(meta.get("at") or 0.0), bool(meta.get("write", True)),
                   meta.get("after"))


def pack(state: str, name: str, traceback: str | None, encoded: bytes | str,
         at: float | None = None, *, write: bool = True, follow_ups: dict | None = None) -> bytes:
    """The kept value finish.lua stores for one outcome (``at``: now by default).

    Raises TypeError or ValueError when ``follow_ups`` is not JSON."""
    meta: dict[str, Any] = {"state": state, "name": name, "traceback": traceback,
                            "at": round(time.time() if at is None else at, 3)}
    if not write:
        meta["write"] = False
    if follow_ups:
        meta["after"] = follow_ups
    head = json.dumps(meta, separators=(",", ":")).encode()
    return head + b"\n" + (encoded.encode("utf-8") if isinstance(encoded, str) else encoded)


def writes_result(kept: bytes) -> bool:
    """Whether recovery would write the result of this kept value (``pack(write=...)``)."""
    head = kept.partition(b"\n")[0]
    return bool(json.loads(head).get("write", True))


def claim(store: "StoreCore", limit: int | None = None) -> list[UnwrittenResult]:
    """Kept results past their due time, from every shard; each is handed out again
    ``publish_grace`` later unless confirmed meanwhile (claim_unwritten.lua)."""
    limit = limit or store.settings.recover_batch
    calls = [([shard.unwritten, shard.unwritten_results], [ms(max(store.settings.publish_grace, 1.0)), limit])
             for shard in store.keys.all_shards()]
    out = []
    for reply in store.calls.run_many(scripts.claim_unwritten, calls, "unwritten results"):
        raise_if_corrupt(reply, "claiming unwritten results")
        for task_id, value in zip(reply[::2], reply[1::2]):
            out.append(UnwrittenResult.unpack(task_id.decode(), value))
    return out


def confirm(store: "StoreCore", task_ids: Iterable[str], wrote: int = 0) -> None:
    """Celery wrote the results of ``task_ids`` (``wrote`` of them by recovery)."""
    by_shard = store.keys.by_shard(task_ids)
    calls: list[tuple[list[str], list[Any]]] = []
    for index, ids in by_shard.items():
        shard = store.keys.shard(index)
        calls.append(([shard.unwritten, shard.unwritten_results, shard.stats],
                      [wrote if not calls else 0, *ids]))
    for reply in store.calls.run_many(scripts.results_written, calls, "confirming written results"):
        raise_if_corrupt(reply, "confirming written results")


def count(store: "StoreCore") -> int:
    """Kept results not yet confirmed, over every shard."""
    def read() -> list:
        pipe = store.client.pipeline(transaction=False)
        for shard in store.keys.all_shards():
            pipe.zcard(shard.unwritten)
        return pipe.execute()
    return sum(int(n) for n in store.calls.read(read, "counting unwritten results"))


def riding(store: "StoreCore", task_id: str, written: Sequence[str]) -> list[str]:
    """The confirmations a finish of ``task_id`` can carry: those of its own shard."""
    if store.shards == 1:
        return list(written)
    shard = store.keys.shard_of(task_id)
    return [t for t in written if store.keys.shard_of(t) == shard]
