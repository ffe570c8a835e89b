"""celery-leases: renewable task ownership with fencing tokens for Celery.

    import celery_leases
    celery_leases.install(app)

    @app.task(base=celery_leases.LeasedTask, bind=True)
    def charge(self, order_id): ...

The public names below are loaded on first use (PEP 562), so that
``import celery_leases.protocol`` (the Celery-free protocol) does not import
the task class, the signals or anything else that needs Celery.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ below loads them
    from .exceptions import (ConfigurationError, CorruptRecord, DeliveryParked, LeaseError,
                             LeaseExpired, LeaseLost, LeaseUnavailable, StaleFence)
    from .install import install, store
    from .protocol.codes import Code
    from .protocol.fencing import fenced_get, fenced_set, fenced_update, idempotency_key
    from .protocol.records import Acquisition, Claim, LeaseRecord, Parked, RecoveryReport
    from .protocol.store import LeaseStore
    from .signals import (callbacks_failed, delivery_parked, delivery_refused, lease_acquired,
                          lease_dead, lease_lost, lease_recovered, leases_renewed,
                          stale_outcome_rejected)
    from .task import LeasedTask, StaleOutcome

__version__ = "0.1.0"

#: Public name -> the module that defines it (relative to this package).
_WHERE = {
    "install": ".install", "store": ".install",
    "LeasedTask": ".task", "StaleOutcome": ".task",
    "Code": ".protocol.codes",
    "LeaseStore": ".protocol.store",
    "LeaseRecord": ".protocol.records", "Acquisition": ".protocol.records",
    "Claim": ".protocol.records", "RecoveryReport": ".protocol.records",
    "Parked": ".protocol.records",
    "fenced_set": ".protocol.fencing", "fenced_get": ".protocol.fencing",
    "fenced_update": ".protocol.fencing", "idempotency_key": ".protocol.fencing",
    **dict.fromkeys(["LeaseError", "LeaseLost", "LeaseExpired", "LeaseUnavailable",
                     "CorruptRecord", "DeliveryParked", "ConfigurationError", "StaleFence"],
                    ".exceptions"),
    **dict.fromkeys(["lease_acquired", "lease_lost", "lease_recovered", "lease_dead",
                     "stale_outcome_rejected", "leases_renewed", "delivery_refused",
                     "delivery_parked", "callbacks_failed"], ".signals"),
}

#: Documented modules reachable as attributes of the package without their own import.
_SUBPACKAGES = frozenset({"config", "protocol", "testing"})

#: Modules that moved into the layer packages (docs/architecture.md, "Old module paths"),
#: old name -> where they live now. ``import celery_leases.metrics`` still works and gives
#: the very module ``celery_leases.ops.metrics`` (one module object: its state is shared).
MOVED = {f"{__name__}.{old}": f"{__name__}.{new}" for old, new in {
    "request": "task.request", "lease": "task.lease", "results": "task.results",
    "callbacks": "task.callbacks",
    "tracking": "publishing.tracking", "publish": "publishing.publish_id",
    "one_call": "publishing.one_call",
    "parking": "recovery.parking", "messages": "recovery.messages",
    "worker.fallback": "recovery.fallback", "worker.outage": "outage",
    "checks": "worker.checks", "doctor": "ops.diagnosis", "metrics": "ops.metrics",
    "tracing": "ops.tracing",
}.items()}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of ``MOVED`` (only when no file of that name exists: it is
    consulted after the regular finders) and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> types.ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # loaded already, under its new name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = [
    "install", "store", "LeasedTask", "Code", "LeaseStore", "LeaseRecord", "Acquisition",
    "Claim", "RecoveryReport", "Parked", "LeaseError", "LeaseLost", "LeaseExpired", "LeaseUnavailable",
    "CorruptRecord", "DeliveryParked", "ConfigurationError", "StaleFence", "StaleOutcome",
    "lease_acquired", "lease_lost", "lease_recovered", "lease_dead", "stale_outcome_rejected",
    "leases_renewed", "delivery_refused", "delivery_parked", "callbacks_failed",
    "fenced_set", "fenced_get", "fenced_update", "idempotency_key",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use, then keep it here."""
    where = _WHERE.get(name)
    if where is None:
        if name in _SUBPACKAGES:
            # ``import celery_leases`` then ``celery_leases.config.get_config(app)``, as documented.
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps ``celery_leases.install`` the function when the submodule of that name loads.

    Importing a submodule binds it on its package (``celery_leases.install = <module>``);
    with the eager imports gone that would now happen after this package is loaded and
    hide ``install(app)``. The submodule stays reachable in ``sys.modules``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
