"""The publisher side: what a process that sends leased tasks does with each publish.

- ``publish_id.py``: the publish id stamped on each message (``lease_publish``);
- ``tracking.py``: publish tracking, a leased task recorded in the store as it is published;
- ``batches.py``: a group's (or the outbox relay's) records written as one batch;
- ``serialize.py``: the message as kombu will publish it, serialized once;
- ``held_records.py``: records held while the lease store is unreachable, written later;
- ``one_call.py``: the record and the broker's LPUSH in one script call;
- ``undelivered.py``: the recovery step's Celery side for tasks no worker acquired.
"""
