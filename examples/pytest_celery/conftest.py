"""pytest-celery's celery_setup on local processes, leased workers (no Docker)."""
import pytest

pytest_plugins = ["celery_leases.testing.pytest_celery"]


@pytest.fixture
def default_worker_tasks(default_worker_tasks: set) -> set:
    """pytest-celery's customisation fixture: our tasks module runs in every worker."""
    import tasks

    default_worker_tasks.add(tasks)
    return default_worker_tasks
