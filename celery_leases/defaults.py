"""Default values of every ``leases_*`` setting (documented in docs/configuration.md)."""
from __future__ import annotations

#: Key prefix of every lease key; one prefix is one independent lease namespace.
KEY_PREFIX = "leases"
#: Seconds a lease lives without a heartbeat.
TTL = 30.0
#: Seconds between heartbeats; None means ttl / 3.
HEARTBEAT_INTERVAL = None
#: Seconds between recovery passes (in the workers; beat's entry only without worker recovery).
RECOVERY_INTERVAL = 5.0
#: Recoveries allowed before a task is declared dead.
MAX_RECOVERIES = 3
#: Seconds a task may go without self.lease.heartbeat(); None disables the check.
PROGRESS_TIMEOUT = None
#: Seconds a task recorded at publish may stay undelivered (no worker acquired it) after it
#: became due before recovery presumes the broker lost it and re-publishes it; None or 0: off.
DELIVERY_TIMEOUT = 600.0
#: Seconds finished records are kept so late duplicate deliveries are recognised.
RETENTION = 86400.0
#: Seconds a recovery claim waits for its publish to be confirmed before it is re-claimed.
PUBLISH_GRACE = 30.0
#: Shards of the deadline index and records (hash tags); above 1 spreads them over a Redis Cluster.
SHARDS = 1
#: Leases claimed per recovery script call.
RECOVER_BATCH = 500
#: What a worker does with a running task whose lease it learns was lost: "flag" or "terminate".
ON_LOST = "flag"
#: Queue that receives the message of a dead task, for inspection; None disables it.
DEAD_LETTER_QUEUE = None
#: Seconds before a delivery that could not reach the lease store is tried again.
UNAVAILABLE_RETRY_DELAY = 5.0
#: Longest delay of a re-queued copy: the delay doubles with each re-queue of a delivery up to this.
UNAVAILABLE_RETRY_MAX_DELAY = 300.0
#: Deliveries of one task id a worker process admits per minute; later ones are postponed.
DELIVERIES_PER_MINUTE = 20
#: On a Redis broker with publish tracking on: whether a worker keeps the deliveries of tasks
#: recorded at publish in memory only, without kombu's unacked hash (worker/held.py).
HELD_DELIVERIES = True
#: Whether workers run recovery passes themselves (one at a time) so recovery survives beat being down.
WORKER_RECOVERY = True
#: Threads pools (concurrency above 1): the finish of a task whose outcome nobody reads is
#: sent in the background, several in one write, instead of a round trip the task waits for.
BACKGROUND_FINISHES = True
#: Whether install() adds the beat entry for celery_leases.recover; None (the default):
#: only when WORKER_RECOVERY is off, so that one recoverer, not two, runs each interval.
BEAT_SCHEDULE = None
#: Tries to publish each link callback / next chain step of an accepted success
#: (celery_leases/task/callbacks.py), each after Celery's own publish retries.
CALLBACK_SEND_ATTEMPTS = 8
#: Seconds before the second try; doubled after each failed try, up to CALLBACK_SEND_MAX_DELAY.
CALLBACK_SEND_DELAY = 0.5
CALLBACK_SEND_MAX_DELAY = 10.0
#: Port of the worker's HTTP endpoint (/livez, /readyz, /metrics; worker/health.py); None: off.
HTTP_PORT = None
#: Address the worker's HTTP endpoint binds to: every interface, as a container's probes need.
HTTP_HOST = "0.0.0.0"
#: File whose modification time the worker sets every second while it is live, for exec
#: probes; None: off.
HEALTH_FILE = None
#: The database whose outbox the workers relay (celery_leases/outbox/); None: no relay.
OUTBOX_URL = None
#: The outbox table ('name' or 'schema.name'); its parked rows go to '<name>_parked'.
OUTBOX_TABLE = "celery_leases_outbox"
#: Seconds between two looks of a relay at the outbox (PostgreSQL's NOTIFY wakes it sooner).
OUTBOX_POLL_INTERVAL = 1.0
