"""``python -m celery_leases.testing APP worker ...``: the worker side of ``testing.Worker``."""
import sys

from .workers import worker_main

sys.exit(worker_main(sys.argv[1:]))
