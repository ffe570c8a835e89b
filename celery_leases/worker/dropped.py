"""Which requests a consumer restart dropped, so that their leases are released at once.

On a broker connection loss (and at shutdown) Celery's consumer discards its
prefetched and ETA-held requests; their messages come back from the broker, so
their leases must go back too. Which requests a *pool* still runs depends on it:

- threads, solo and the green pools keep every job they were given and run it;
- prefork's pool (``Consumer.on_close`` calls its ``flush``) discards the jobs it
  has not seen accepted, but a job whose write to a pool process had begun is
  still written in full and that process runs it (unless the pool waits for a
  synack, where such jobs are cancelled). Its request is not yet among Celery's
  active requests, and after the flush the pool no longer knows the job, so the
  jobs given to a process are noted just before the flush: releasing one of those
  leases would let the copy the broker hands back run a second time.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from celery.worker.state import active_requests

__all__ = ["DroppedRequests"]

#: Marks the pool's flush as wrapped (a consumer restarts many times; wrap it once).
_WRAPPED = "_celery_leases_notes_jobs"


class DroppedRequests:
    """Tells, after a consumer stop, which held requests will never run in this worker."""

    def __init__(self, held_requests: Callable[[], Iterable[Any]]) -> None:
        self._held_requests = held_requests
        #: id() of each request a prefork process was given, noted at the last flush.
        self._in_processes: set[int] | None = None
        self._discards = False

    def watch(self, pool: Any) -> None:
        """Wrap a discarding pool's ``flush`` (prefork's, set when the pool starts) once."""
        flush = getattr(pool, "flush", None)
        inner = getattr(pool, "_pool", None)
        if flush is None or inner is None or not hasattr(inner, "outbound_buffer"):
            return  # a pool that keeps and runs every job it was given
        self._discards = True
        if getattr(flush, _WRAPPED, False):
            return
        synack = bool(getattr(inner, "synack", False))

        def flush_noting_given_jobs(*args: Any, **kwargs: Any) -> Any:
            self._in_processes = {id(r) for r in self._held_requests() if _given_to_process(r, synack)}
            return flush(*args, **kwargs)

        setattr(flush_noting_given_jobs, _WRAPPED, True)
        pool.flush = flush_noting_given_jobs

    def rule(self) -> Callable[[Any], bool]:
        """request -> True if it will not run here, so its lease can be released now."""
        running = {id(request) for request in list(active_requests)}
        given = self._in_processes

        def dropped(request: Any) -> bool:
            if request is None or id(request) in running:
                return False
            if not self._discards:
                return getattr(request, "_apply_result", None) is None  # never handed to the pool
            return given is None or id(request) not in given
        return dropped

    def settled(self) -> None:
        """The consumer stop has been handled: the next one notes its own jobs."""
        self._in_processes = None


def _given_to_process(request: Any, synack: bool) -> bool:
    """Whether a prefork process has (or is being written) ``request``'s job and will run it."""
    ref = getattr(request, "_apply_result", None)
    job = ref() if ref is not None else None  # Celery keeps a weak reference to the job
    if job is None:
        return False
    if getattr(job, "_accepted", False):
        return True
    return not synack and getattr(job, "_write_to", None) is not None
