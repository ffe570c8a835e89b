"""Exceptions of the package as a result backend stores and rebuilds them (Celery's own serialization)."""
from __future__ import annotations

import json
import pickle

import pytest
from celery import Celery

from celery_leases import (ConfigurationError, CorruptRecord, DeliveryParked, LeaseError, LeaseExpired,
                           LeaseLost, LeaseUnavailable, StaleFence)

#: One of each error the package raises or stores, with the fields a waiter reads.
ERRORS = [
    (LeaseExpired("abc", 3), {"task_id": "abc", "recoveries": 3}),
    (LeaseLost("abc", 7, "taken over"), {"task_id": "abc", "token": 7, "reason": "taken over"}),
    (LeaseLost("abc"), {"task_id": "abc", "token": None, "reason": "lost"}),
    (CorruptRecord("{p}:lease:abc: field token is not an integer", "{p}:lease:abc", "token"),
     {"key": "{p}:lease:abc", "field": "token"}),
    (DeliveryParked("abc", "corrupt record", "{p}:lease:abc", "token"),
     {"task_id": "abc", "reason": "corrupt record", "key": "{p}:lease:abc", "field": "token"}),
    (StaleFence("ledger:42", 3, 5), {"resource": "ledger:42", "token": 3, "current": 5}),
    (LeaseUnavailable("lease store at redis://h:1/0 unreachable"), {}),
    (ConfigurationError("leases_ttl must be a number > 0, got '30s'"), {}),
]


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("error,fields", ERRORS, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_every_error_of_the_package_comes_back_from_the_result_backend_as_it_was_stored(
        error, fields, serializer):
    # Given a result backend of either serializer
    app = Celery("t", backend="cache+memory://")
    app.conf.result_serializer = serializer
    app.conf.accept_content = app.conf.result_accept_content = ["json", "pickle"]
    backend = app.backend
    # When it stores the error (as Celery does for a task's failure) and a waiter rebuilds it
    stored = backend.prepare_exception(error)
    if serializer == "json":
        stored = json.loads(json.dumps(stored))
    rebuilt = backend.exception_to_python(stored)
    # Then the waiter gets the same type, fields and text: nothing doubled, nothing lost
    assert type(rebuilt) is type(error) and isinstance(rebuilt, LeaseError)
    assert {name: getattr(rebuilt, name) for name in fields} == fields
    assert str(rebuilt) == str(error)
    # And so does a pickle (a prefork child hands its exception to the main process so)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert {name: getattr(again, name) for name in fields} == fields


def test_the_text_of_a_parked_delivery_names_the_task_once_and_the_replay_command():
    text = str(DeliveryParked("abc", "corrupt record", "{p}:lease:abc", "token"))
    assert text.count("abc") == 3  # the task, the key, the replay command
    assert text.startswith("delivery of task abc parked (key {p}:lease:abc, field token): corrupt record")
    assert text.endswith("replay with `celery leases replay abc`")
