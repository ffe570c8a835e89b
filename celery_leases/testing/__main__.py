"""``python -m celery_leases.testing APP worker ...``: the worker side of ``testing.Worker``."""
import sys

# As the ``celery`` command does before anything else is imported: a gevent or eventlet
# pool (``-P gevent``) needs its monkey patches first, or the worker runs an unpatched
# event loop whose blocking calls stall every greenlet.
from celery import maybe_patch_concurrency

maybe_patch_concurrency(sys.argv)

from .workers import worker_main  # noqa: E402

sys.exit(worker_main(sys.argv[1:]))
