PY ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed
# The editable install maps only the packages that exist when it runs; once
# celery_leases/__init__.py appears, this marker forces one re-install.
PKG_MARK := $(if $(wildcard celery_leases/__init__.py),$(VENV)/.has-package)
DEMO := $(firstword $(wildcard examples/quickstart/demo.py) examples/payments/run.py)

.PHONY: venv test demo bench clean

venv: $(STAMP)

# Re-install only when the package metadata changes (or the package appears).
# The test extra includes the libfaketime wheel: its libfaketime.so.1 is what the
# clock-skew tests preload (tests/skew.py), so they run on a fresh machine too.
$(STAMP): setup.py Makefile $(PKG_MARK)
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -e '.[test,docs]'
	touch $@

$(VENV)/.has-package:
	mkdir -p $(VENV)
	touch $@

test: venv
	$(VENV)/bin/pytest -q -ra -n 2 --dist loadfile --durations=15 tests/

demo: venv
	@if [ ! -f $(DEMO) ]; then echo "make demo: $(DEMO) does not exist yet" >&2; exit 1; fi
	$(VENV)/bin/python $(DEMO)

bench: venv
	$(VENV)/bin/python bench/store.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
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
# The long form of the chaos suite (tests/test_chaos.py runs the short form):
# the same seeded workload and faults with celery-leases and with plain Celery,
# one table side by side; exits 1 if leases mode breaks an invariant (docs/chaos.md).
SEED ?= 1
TASKS ?= 2000
DURATION ?= 600
WORKERS ?= 3

.PHONY: chaos
chaos: venv
	$(VENV)/bin/python -m chaos.run --seed $(SEED) --tasks $(TASKS) --duration $(DURATION) --workers $(WORKERS) --mode both

# -- adversarial scenarios -----------------------------------------------------
# The scenarios of issue #14 on real redis-servers and real workers
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
# make test runs a quick sample of it (tests/test_celery_suite_sample.py).
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
	$(VENV)/bin/pytest -v -p no:cacheprovider --durations=0 tests/test_cluster.py

# -- Sentinel ------------------------------------------------------------------
# The long form of tests/test_sentinel.py's failover test (make test runs one
# round): SENTINEL_ROUNDS failovers in a row, the old master rejoining as a
# replica each time, the store and a real worker following every promotion.
SENTINEL_ROUNDS ?= 5

.PHONY: sentinel
sentinel: venv
	LEASES_SENTINEL_ROUNDS=$(SENTINEL_ROUNDS) $(VENV)/bin/pytest -q -ra tests/test_sentinel.py tests/test_redis_tls_acl.py

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
# tests/test_matrix.py in one tox env per Celery minor (5.3 to 5.7), each for
# every pool (prefork, threads, solo, gevent, eventlet) x broker (Redis,
# RabbitMQ at $LEASES_TEST_AMQP_URL), plus the lint, type and docs envs; then
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
	$(VENV)/bin/python -m tests.matrix_report $(MATRIX_RESULTS) docs/compatibility.md || status=1; \
	exit $$status
