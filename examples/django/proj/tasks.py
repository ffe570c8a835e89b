"""proj/tasks.py (in Django: ``<app>/tasks.py``): leased tasks, with per-task lease options."""
from celery import shared_task

from celery_leases import LeasedTask


@shared_task(base=LeasedTask, bind=True)
def send_invoice(self, invoice_id: int) -> str:
    """Uses the project's lease settings."""
    self.lease.check()
    return f"invoice {invoice_id} sent under token {self.lease.token}"


@shared_task(base=LeasedTask, bind=True, lease_ttl=300, lease_progress_timeout=120)
def rebuild_search_index(self, batch_size: int = 500) -> int:
    """A long job: a longer lease, and it must report progress at least every 2 minutes."""
    done = 0
    for _batch in range(3):
        done += batch_size
        self.lease.heartbeat()   # progress: without it the lease is lost after 120 s
    return done
