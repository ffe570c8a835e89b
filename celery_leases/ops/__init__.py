"""Operations: what operators read about a deployment.

- ``diagnosis.py``: the checks ``celery leases doctor`` runs (the command is ``cli/doctor.py``), with the
  start-up findings of ``worker/checks.py``;
- ``metrics.py``: Prometheus metrics (``enable_prometheus(app)``);
- ``tracing.py``: OpenTelemetry (``enable(app)``).
"""
